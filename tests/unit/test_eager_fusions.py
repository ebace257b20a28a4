"""``megatron.compat.eager_fusions``: megatron-core imported on a CPU-only torch without torch's
compilers (its ``torch.compile``-decorated fusions run eagerly), and ``torch.compile`` itself
untouched afterwards. A fresh interpreter: the test process may have imported megatron already."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys, torch
from liveshard.runtime.megatron import compat
real = torch.compile
with compat.eager_fusions():
    import megatron.core.distributed, megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
from megatron.core import jit
from megatron.core.fusions.fused_bias_geglu import geglu
x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
a, b = torch.chunk(x, 2, -1)
print(json.dumps({
    "compilers": sorted(m for m in ("torch._inductor.compile_fx", "torch._dynamo") if m in sys.modules),
    "fuser_is_identity": jit.jit_fuser(len) is len,
    "compile_restored": torch.compile is real,
    "geglu_eager": bool(torch.equal(geglu(x), torch.nn.functional.gelu(a, approximate="tanh") * b)),
}))
"""


def test_megatron_imports_without_torchs_compilers_and_its_fusions_run_eagerly():
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out == {"compilers": [], "fuser_is_identity": True, "compile_restored": True, "geglu_eager": True}, out
