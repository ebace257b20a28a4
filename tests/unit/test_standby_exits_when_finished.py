"""A finished job's standbys exit quietly: once rank 0 has said the job trained to trainIters
(``Keys.FINISHED``), a worker that is not a member of the world (a standby, a joiner whose plan
will never come) stops, while the coordinator still serves the store, instead of polling a store
that goes away with the job (which logged c10d connection errors for half a minute)."""

from __future__ import annotations

from liveshard.runtime.agent.control import ControlThread
from liveshard.runtime.agent.kept_writes import KeptWrites
from liveshard.runtime.agent.prepare import Preparations
from liveshard.runtime.agent.worker import WorkerOptions, WorkerState
from liveshard.runtime.contract.keys import Keys


class Store:
    def __init__(self, keys: dict[str, str]) -> None:
        self.keys = keys

    def has(self, key: str) -> bool:
        return key in self.keys

    def get(self, key: str) -> str | None:
        return self.keys.get(key)

    def latest_generation(self) -> int:
        return 0

    def plan(self, generation: int) -> None:
        return None


class Clients:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.kept = KeptWrites()


def _control(store: Store, rank: int | None) -> ControlThread:
    state = WorkerState(rank=rank)
    return ControlThread("w2", WorkerOptions(), Clients(store), state, Preparations(), None,
                         prepare=lambda plan: None, heartbeat=lambda now: None)


def test_a_standby_stops_once_the_job_finished():
    store = Store({})
    standby = _control(store, rank=None)
    standby._poll(-1)
    assert not standby.stop_requested  # the job trains on: a standby waits for a plan
    store.keys[Keys.FINISHED] = '{"step": 8}'
    standby._poll(-1)
    assert standby.stop_requested


def test_a_member_finishes_on_its_own_path():
    # a member of the world saves the final checkpoint and leaves as finished: never cut short
    member = _control(Store({Keys.FINISHED: '{"step": 8}'}), rank=0)
    member._poll(-1)
    assert not member.stop_requested
