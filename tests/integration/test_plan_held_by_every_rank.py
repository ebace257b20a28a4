"""The old world switches to a plan only if every rank holds it (``training.StepBoundary``): a
rank that could not read the announced plan (deleted from the store before it read it) must hold
the others back, never leave them in a vote all-reduce it does not make. Two gloo ranks; one
reads the plan, the other finds it gone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from liveshard.dev.procpool import GlooPool
from liveshard.runtime.agent.training import StepBoundary
from liveshard.runtime.control.protocol import WorldPlan

PLAN = WorldPlan(generation=1, config="tp=1,pp=1,dp=2", members=("w0", "w1"), previous=0)


@pytest.fixture(scope="module")
def pool():
    p = GlooPool(2, preload=("liveshard.runtime.agent.training", __name__), timeout_s=60)
    yield p
    p.close()


def _boundary(readable: bool) -> SimpleNamespace:
    store = SimpleNamespace(plan=lambda gen: PLAN if readable else None)
    b = SimpleNamespace(state=SimpleNamespace(generation=0), _plans={}, clients=SimpleNamespace(store=store))
    b._everyone_holds = StepBoundary._everyone_holds
    return b


def _job(rank: int, world: int, readers: tuple[int, ...]) -> list:
    b = _boundary(rank in readers)
    got = [StepBoundary._next_plan(b, 1) for _ in range(2)]  # two step boundaries in a row
    after = torch.tensor([rank + 1])
    dist.all_reduce(after)  # the collectives after them still pair up
    return [None if p is None else p.generation for p in got] + [int(after)]


def test_a_plan_one_rank_could_not_read_is_switched_to_by_nobody(pool):
    assert pool.run(_job, (0,), world=2) == [[None, None, 3], [None, None, 3]]


def test_a_plan_every_rank_holds_is_switched_to_by_all(pool):
    assert pool.run(_job, (0, 1), world=2) == [[1, 1, 3], [1, 1, 3]]
