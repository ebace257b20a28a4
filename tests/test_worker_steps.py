"""Which steps a worker records when a peer dies during a step.

A step's update is applied once the optimizer stepped; the collective that follows (the loss
averaged over data-parallel replicas) can still fail when a peer dies right then. That step is
done (the state a recovery moves is after it), so it must be recorded; a step that failed before
its update must not be.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from liveshard.runtime.agent.worker import WorkerAgent, WorkerState


class _Trainer:
    """Steps like ``Trainer.step``: the update, then the loss report, which may fail."""

    def __init__(self, fail: str | None) -> None:
        self.step_count = 4
        self.consumed_samples = 32
        self.last_step_seconds = 0.5
        self.fail = fail

    def step(self) -> float:
        if self.fail == "before update":
            raise RuntimeError("[gloo] Connection closed by peer")
        self.step_count += 1
        self.consumed_samples += 8
        if self.fail == "loss report":
            raise RuntimeError("[gloo] Connection closed by peer")
        return 2.5


def _agent(trainer: _Trainer) -> WorkerAgent:
    agent = WorkerAgent.__new__(WorkerAgent)  # no store: only the step loop runs here
    agent.state = WorkerState(generation=3)
    agent.trainer = trainer
    agent.built = SimpleNamespace(cfg=SimpleNamespace(world_size=2))
    agent._after_step = lambda: None
    return agent


@pytest.mark.parametrize("fail, recorded", [(None, [(5, 2.5)]), ("loss report", [(5, None)]),
                                            ("before update", [])])
def test_a_step_is_recorded_once_its_update_is_applied(fail, recorded):
    agent = _agent(_Trainer(fail))
    agent._train_one()
    assert [(r.step, r.loss) for r in agent.state.records] == recorded
    assert all(r.consumed_samples == 40 and r.generation == 3 for r in agent.state.records)
    assert agent.state.phase == ("broken" if fail else "starting")


def test_a_failure_that_is_not_a_peer_is_raised():
    agent = _agent(_Trainer(None))
    agent.trainer.step = lambda: (_ for _ in ()).throw(ValueError("a bug"))
    with pytest.raises(ValueError):
        agent._train_one()
