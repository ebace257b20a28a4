"""Nothing loaded from a checkpoint runs code, on every load path.

A checkpoint written by the project's own save path (``agent.checkpoint.save``) is crafted the
ways an attacker with write access to a checkpoint volume would (a ``.metadata``, a ``common.pt``
or a saved object whose unpickling runs a shell command; ``liveshard.json``'s manifest rewritten
to match, as such an attacker can), then loaded the ways a job loads checkpoints: a worker's
restore and ``spec.training.resume`` (``checkpoint.load``, liveshard checkpoints and Megatron-LM
save roots), ``spec.training.initialWeights`` (``load_initial_weights``), the checks before any
process joins (``check_start_weights``), megatron's own entry points, and ``liveshard convert``.
Each is refused with one line naming the file, and the shell command never runs. The genuine
checkpoint still loads bit-exactly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("megatron.core") is None:  # checked without importing it here
    pytest.skip("needs megatron-core (the runtime extra)", allow_module_level=True)
from liveshard.dev.procpool import GlooPool

pytestmark = pytest.mark.slow

CONFIG = "tp=1,pp=1,dp=1,dist_opt"  # a non-distributed optimizer's restore fails on its own (KeyError step)


class Shell:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


# ---- jobs: run in the pool's process -----------------------------------------------------------
def _build(seed: int) -> tuple[Any, Any]:
    from liveshard.runtime.agent.trainer import Trainer
    from liveshard.runtime.contract.training import read_training
    from liveshard.runtime.megatron import build
    from liveshard.runtime.parallel import ParallelConfig
    from liveshard.runtime.presets import PRESETS

    built = build.build_model(PRESETS["tiny-llama"], ParallelConfig.parse(CONFIG), seed=seed)
    training = read_training({"trainIters": 10, "globalBatch": 2, "microBatch": 1, "seqLength": 16,
                              "data": {"mock": True}})
    return built, Trainer(built, training, None)


def _model_state(built: Any) -> dict[str, Any]:
    import torch

    return {k: v.detach().clone() for k, v in built.model.state_dict().items() if isinstance(v, torch.Tensor)}


def save_job(rank: int, world: int, out: str, rng_marker: str | None) -> dict[str, Any]:
    """A checkpoint through the project's save path; with ``rng_marker``, its saved RNG object
    is a ``Shell``."""
    from liveshard.runtime.agent import checkpoint
    from liveshard.runtime.agent.state import ensure_adam_state
    from liveshard.runtime.megatron import build

    built, trainer = _build(seed=3)
    ensure_adam_state(built.optimizer)
    real = checkpoint.capture_rng
    if rng_marker is not None:
        checkpoint.capture_rng = lambda: Shell(rng_marker)  # type: ignore[assignment]
    try:
        checkpoint.save(built, trainer, out)
    finally:
        checkpoint.capture_rng = real
    state = _model_state(built)
    del built, trainer
    build.destroy()
    return state


def load_job(rank: int, world: int, path: str, how: str, env: dict[str, str]) -> dict[str, Any] | str:
    """Load ``path`` the way ``how`` names; the refusal's text, or what was loaded."""
    from liveshard.runtime.agent import checkpoint
    from liveshard.runtime.contract.training import WeightsRef
    from liveshard.runtime.errors import ConfigError
    from liveshard.runtime.megatron import build, safe_load

    os.environ.update(env)
    built, trainer = _build(seed=99)
    try:
        if how == "restore":
            checkpoint.load(built, trainer, path)
        elif how == "initial-weights":
            checkpoint.load_initial_weights(built, WeightsRef("megatron", path))
        else:  # megatron's own entry points, with the safe readers installed
            from megatron.core import dist_checkpointing

            safe_load.install()
            with safe_load.refusals():
                if how == "megatron-common":
                    dist_checkpointing.load_common_state_dict(path)
                else:
                    dist_checkpointing.load_tensors_metadata(path)
            return {}
        return {"state": _model_state(built), "step": trainer.step_count}
    except ConfigError as e:
        return f"refused: {e}"
    finally:
        del built, trainer
        build.destroy()


# ---- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool():
    p = GlooPool(1, preload=("liveshard.runtime.megatron.build", __name__), timeout_s=240)
    yield p
    p.close()


