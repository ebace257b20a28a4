"""A member's commit point (``live_switch.decide``) when the coordinator, and the store holding the
decision with it, dies inside the commit window: real c10d stores in this process (a server
deleted is a coordinator killed), no training. The member must wait, announce its vote to the
restarted coordinator (``connection.reannounce``, in the wire format the coordinator parses) and
adopt what that one resolves; only nobody resolving it within the bound is an error.
"""

from __future__ import annotations

import gc
import threading
import time
from types import SimpleNamespace

import pytest

from liveshard.runtime.agent import live_switch
from liveshard.runtime.agent.connection import StoreClients, reannounce
from liveshard.runtime.agent.control import ControlThread
from liveshard.runtime.contract.keys import COMMITTED, SECRET_ENV, Keys
from liveshard.runtime.control.protocol import OpenGeneration, WorldPlan
from liveshard.runtime.control.store import JobStore, connect_store, serve_store
from liveshard.runtime.coordinator import Registration

OLD = WorldPlan(generation=3, config="tp=2,pp=1,dp=1", members=("w0", "w1"))
PLAN = WorldPlan(generation=4, config="tp=1,pp=1,dp=2", members=("w0", "w1"), previous=3, reason="test")

SECRET = b"commit-window-secret"


@pytest.fixture(autouse=True)
def _job_secret(monkeypatch):
    """The job's secret, as a worker reads it (``StoreClients``) and as the test's clients use it."""
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())


class Coordinator:
    """The store a coordinator serves; ``kill`` takes it down, ``restart`` serves a new, empty one."""

    def __init__(self) -> None:
        self.server = serve_store("127.0.0.1", 0)
        self.port = self.server.port

    def client(self) -> JobStore:
        return JobStore(connect_store("127.0.0.1", self.port, timeout=5.0), secret=SECRET)

    def kill(self) -> None:
        self.server = None
        gc.collect()
        time.sleep(0.1)

    def restart(self) -> None:
        self.server = serve_store("127.0.0.1", 0)
        self.port = self.server.port


class Agent:
    """What ``live_switch.decide`` uses of a ``WorkerAgent``."""

    def __init__(self, coordinator: Coordinator, wid: str = "w0", commit_timeout: float = 30.0) -> None:
        self.id = wid
        self.clients = StoreClients("127.0.0.1", coordinator.port, "job", timeout=5.0)
        self.state = SimpleNamespace(commit_point=None, generation=OLD.generation, plan=OLD, incarnation="i0")
        self.options = SimpleNamespace(commit_timeout=commit_timeout)
        self.reports: list = []
        self.on_phase = lambda phase, gen: None

    @property
    def store(self) -> JobStore:
        return self.clients.store

    def at_phase(self, phase: str, gen: int) -> None:
        self.on_phase(phase, gen)

    def report(self, gen: int, result) -> None:
        self.reports.append((gen, result))
        self.store.set(Keys.result(gen, self.id), result.to_json())

    def reconnect(self, coordinator: Coordinator) -> bool:
        """The control thread's part: connect to the restarted coordinator and announce."""
        self.clients.port = coordinator.port
        commit = self.state.commit_point
        return reannounce(self.clients, self.id, self.state, lambda: None, PLAN.generation,
                          in_flight=lambda: ControlThread._in_flight(SimpleNamespace(state=self.state, preparing=PLAN),
                                                                     commit),
                          guard=(lambda: commit.lock) if commit is not None else None)


def _resolve_later(coordinator: Coordinator, value: str, delay: float = 0.5) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        store = coordinator.client()
        store.decide(Keys.decision(PLAN.generation), value)
        store.set(Keys.outcome(PLAN.generation), value)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("resolution", [COMMITTED, "aborted: w1 was not ready"])
