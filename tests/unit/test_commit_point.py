"""The commit point as a pure state machine (``agent.commit_point``): the rules of two-phase-commit
recovery when the coordinator (and the store holding the decision) dies inside the commit window,
and the restarted coordinator's resolution. No store, no clock, no torch: time is passed in.

The last test drives two members and a store that dies after any number of operations, in every
interleaving, resolves what is left open with the restarted coordinator's rule
(``coordinator.generations.resolve_open``) and checks that no two processes end on different
decisions.
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from liveshard.runtime.agent.commit_point import CommitPoint, Failed, Status, WriteAbort, WriteReady
from liveshard.runtime.contract.keys import COMMITTED
from liveshard.runtime.control.protocol import OpenGeneration, WorldPlan
from liveshard.runtime.coordinator.generations import resolve_open

PLAN = WorldPlan(generation=4, config="tp=1,pp=1,dp=2", members=("w0", "w1"), previous=3, reason="test")
TIMEOUT, BOUND = 10.0, 100.0


def test_the_machine_is_pure_it_imports_no_torch(tmp_path):
    """The protocol simulator drives this machine: no torch, store or socket behind it."""
    code = "import sys, liveshard.runtime.agent.commit_point; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def machine(member: str = "w0", error: str = "", now: float = 0.0) -> CommitPoint:
    return CommitPoint(PLAN, member, error=error, now=now, timeout=TIMEOUT, bound=BOUND)


def test_a_ready_member_writes_its_vote_and_adopts_the_decision():
    cp = machine()
    assert cp.start() == [WriteReady()]
    cp.voted(ok=True, write_confirmed=True)
    assert cp.status is Status.WAITING and cp.ready
    cp.decision_read(None)  # not written yet
    assert cp.verdict() is None
    cp.decision_read(COMMITTED)
    assert cp.status is Status.COMMITTED and cp.verdict() == COMMITTED
    assert cp.report() == OpenGeneration(4, PLAN, ready=True, decision=COMMITTED)


def test_a_ready_member_that_loses_the_store_waits_past_its_timeout_and_adopts_the_resolution():
    cp = machine()
    cp.voted(ok=True, write_confirmed=True)
    cp.tick(1.0)
    cp.store_lost()
    assert cp.tick(TIMEOUT * 5) == []  # no abort of its own: it voted ready
    assert cp.status is Status.WAITING and not cp.polls_old_store and not cp.polls_resolution
    cp.reconnected()
    assert cp.polls_resolution
    assert cp.report() == OpenGeneration(4, PLAN, ready=True, decision=None)
    cp.resolution_read(COMMITTED)
    assert cp.verdict() == COMMITTED


def test_nobody_resolving_within_the_bound_is_a_failed_verdict_never_a_quiet_exit():
    cp = machine()
    cp.voted(ok=True, write_confirmed=True)
    cp.tick(2.0)
    cp.store_lost()
    cp.reconnected()
    cp.tick(2.0 + BOUND - 1)
    assert cp.status is Status.WAITING
    cp.tick(2.0 + BOUND + 1)
    verdict = cp.verdict()
    assert isinstance(verdict, Failed) and cp.status is Status.FAILED
    assert "generation 4" in verdict.reason and "no coordinator resolved it" in verdict.reason
    cp.resolution_read(COMMITTED)  # too late: the verdict stands
    assert cp.status is Status.FAILED


def test_a_member_that_failed_aborts_on_its_own_even_without_a_store():
    cp = machine(error="commit: boom")
    assert cp.start() == [WriteAbort("aborted: w0: commit: boom")]
    cp.store_lost(0.5)
    cp.voted(ok=False, write_confirmed=False)
    assert cp.status is Status.ABORTED and cp.verdict() == "aborted: w0: commit: boom"
    assert not cp.ready and cp.report().decision == "aborted: w0: commit: boom"


def test_a_failed_member_never_adopts_a_commit():
    cp = machine(error="commit: boom")
    cp.decision_read(COMMITTED)  # only a tampered store can say so
    assert isinstance(cp.verdict(), Failed) and "w0 failed" in cp.verdict().reason


def test_an_unconfirmed_vote_is_reported_as_not_cast_and_the_member_waits_in_doubt():
    """A ``set`` on a client whose server died can return without error: not a vote. It may have
    landed, though, so the member waits for the resolution (which may be a commit)."""
    cp = machine()
    cp.voted(ok=True, write_confirmed=False)
    assert not cp.ready
    cp.store_lost(1.0)
    assert cp.tick(50.0) == [] and cp.status is Status.WAITING
    cp.reconnected()
    assert cp.report() == OpenGeneration(4, PLAN, ready=False, decision=None)
    cp.resolution_read(COMMITTED)  # another member read "committed" before the store died
    assert cp.verdict() == COMMITTED


def test_a_waiter_in_a_live_store_writes_an_abort_after_its_timeout_and_adopts_what_the_store_holds():
    leaver = CommitPoint(PLAN, "w9", now=0.0, timeout=3 * TIMEOUT, bound=BOUND)
    assert leaver.start() == [] and not leaver.voter
    assert leaver.tick(TIMEOUT) == []
    assert leaver.tick(3 * TIMEOUT + 1) == [WriteAbort(f"aborted: no decision in {3 * TIMEOUT:.0f} s")]
    assert leaver.tick(3 * TIMEOUT + 2) == []  # asked once
    leaver.decision_read(COMMITTED)  # the last member's commit came first (compare-and-set)
    assert leaver.verdict() == COMMITTED


def test_a_slow_store_that_answers_again_is_not_lost():
    cp = machine()
    cp.voted(ok=True, write_confirmed=True)
    cp.store_lost(1.0)
    cp.decision_read("aborted: w1: transfer failed")
    assert cp.verdict() == "aborted: w1: transfer failed" and not cp.lost


def test_the_first_decision_is_final():
    cp = machine()
    cp.voted(ok=True, write_confirmed=True)
    cp.decision_read("aborted: x")
    cp.decision_read(COMMITTED)
    cp.resolution_read(COMMITTED)
    assert cp.verdict() == "aborted: x"


def test_a_value_that_is_not_a_decision_reads_as_an_abort():
    cp = machine()
    cp.voted(ok=True, write_confirmed=True)
    cp.decision_read("garbage")
    assert cp.status is Status.ABORTED and cp.verdict() == "aborted: garbage"


# Each row: role ("ready", "unconfirmed", "failed", "leaver"), the events after ``start``, and the
# status and report (ready, decision) it ends with. ``t`` is a tick at that time.
ORDERS = [
    ("ready", [("voted", True, True), ("decision", COMMITTED)], Status.COMMITTED, True, COMMITTED),
    ("ready", [("voted", True, True), ("lost",), ("t", 500.0)], Status.FAILED, True, None),
    ("ready", [("voted", True, True), ("lost",), ("t", 50.0), ("reconnected",), ("resolution", None),
               ("resolution", "aborted: y")], Status.ABORTED, True, "aborted: y"),
    ("ready", [("lost",), ("voted", True, False), ("reconnected",), ("t", 60.0)], Status.WAITING, False, None),
    ("ready", [("voted", True, True), ("t", 11.0), ("decision", "aborted: no decision in 10 s")], Status.ABORTED,
     True, "aborted: no decision in 10 s"),
    ("unconfirmed", [("voted", True, False), ("lost",), ("reconnected",), ("resolution", "aborted: z")],
     Status.ABORTED, False, "aborted: z"),
    ("failed", [("lost",), ("voted", False, False), ("reconnected",), ("resolution", COMMITTED)], Status.ABORTED,
     False, "aborted: w0: boom"),
    ("failed", [("voted", False, True), ("decision", "aborted: w0: boom")], Status.ABORTED, False,
     "aborted: w0: boom"),
    ("leaver", [("lost",), ("t", 40.0), ("reconnected",), ("resolution", COMMITTED)], Status.COMMITTED, False,
     COMMITTED),
    ("leaver", [("t", 5.0), ("lost",), ("t", 200.0)], Status.FAILED, False, None),
    ("leaver", [("decision", None), ("lost",), ("decision", COMMITTED)], Status.COMMITTED, False, COMMITTED),
]


@pytest.mark.parametrize(("role", "events", "status", "ready", "decision"), ORDERS,
                         ids=[f"{r[0]}-{i}" for i, r in enumerate(ORDERS)])
def test_event_orders(role, events, status, ready, decision):
    cp = CommitPoint(PLAN, "w9" if role == "leaver" else "w0", error="boom" if role == "failed" else "",
                     now=0.0, timeout=TIMEOUT, bound=BOUND)
    cp.start()
    for ev in events:
        name, *args = ev
        {"voted": lambda a: cp.voted(*a), "decision": lambda a: cp.decision_read(*a),
         "resolution": lambda a: cp.resolution_read(*a), "lost": lambda a: cp.store_lost(),
         "reconnected": lambda a: cp.reconnected(), "t": lambda a: cp.tick(*a)}[name](args)
    assert cp.status is status
    assert (cp.report().ready, cp.report().decision) == (ready, decision)


def test_open_generation_round_trips_and_refuses_a_mismatched_plan():
    og = OpenGeneration(4, PLAN, ready=True, decision=None)
    assert OpenGeneration.from_json(og.to_json()) == og
    assert OpenGeneration.from_dict(og.to_dict()) == og
    bad = og.to_json().replace('"generation": 4, "plan"', '"generation": 5, "plan"')
    with pytest.raises(ValueError, match="open generation 5"):
        OpenGeneration.from_json(bad)


# ---- every interleaving, the store dying after any operation ---------------------------------------
class _Store:
    """The generation's store: ready keys and the decision (compare-and-set); after ``dies_after``
    operations it is gone: a set still returns, every read fails."""

    def __init__(self, dies_after: int) -> None:
        self.ops, self.dies_after = 0, dies_after
        self.ready: set[str] = set()
        self.decision: str | None = None

    def alive(self) -> bool:
        self.ops += 1
        return self.ops <= self.dies_after

    def set_ready(self, m: str) -> None:
        if self.alive():
            self.ready.add(m)  # a set on a dead store returns too, but lands nowhere

    def get_ready(self, m: str) -> bool:
        if not self.alive():
            raise ConnectionError
        return m in self.ready

    def all_ready(self) -> bool:
        if not self.alive():
            raise ConnectionError
        return self.ready >= set(PLAN.members)

    def decide(self, value: str) -> str:
        if not self.alive():
            raise ConnectionError
        if self.decision is None:
            self.decision = value
        return self.decision

    def get_decision(self) -> str | None:
        if not self.alive():
            raise ConnectionError
        return self.decision


def _member_steps(cp: CommitPoint, store: _Store):
    """What ``live_switch.decide`` does, one store operation per step."""
    m = cp.member
    with_vote = [lambda: store.set_ready(m)]

    def confirm():
        try:
            cp.voted(True, store.get_ready(m))
        except ConnectionError:
            cp.voted(True, False)
            cp.store_lost()

    def check():
        if cp.decided or cp.lost or not cp.ready:
            return
        try:
            if store.all_ready():
                cp.decision_read(store.decide(COMMITTED))
        except ConnectionError:
            cp.store_lost()

    def poll():
        if cp.decided or cp.lost:
            return
        try:
            cp.decision_read(store.get_decision())
        except ConnectionError:
            cp.store_lost()

    return [*with_vote, confirm, check, poll]


def _interleavings(a: int, b: int):
    for picks in itertools.combinations(range(a + b), a):
        yield [0 if i in picks else 1 for i in range(a + b)]


def test_no_interleaving_and_no_crash_point_gives_two_decisions():
    outcomes = set()
    for dies_after in range(0, 12):
        for order in _interleavings(4, 4):
            store = _Store(dies_after)
            cps = [machine("w0"), machine("w1")]
            steps = [_member_steps(cp, store) for cp in cps]
            pos = [0, 0]
            for who in order:
                steps[who][pos[who]]()
                pos[who] += 1
            # whoever is still waiting: the store is gone, a coordinator restarts and resolves
            waiting = [cp for cp in cps if not cp.decided]
            if waiting:
                for cp in cps:
                    cp.store_lost()
                    cp.reconnected()
                # the coordinator's rule (coordinator.generations), from both members' reports
                resolution = resolve_open(PLAN, {cp.member: cp.report() for cp in cps}, PLAN.members)
                for cp in waiting:
                    cp.resolution_read(resolution)
            verdicts = {cp.verdict() for cp in cps}
            assert len(verdicts) == 1, (dies_after, order, [cp.report() for cp in cps])
            outcomes |= verdicts
    # the crash points cover a commit before the store died; the resolution commits a generation
    # every member reached the commit window of (a vote not confirmed may have landed), so an
    # abort comes only from a member that failed (below)
    assert outcomes == {COMMITTED}
