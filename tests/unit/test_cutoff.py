"""When a worker cuts its world off (``agent.cutoff.PeerWatch``): only on a death in its own world."""

from __future__ import annotations

import pytest

from liveshard.runtime.agent import cutoff
from liveshard.runtime.agent.worker import StepRecord, WorkerOptions, WorkerState
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.control.protocol import WorldPlan


class FakeStore:
    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.reads = 0

    def get(self, key: str) -> str | None:
        self.reads += 1
        return self.values.get(key)


@pytest.fixture
def cuts(monkeypatch) -> list[str]:
    calls: list[str] = []

    def cut_off(prefix: str) -> int:
        calls.append(prefix)
        return 3

    monkeypatch.setattr(cutoff.worlds, "cut_off", cut_off)
    return calls


def _watch(worker: str = "a", members: tuple[str, ...] = ("a", "b", "c"), rank: int | None = 0,
           generation: int = 4) -> cutoff.PeerWatch:
    state = WorkerState(generation=generation, rank=rank, phase="training",
                        plan=WorldPlan(generation, "tp=1,pp=1,dp=3", members))
    return cutoff.PeerWatch(worker, WorkerOptions(heartbeat_interval=0.5), state)


def test_a_plan_naming_a_peer_dead_cuts_this_world_off_once(cuts):
    watch = _watch()
    watch.plan_seen(WorldPlan(5, "tp=1,pp=1,dp=2", ("a", "b"), previous=4, dead=("c",)))
    watch.plan_seen(WorldPlan(6, "tp=1,pp=1,dp=1", ("a",), previous=4, dead=("b", "c")))
    assert cuts == [Keys.world_prefix(4)]
    (event,) = [e for e in watch.state.events if e["kind"] == "cut-off"]
    assert event["dead"] == ["c"] and event["generation"] == 4 and event["connections"] == 3


@pytest.mark.parametrize(("plan", "rank"), [
    (WorldPlan(5, "tp=1,pp=1,dp=3", ("a", "b", "c"), previous=4, dead=("x",)), 0),  # not of this world
    (WorldPlan(5, "tp=1,pp=1,dp=2", ("a", "b"), previous=4, dead=()), 0),  # a planned leave
    (WorldPlan(4, "tp=1,pp=1,dp=2", ("a", "b"), previous=3, dead=("c",)), 0),  # this world's own plan
    (WorldPlan(5, "tp=1,pp=1,dp=2", ("a", "b"), previous=4, dead=("c",)), None),  # a standby trains in none
])
def test_a_death_outside_this_workers_world_cuts_nothing(cuts, plan, rank):
    watch = _watch(rank=rank)
    watch.plan_seen(plan)
    assert cuts == []


def test_a_dead_key_cuts_off_only_when_it_changed_during_this_world_and_training_stalls(cuts):
    store = FakeStore()
    store.values[Keys.dead("b")] = "old-incarnation"  # b died once before and came back as a new process
    watch = _watch()
    watch.poll(store, now=100.0)  # first look at this world: the keys as they are
    watch.poll(store, now=100.1)
    assert cuts == []
    store.values[Keys.dead("c")] = "c-incarnation"
    reads = store.reads
    watch.state.records.append(StepRecord(1, 1.0, 0.2, 4, 3, 6))
    watch.poll(store, now=100.2)  # training progresses: no reads
    watch.poll(store, now=100.8)
    assert store.reads == reads and cuts == []
    watch.poll(store, now=101.3)  # no step for over a second: read the peers' keys
    assert cuts == [Keys.world_prefix(4)]
    (event,) = watch.state.events
    assert event["dead"] == ["c"]
    watch.poll(store, now=105.0)  # cut once
    assert cuts == [Keys.world_prefix(4)]


def test_a_worker_declared_dead_itself_cuts_its_stale_world_off(cuts):
    watch = _watch()
    watch.excluded()
    assert cuts == [Keys.world_prefix(4)]
    assert _watch(rank=None).excluded() is None and cuts == [Keys.world_prefix(4)]
