"""Which steps a worker records when a peer dies during a step.

A step's update is applied once the optimizer stepped; the collective that follows (the loss
averaged over data-parallel replicas) can still fail when a peer dies right then. That step is
done (the state a recovery moves is after it), so it must be recorded; a step that failed before
its update must not be.
"""

from __future__ import annotations

import pytest

from liveshard.runtime.agent.trainer import StepStats
from liveshard.runtime.agent.training import train_one
from liveshard.runtime.agent.worker import WorkerState


class _Trainer:
    """Steps like ``Trainer.step``: the update, then the loss report, which may fail."""

    def __init__(self, fail: str | None) -> None:
        self.step_count = 4
        self.consumed_samples = 32
        self.last_step_seconds = 0.5
        self.last_stats = StepStats(lr=1e-3, tokens=256)
        self.fail = fail

    def step(self) -> float:
        if self.fail == "before update":
            raise RuntimeError("[gloo] Connection closed by peer")
        self.step_count += 1
        self.consumed_samples += 8
        if self.fail == "loss report":
            raise RuntimeError("[gloo] Connection closed by peer")
        return 2.5


def _train(trainer: _Trainer) -> WorkerState:
    """One step as the worker takes it (no store, no world: the step boundary does nothing)."""
    state = WorkerState(generation=3)
    train_one(state, trainer, world_size=2, after_step=lambda: None)
    return state


@pytest.mark.parametrize("fail, recorded", [(None, [(5, 2.5)]), ("loss report", [(5, None)]),
                                            ("before update", [])])
def test_a_step_is_recorded_once_its_update_is_applied(fail, recorded):
    state = _train(_Trainer(fail))
    assert [(r.step, r.loss) for r in state.records] == recorded
    assert all(r.consumed_samples == 40 and r.generation == 3 and r.world_size == 2 for r in state.records)
    assert state.phase == ("broken" if fail else "starting")


def test_a_failure_that_is_not_a_peer_is_raised():
    trainer = _Trainer(None)
    trainer.step = lambda: (_ for _ in ()).throw(ValueError("a bug"))
    with pytest.raises(ValueError):
        _train(trainer)


def test_a_step_boundary_that_loses_a_peer_does_not_record_the_step_twice():
    state = WorkerState(generation=3)

    def boundary() -> None:
        raise RuntimeError("[gloo] Connection closed by peer")

    train_one(state, _Trainer(None), world_size=2, after_step=boundary)
    assert [(r.step, r.loss) for r in state.records] == [(5, 2.5)]
    assert state.phase == "broken"


def test_a_plan_restores_only_from_inside_the_jobs_checkpoint_directory(tmp_path):
    from liveshard.runtime.agent.prepare import confined

    root = tmp_path / "ckpt"
    (root / "step00000004").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (root / "escape").symlink_to(tmp_path / "elsewhere")
    assert confined(str(root / "step00000004"), str(root)) == str((root / "step00000004").resolve())
    for bad in (str(tmp_path / "elsewhere"), str(root / ".." / "elsewhere"), str(root / "escape"), "/etc"):
        with pytest.raises(ValueError, match="outside the job's checkpoint directory"):
            confined(bad, str(root))
    with pytest.raises(ValueError, match="no checkpoint directory"):
        confined(str(root / "step00000004"), None)


def test_old_and_abandoned_checkpoints_are_pruned_never_the_newest_or_one_being_written(tmp_path):
    import json

    from liveshard.runtime.agent.checkpoint_schedule import prune

    def ckpt(step: int, complete: bool) -> None:
        d = tmp_path / f"step{step:08d}"
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"x")
        if complete:
            (d / "liveshard.json").write_text(json.dumps({"step": step, "config": "tp=1,pp=1,dp=1,ep=1"}))

    for step, complete in ((2, True), (4, False), (6, True), (8, True), (10, True), (12, False)):
        ckpt(step, complete)
    (tmp_path / "data-cache").mkdir()
    removed = prune(str(tmp_path), keep=2)
    assert sorted(p.rsplit("/", 1)[1] for p in removed) == ["step00000002", "step00000004", "step00000006"]
    # the two newest complete ones, the save in progress after them and the dataset cache stay
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data-cache", "step00000008", "step00000010",
                                                         "step00000012"]
    assert prune(str(tmp_path), keep=0) == []  # 0 keeps all


def test_a_corrupt_checkpoint_of_a_recomputed_step_is_saved_anew_never_published(tmp_path, monkeypatch):
    """A restore went back past a corrupt periodic checkpoint; recomputing, the job reaches its
    step again: the corrupt one is not published as the newest (it is saved anew), an intact one is."""
    import json
    from types import SimpleNamespace

    from liveshard.runtime.agent import checkpoint
    from liveshard.runtime.agent.checkpoint_schedule import SafetyCheckpoints
    from liveshard.runtime.contract.checkpoint import MARKER, file_manifest

    path = tmp_path / "step00000012"
    path.mkdir()
    (path / "shard.bin").write_bytes(b"x" * 64)
    (path / MARKER).write_text(json.dumps({"step": 12, "files": file_manifest(path)}))
    published, saved = [], []

    def schedule(rank: int) -> SafetyCheckpoints:
        s = SafetyCheckpoints.__new__(SafetyCheckpoints)
        s.options = SimpleNamespace(checkpoint_dir=str(tmp_path), checkpoint_keep=0)
        s.state = SimpleNamespace(rank=rank, events=[])
        s.clients = SimpleNamespace(store=SimpleNamespace(publish_checkpoint=published.append))
        s._saves, s.expected_bytes, s.last = None, 0, None
        s.finalize = lambda step, wait=False: None
        return s

    monkeypatch.setattr(checkpoint, "save", lambda *a, **kw: saved.append(a[2]))
    built, trainer = SimpleNamespace(cfg="tp=1"), SimpleNamespace(step_count=12)
    schedule(0).save(built, trainer)
    assert [p["step"] for p in published] == [12] and not saved  # intact: published again
    published.clear()
    (path / "shard.bin").write_bytes(b"y" * 64)  # corrupt, same size
    schedule(1).save(built, trainer)
    schedule(0).save(built, trainer)
    assert not published and saved == [str(path), str(path)]  # every rank saves it anew
    assert not (path / MARKER).exists()  # complete again only once the new save is
