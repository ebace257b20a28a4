"""A new member counts itself in at the commit (``Keys.arrived``), whether or not it waits for
the others: the coordinator reads the count as every source having delivered, after which a
leaver's death no longer aborts the generation (``test_coordinator``)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from liveshard.runtime.agent.kept_writes import KeptWrites
from liveshard.runtime.agent.live_switch import arrive
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.control.protocol import WorldPlan
from liveshard.runtime.control.store import JobStore

PLAN = WorldPlan(generation=3, config="tp=1,pp=1,dp=2", members=("w0", "w2"), previous=2)


def _agent(store: JobStore) -> SimpleNamespace:
    return SimpleNamespace(id="w0", store=store, options=SimpleNamespace(commit_timeout=5.0),
                           clients=SimpleNamespace(kept=KeptWrites()))


def test_a_member_whose_world_was_built_ahead_counts_in_without_waiting():
    store = JobStore(dist.HashStore(), secret=b"test-secret")
    start = time.monotonic()
    arrive(_agent(store), PLAN, wait=False)  # w2 has not arrived: nothing to wait for
    assert time.monotonic() - start < 1.0
    assert store.get(Keys.arrived(PLAN.generation, "w0")) == "1" and store.get(Keys.arrived(PLAN.generation, "w2")) is None


def test_a_member_that_waits_stops_when_the_generation_is_decided():
    store = JobStore(dist.HashStore(), secret=b"test-secret")
    store.decide(Keys.decision(PLAN.generation), "aborted: w2 died")
    with pytest.raises(RuntimeError, match="decided while members were arriving"):
        arrive(_agent(store), PLAN, wait=True)
    assert store.get(Keys.arrived(PLAN.generation, "w0")) == "1"


def test_nobody_without_the_secret_counts_a_member_in():
    """What the coordinator counts is one sealed key per member: a value forged under another
    member's key is not a count-in (a bumped wait counter only ends a wait early, into the
    rendezvous, which waits for everyone itself)."""
    store = JobStore(dist.HashStore(), secret=b"s")
    store.store.set(Keys.arrived(PLAN.generation, "w2"), "1")  # an attacker's value, no MAC
    arrive(_agent(store), PLAN, wait=False)
    counted = [m for m in PLAN.members if store.get(Keys.arrived(PLAN.generation, m)) == "1"]
    assert counted == ["w0"]
