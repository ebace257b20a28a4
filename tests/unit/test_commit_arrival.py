"""A new member counts itself in at the commit (``Keys.arrived``), whether or not it waits for
the others: the coordinator reads the count as every source having delivered, after which a
leaver's death no longer aborts the generation (``test_coordinator``)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from liveshard.runtime.agent.switch import _arrive
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.control.protocol import WorldPlan
from liveshard.runtime.control.store import JobStore

PLAN = WorldPlan(generation=3, config="tp=1,pp=1,dp=2", members=("w0", "w2"), previous=2)


def _agent(store: JobStore) -> SimpleNamespace:
    return SimpleNamespace(store=store, options=SimpleNamespace(commit_timeout=5.0))


def test_a_member_whose_world_was_built_ahead_counts_in_without_waiting():
    store = JobStore(dist.HashStore())
    start = time.monotonic()
    _arrive(_agent(store), PLAN, wait=False)  # w2 has not arrived: nothing to wait for
    assert time.monotonic() - start < 1.0
    assert store.store.add(Keys.arrived(PLAN.generation), 0) == 1


def test_a_member_that_waits_stops_when_the_generation_is_decided():
    store = JobStore(dist.HashStore())
    store.decide(Keys.decision(PLAN.generation), "aborted: w2 died")
    with pytest.raises(RuntimeError, match="decided while members were arriving"):
        _arrive(_agent(store), PLAN, wait=True)
    assert store.store.add(Keys.arrived(PLAN.generation), 0) == 1