@pytest.fixture(scope="module")
def saved(pool: GlooPool, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("trust")
    genuine, evil_rng = tmp / "genuine", tmp / "evil-rng"
    state = pool.run(save_job, str(genuine), None)[0]
    pool.run(save_job, str(evil_rng), str(tmp / "rng-ran"))
    assert not (tmp / "rng-ran").exists()  # saving it ran nothing either
    return {"genuine": genuine, "evil-rng": evil_rng, "state": state, "rng-marker": tmp / "rng-ran"}


def _resign(directory: Path) -> None:
    """Rewrite ``liveshard.json``'s manifest to match the files: what an attacker who can write
    the checkpoint can do too."""
    from liveshard.runtime.agent.checkpoint import MARKER, file_manifest

    meta = json.loads((directory / MARKER).read_text())
    meta["files"] = file_manifest(directory)
    (directory / MARKER).write_text(json.dumps(meta))


def _craft(genuine: Path, out: Path, file: str, marker: Path, layout: str) -> Path:
    """A copy of ``genuine`` whose ``file`` runs ``touch marker`` when unpickled, as a liveshard
    checkpoint (manifest re-signed) or a Megatron-LM save root; the path a job would be given."""
    import torch

    from liveshard.runtime.megatron.safe_load import read_metadata

    target = out / "iter_0000005" if layout == "megatron-lm" else out
    shutil.copytree(genuine, target)
    if file == ".metadata":  # the genuine metadata, one field replaced: it would load fine
        metadata = read_metadata(target / ".metadata")
        metadata.planner_data = Shell(str(marker))
        (target / ".metadata").write_bytes(pickle.dumps(metadata))
    elif file == "common.pt":  # Megatron-LM's common.pt holds its pickled arguments
        common = torch.load(target / "common.pt", weights_only=True)
        common["args"] = Shell(str(marker))
        torch.save(common, target / "common.pt")
    if layout == "megatron-lm":
        (target / "liveshard.json").unlink()
        (out / "latest_checkpointed_iteration.txt").write_text("5\n")
    else:
        _resign(target)
    return out


def _assert_same(state: dict[str, Any], expected: dict[str, Any]) -> None:
    import torch

    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


# ---- the tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["restore", "initial-weights"])
def test_a_genuine_checkpoint_loads_bit_exactly(pool: GlooPool, saved: dict, how: str) -> None:
    loaded = pool.run(load_job, str(saved["genuine"]), how, {})[0]
    assert not isinstance(loaded, str), loaded
    _assert_same(loaded["state"], saved["state"])


@pytest.mark.parametrize(("file", "layout", "how", "named"), [
    (".metadata", "liveshard", "restore", ".metadata"),
    (".metadata", "liveshard", "initial-weights", ".metadata"),
    (".metadata", "megatron-lm", "restore", "iter_0000005/.metadata"),
    (".metadata", "liveshard", "megatron-tensors-metadata", ".metadata"),
    ("common.pt", "liveshard", "restore", "common.pt"),
    ("common.pt", "liveshard", "megatron-common", "common.pt"),
])
def test_a_crafted_checkpoint_runs_nothing_and_is_refused_in_one_line(
        pool: GlooPool, saved: dict, tmp_path: Path, file: str, layout: str, how: str, named: str) -> None:
    marker = tmp_path / "ran"
    path = _craft(saved["genuine"], tmp_path / "ckpt", file, marker, layout)
    # torch.load's default would unpickle everything with this set: the readers name weights_only
    result = pool.run(load_job, str(path), how, {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"})[0]
    assert isinstance(result, str) and result.startswith("refused: "), result
    assert "\n" not in result and f"{path}/{named}" in result and "refused unread" in result, result
    assert not marker.exists()


def test_a_crafted_saved_object_runs_nothing(pool: GlooPool, saved: dict) -> None:
    """The RNG states are a megatron ShardedObject, which torch DCP reads with torch.load."""
    result = pool.run(load_job, str(saved["evil-rng"]), "restore", {})[0]
    assert isinstance(result, str) and "\n" not in result, result
    assert f"{saved['evil-rng']}/" in result and ".distcp: object 'rng" in result and "system" in result, result
    assert not saved["rng-marker"].exists()


def test_a_megatron_lm_common_pt_is_never_read(pool: GlooPool, saved: dict, tmp_path: Path) -> None:
    """A Megatron-LM save's common.pt (its pickled arguments) is left unread: the crafted one
    runs nothing and the weights load."""
    marker = tmp_path / "ran"
    root = _craft(saved["genuine"], tmp_path / "root", "common.pt", marker, "megatron-lm")
    loaded = pool.run(load_job, str(root), "restore", {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"})[0]
    assert not isinstance(loaded, str), loaded
    _assert_same(loaded["state"], saved["state"])
    assert loaded["step"] == 5 and not marker.exists()


@pytest.mark.parametrize(("field", "layout"), [("initialWeights", "liveshard"), ("resume", "liveshard"),
                                                ("resume", "megatron-lm")])
def test_start_weights_are_checked_before_any_process_joins(saved: dict, tmp_path: Path, field: str,
                                                            layout: str) -> None:
    from liveshard.runtime.agent.checkpoint import check_start_weights
    from liveshard.runtime.contract.training import read_training
    from liveshard.runtime.errors import ConfigError
    from liveshard.runtime.presets import PRESETS

    marker = tmp_path / "ran"
    path = _craft(saved["genuine"], tmp_path / "ckpt", ".metadata", marker, layout)
    ref = {"format": "megatron", "path": str(path)} if field == "initialWeights" else {"path": str(path)}
    training = read_training({"trainIters": 10, "globalBatch": 2, "microBatch": 1, "seqLength": 16,
                              "data": {"mock": True}, field: ref})
    with pytest.raises(ConfigError) as info:
        check_start_weights(PRESETS["tiny-llama"], training)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"spec.training.{field}: {path}/"), text
    assert ".metadata: names posix.system" in text and not marker.exists()


def test_convert_refuses_a_crafted_checkpoint_in_one_line(saved: dict, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = _craft(saved["genuine"], tmp_path / "ckpt", ".metadata", marker, "liveshard")
    done = subprocess.run([sys.executable, "-m", "liveshard.runtime.cli", "convert", "--from", str(path),
                           "--to", f"hf:{tmp_path / 'hf'}", "--no-progress"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("liveshard convert: error:")]
    assert len(lines) == 1 and f"{path}/.metadata: names posix.system" in lines[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and not marker.exists()
