"""Third-party noise stays off the console.

On a machine with the CUDA toolkit but no GPU (``nvcc`` on PATH), a CUDA build of torch logs
``No CUDA runtime is found, using CUDA_HOME=...`` when ``torch.utils.cpp_extension`` is imported
(megatron-core imports it): it was the first stderr line of every command, so a one-line error
had two. This machine's torch may be a CPU build, which never looks for CUDA_HOME: the test makes
that import behave as a CUDA build's on no GPU (``torch.cuda._is_compiled``, ``is_available``,
``torch.version.cuda``, for that import only), with a fake ``nvcc`` on PATH, in the order a
command imports (liveshard first, then torch and megatron), and runs a command that fails with
one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

from liveshard.runtime import quiet

SCRIPT = """
import sys
import liveshard.runtime  # what every liveshard command imports first
import torch
saved = torch.cuda._is_compiled, torch.cuda.is_available, torch.version.cuda
# a CUDA build of torch, on no GPU
torch.cuda._is_compiled, torch.cuda.is_available, torch.version.cuda = (lambda: True), (lambda: False), "12.8"
import torch.utils.cpp_extension  # what importing megatron-core does
torch.cuda._is_compiled, torch.cuda.is_available, torch.version.cuda = saved
assert torch.utils.cpp_extension.CUDA_HOME == sys.argv[1], torch.utils.cpp_extension.CUDA_HOME
from liveshard.runtime.cli import main
sys.exit(main(["plan", "--model", "no-such-model", "--gpus", "8"]))
"""


def test_a_cuda_toolkit_without_a_gpu_adds_no_line_to_a_one_line_error(tmp_path):
    bin_dir = tmp_path / "cuda" / "bin"
    bin_dir.mkdir(parents=True)
    nvcc = bin_dir / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n")
    nvcc.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "cuda")], env=env, capture_output=True,
                          text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("liveshard plan: error:"), proc.stderr


def test_third_party_warnings_go_to_the_log_once_and_liveshards_own_to_the_console(tmp_path, monkeypatch):
    log = tmp_path / "warnings.log"
    shown: list[str] = []  # the console's
    monkeypatch.setattr(quiet, "_routed", {})
    saved = warnings.showwarning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = lambda message, *rest: shown.append(str(message))
            quiet.warnings_to(log)
            for lineno in (10, 20):  # megatron warns from every module that imports the fallback
                warnings.warn_explicit("Transformer Engine and Apex are not installed", UserWarning,
                                       "/venv/lib/python3.11/site-packages/megatron/core/x.py", lineno)
            warnings.warn_explicit("a liveshard warning", UserWarning, quiet.__file__, 1)
    finally:
        warnings.showwarning = saved
    assert log.read_text().count("Transformer Engine and Apex are not installed") == 1
    assert shown == ["a liveshard warning"]