def test_a_member_whose_ready_vote_is_cast_waits_through_the_restart_and_adopts_the_resolution(resolution):
    coordinator = Coordinator()
    agent = Agent(coordinator)
    coordinator.client().set(Keys.ready(PLAN.generation, "w1"), "1")  # w1 voted ready too
    announced: dict = {}

    def killed_in_the_window(phase: str, gen: int) -> None:
        assert phase == "commit-window" and agent.state.commit_point.ready
        coordinator.kill()  # before anyone read (or wrote) the decision
        coordinator.restart()
        assert agent.reconnect(coordinator)
        announced.update(coordinator.client().get_json(Keys.member("w0")))
        _resolve_later(coordinator, resolution)

    agent.on_phase = killed_in_the_window
    assert live_switch.decide(agent, PLAN, "", epoch=0) == resolution
    # what the new coordinator was told: the open generation, with a confirmed vote, and the plan
    assert OpenGeneration.from_dict(announced["open"]) == OpenGeneration(4, PLAN, ready=True, decision=None)
    assert WorldPlan.from_json(announced["pending_plan"]) == PLAN
    reg = Registration.parse("w0", announced)  # as the coordinator reads it
    assert reg is not None and reg.open is not None and reg.open.ready and reg.open.plan == PLAN
    assert reg.plan == OLD and reg.pending_plan == PLAN


def test_a_vote_written_to_a_dead_store_is_reported_unconfirmed():
    """``set`` to a store whose server died returns without error: the member reads its vote
    back, finds it cannot, and says so to the new coordinator."""
    coordinator = Coordinator()
    agent = Agent(coordinator)
    coordinator.kill()
    announced: dict = {}

    def control_thread() -> None:
        time.sleep(0.3)
        coordinator.restart()
        assert agent.reconnect(coordinator)
        announced.update(coordinator.client().get_json(Keys.member("w0")))
        _resolve_later(coordinator, "aborted: not every vote confirmed", delay=0.2)

    threading.Thread(target=control_thread, daemon=True).start()
    assert live_switch.decide(agent, PLAN, "", epoch=0) == "aborted: not every vote confirmed"
    assert announced["open"]["ready"] is False and announced["open"]["decision"] is None


def test_a_member_that_failed_aborts_at_once_and_tells_the_new_store():
    coordinator = Coordinator()
    agent = Agent(coordinator)
    coordinator.kill()
    coordinator.restart()
    agent.reconnect(coordinator)  # epoch 1: the switch's store (epoch 0) is gone
    t0 = time.monotonic()
    decision = live_switch.decide(agent, PLAN, "commit: boom", epoch=0)
    assert decision == "aborted: w0: commit: boom" and time.monotonic() - t0 < 5
    # a leaver waiting for the resolution reads it in the new store
    assert coordinator.client().get(Keys.decision(PLAN.generation)) == decision


def test_nobody_resolving_it_within_the_bound_is_an_error_not_a_quiet_exit(monkeypatch):
    monkeypatch.setattr(live_switch, "RESOLUTION_BOUND", 1.0)
    coordinator = Coordinator()
    agent = Agent(coordinator, commit_timeout=0.1)

    def killed_in_the_window(phase: str, gen: int) -> None:
        coordinator.kill()
        coordinator.restart()
        agent.reconnect(coordinator)

    agent.on_phase = killed_in_the_window
    with pytest.raises(live_switch.CommitPointLost, match="no coordinator resolved it in 1 s"):
        live_switch.decide(agent, PLAN, "", epoch=0)
    assert agent.reports and not agent.reports[-1][1].ok  # the new coordinator hears of it


def test_a_member_decides_as_before_when_the_store_stays():
    coordinator = Coordinator()
    agent = Agent(coordinator)
    store = coordinator.client()
    store.set(Keys.ready(PLAN.generation, "w1"), "1")
    assert live_switch.decide(agent, PLAN, "", epoch=0) == COMMITTED  # the last ready member commits
    assert store.get(Keys.decision(PLAN.generation)) == COMMITTED
    leaver = Agent(coordinator, wid="w9", commit_timeout=0.2)
    assert live_switch.decide(leaver, PLAN, "", epoch=0) == COMMITTED
    late = WorldPlan(generation=5, config=PLAN.config, members=PLAN.members, previous=4)
    assert live_switch.decide(leaver, late, "", epoch=0) == "aborted: no decision in 1 s"  # 3 x its timeout
