"""A checkpoint is trusted only when its files are the ones its save recorded (liveshard.json's
manifest): a torn or corrupted newest checkpoint is skipped for the previous intact one, and
nothing of a corrupted one (torch DCP's pickled ``.metadata`` first) is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from liveshard.runtime.agent.checkpoint import MARKER, file_manifest, newest_complete, verify


def _save(root: Path, step: int, shard: bytes = b"x" * 1000) -> Path:
    d = root / f"step-{step:06d}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"pickled metadata %d" % step)
    (d / "__0_0.distcp").write_bytes(shard)
    (d / "common.pt").write_bytes(b"common")
    (d / MARKER).write_text(json.dumps({"step": step, "config": "tp=1,pp=1,dp=1", "files": file_manifest(d)}))
    return d


@pytest.mark.parametrize("damage", ["metadata-bytes", "truncated-shard", "missing-shard"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path, damage: str) -> None:
    _save(tmp_path, 4)
    newest = _save(tmp_path, 8)
    assert verify(newest) is None and newest_complete(tmp_path)["step"] == 8
    if damage == "metadata-bytes":
        (newest / ".metadata").write_bytes(b"pickled metadata 9")  # same size, other content
        expected = "sha256"
    elif damage == "truncated-shard":
        (newest / "__0_0.distcp").write_bytes(b"x" * 10)
        expected = "bytes"
    else:
        (newest / "__0_0.distcp").unlink()
        expected = "missing"
    assert expected in verify(newest)
    assert newest_complete(tmp_path)["step"] == 4


def test_every_byte_of_a_large_shard_is_verified(tmp_path: Path) -> None:
    """4 KiB flipped inside a 67 MB shard (larger than any size threshold): the checkpoint is
    refused and the restore takes the previous one."""
    _save(tmp_path, 4)
    newest = _save(tmp_path, 8, shard=bytes(67_000_000))
    assert json.loads((newest / MARKER).read_text())["files"]["__0_0.distcp"]["sha256"]
    with open(newest / "__0_0.distcp", "r+b") as f:
        f.seek(40_000_000)
        f.write(b"\xff" * 4096)
    assert "sha256" in verify(newest)
    assert newest_complete(tmp_path)["step"] == 4


def test_a_background_save_is_complete_only_once_hashed_and_completes_on_the_training_thread(tmp_path: Path):
    """Rank 0's hashing runs in a thread: until it wrote the marker the save is not complete,
    and its completion (publication, pruning) runs when the training thread drains it."""
    import threading

    from liveshard.runtime.agent.checkpoint import is_complete
    from liveshard.runtime.agent.checkpoint_schedule import SafetyCheckpoints

    d = tmp_path / "step-000010"
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(b"y" * 5000)
    gate, completed, threads = threading.Event(), [], []

    def mark() -> None:
        gate.wait(10)
        (d / MARKER).write_text(json.dumps({"step": 10, "files": file_manifest(d)}))

    schedule = SafetyCheckpoints.__new__(SafetyCheckpoints)  # the hashing hand-off alone
    schedule._hashing, schedule._verified = [], __import__("queue").SimpleQueue()
    schedule._verify_later(mark, lambda: completed.append(threading.current_thread().name), 10)
    assert not is_complete(d)
    schedule._drain_verified(wait=False)
    assert completed == []  # not hashed yet: nothing published
    gate.set()
    schedule._drain_verified(wait=True)
    threads.append(threading.current_thread().name)
    assert completed == threads and is_complete(d) and verify(d) is None


def test_a_manifest_cannot_point_outside_its_checkpoint(tmp_path: Path) -> None:
    d = _save(tmp_path, 2)
    (tmp_path / "outside").write_text("x")
    meta = json.loads((d / MARKER).read_text())
    meta["files"]["../outside"] = {"size": 1}
    (d / MARKER).write_text(json.dumps(meta))
    assert "missing" in verify(d)
    assert newest_complete(tmp_path) is None


def test_no_marker_is_incomplete(tmp_path: Path) -> None:
    d = _save(tmp_path, 3)
    (d / MARKER).unlink()
    assert verify(d) is not None and newest_complete(tmp_path) is None


def test_a_save_that_fails_at_finalize_costs_the_checkpoint_not_the_run():
    """megatron raises the same CheckpointException on every rank when a background write failed
    (a full disk): the schedule records it, reports it (rank 0) and postpones the next save; any
    other error (a peer gone, a write of one rank's own) still propagates."""
    import torch.distributed as dist

    from liveshard.runtime.agent.checkpoint_schedule import SafetyCheckpoints
    from liveshard.runtime.agent.worker import WorkerOptions, WorkerState
    from liveshard.runtime.contract.keys import Keys
    from liveshard.runtime.control.store import JobStore

    class Clients:
        store = JobStore(dist.HashStore(), secret=b"test-secret")

    class Failing:
        def __init__(self, error):
            self.error = error

        def get_num_unfinalized_calls(self):
            return 1

        def maybe_finalize_async_calls(self, blocking=False):
            raise self.error

    state = WorkerState(rank=0)
    schedule = SafetyCheckpoints(WorkerOptions(checkpoint_dir="/nonexistent", checkpoint_every=2), state, Clients())
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.api import _wrap_exception

    full = CheckpointException("write", {0: _wrap_exception(OSError(28, "No space left on device"))})
    schedule._saves, schedule._save_started_at = Failing(full), 4
    schedule.finalize(step=5, wait=True)  # does not raise
    assert schedule.failed_saves == 1 and state.events[-1]["kind"] == "checkpoint_failed"
    reported = Clients.store.get_json(Keys.CHECKPOINT_FAILED)
    assert reported["step"] == 4 and "No space left" in reported["error"] and reported["count"] == 1
    # not every rank's error: a peer gone, or rank 0's own marker write; the others are in
    # megatron's collective, so this rank must not carry on as if the save had failed everywhere
    for error in (RuntimeError("Connection closed by peer"), OSError(28, "No space left on device")):
        schedule._saves = Failing(error)
        with pytest.raises(type(error)):
            schedule.finalize(step=6, wait=True)
    assert schedule.failed_saves == 1
