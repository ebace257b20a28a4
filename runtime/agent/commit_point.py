"""One process's commit point of a live transition, as a pure state machine (two-phase-commit recovery).

At the end of a live switch every new member votes (``Keys.ready``: its new world is built and
loaded; or an abort decision: it failed), and every process of the transition then reads the
generation's decision (``Keys.decision``: first writer wins, in the job's store). The store is
served by the coordinator; when the coordinator dies inside that window the decision may be
unreadable, and a store client whose server died can even accept a ``set`` without error. This
module decides what a process may do then, without any I/O of its own: the caller (the worker's
``live_switch.decide``, a simulator) performs the writes it asks for and feeds the results back as
events, with the time passed in.

The rules are those of two-phase-commit recovery:

* a vote counts only once it is **confirmed** (read back, or written with ``add``, which fails at
  once on a dead store): a ``set`` that returned is not a vote;
* a member that failed votes to abort and may abort on its own: the commit needs its ready vote;
* a process that cannot read the decision after a ready vote was, or may have been, cast waits:
  it keeps both the old state and the new world, reports what it knows to a restarted
  coordinator (``report``: an ``OpenGeneration``) and adopts whatever that coordinator resolves.
  A member whose vote write was not confirmed is in doubt as well (the write may have landed and
  another member may have read "committed"), so it waits too, reporting its vote unconfirmed;
* a process that waited in a store that still answers writes an abort decision after its timeout
  (compare-and-set: it adopts the value the store holds afterwards, which may be "committed");
* nobody able to resolve the generation within ``bound`` seconds after the store was lost is a
  ``Failed`` verdict, never a silent exit.

The coordinator's side of the recovery is ``coordinator.generations.resolve_open``: what a
restarted coordinator decides for an open generation from the members' reports.

Thread use: the worker drives a machine from its training thread and the control thread reads
``report()`` when it re-announces; ``lock`` is for them (the machine itself never takes it).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import StrEnum

from liveshard.runtime.contract.keys import COMMITTED
from liveshard.runtime.control.protocol import OpenGeneration, WorldPlan


class Status(StrEnum):
    WAITING = "waiting"  # no decision known yet
    COMMITTED = "committed"
    ABORTED = "aborted"
    FAILED = "failed"  # nobody could resolve the generation in time (see ``Failed``)


@dataclass(frozen=True)
class WriteReady:
    """Write this member's ready vote (``Keys.ready``), confirmed; then report ``voted``."""


@dataclass(frozen=True)
class WriteAbort:
    """Compare-and-set ``value`` as the decision (``Keys.decision``); then report ``decision_read``
    with the value the key holds afterwards."""

    value: str


Action = WriteReady | WriteAbort


@dataclass(frozen=True)
class Failed:
    """The verdict when nobody can resolve the generation: the process must end with an error."""

    reason: str


def is_committed(value: str | None) -> bool:
    return value == COMMITTED


class CommitPoint:
    """The commit point of generation ``plan.generation`` as process ``member`` lives it.

    ``error``: why this member failed to build the new world ("" if it did not; only a member of
    ``plan`` votes). ``timeout``: seconds it waits for the decision in a live store before it
    writes an abort decision (compare-and-set). ``bound``: seconds after the store was lost
    within which a restarted coordinator must resolve the generation.
    """

    def __init__(self, plan: WorldPlan, member: str, *, error: str = "", now: float, timeout: float,
                 bound: float) -> None:
        self.plan = plan
        self.member = member
        self.voter = member in plan.members
        self.error = error
        self.timeout = timeout
        self.bound = bound
        self.started = now
        self.now = now
        self.status = Status.WAITING
        self.decision: str | None = None  # the decision this process read (or resolved to)
        self.vote_written = False  # a vote (ready or abort) was attempted
        self.ready = False  # this member's ready vote is cast and confirmed
        self.lost_at: float | None = None  # when the store holding the decision was lost
        self.on_new_store = False  # a restarted coordinator's store is there to poll
        self.abort_written = False  # the timeout's abort decision was asked for
        self.failure: Failed | None = None
        self.lock = threading.Lock()  # see the module's docstring

    @property
    def generation(self) -> int:
        return self.plan.generation

    # ---- what to do ---------------------------------------------------------------------------
    def start(self) -> list[Action]:
        """The writes to make on entering the commit point."""
        if not self.voter:
            return []  # a leaver or a standby has no vote: it reads the decision
        if self.error:
            return [WriteAbort(f"aborted: {self.member}: {self.error}")]
        return [WriteReady()]

    @property
    def decided(self) -> bool:
        return self.status is not Status.WAITING

    @property
    def lost(self) -> bool:
        """Whether the store holding the decision is gone (or was, until a decision came)."""
        return self.lost_at is not None

    @property
    def polls_old_store(self) -> bool:
        """Whether reading ``Keys.decision`` in the store the generation was published in is
        still worth it (it answered last time)."""
        return not self.decided and not self.lost

    @property
    def polls_resolution(self) -> bool:
        """Whether to read the restarted coordinator's resolution (``Keys.decision`` or
        ``Keys.outcome`` of this generation in the new store)."""
        return not self.decided and self.on_new_store

    def report(self) -> OpenGeneration:
        """What this process tells a restarted coordinator about the generation."""
        return OpenGeneration(generation=self.generation, plan=self.plan, ready=self.ready, decision=self.decision)

    def verdict(self) -> str | Failed | None:
        """The decision to act on (``"committed"`` or ``"aborted: ..."``), ``Failed``, or None
        while waiting."""
        if self.failure is not None:
            return self.failure
        return self.decision if self.decided else None

    # ---- events -------------------------------------------------------------------------------
    def voted(self, ok: bool, write_confirmed: bool) -> list[Action]:
        """This member's vote was written: ready (``ok``) or an abort; ``write_confirmed``: the
        store confirmed it (read back, or ``add``)."""
        self.vote_written = True
        if not ok:
            # a member that failed: the commit needs its ready vote, so it cannot have happened
            self._decide(Status.ABORTED, f"aborted: {self.member}: {self.error or 'failed'}")
            return []
        if self.error:
            return []  # a ready vote from a member that failed is never cast (``start`` asks none)
        self.ready = self.ready or write_confirmed
        return []

    def decision_read(self, value: str | None) -> list[Action]:
        """The decision as read in the generation's own store (None: not written yet)."""
        if value is None or self.decided:
            return []
        if self.lost_at is not None and not self.on_new_store:
            self.lost_at = None  # the store answers after all: it was slow, not gone
        self._adopt(value)
        return []

    def store_lost(self, now: float | None = None) -> list[Action]:
        """The store holding the decision does not answer (or was replaced: the coordinator
        restarted)."""
        if now is not None:
            self.now = max(self.now, now)
        if self.decided or self.lost_at is not None:
            return []
        self.lost_at = self.now
        return []

    def reconnected(self) -> list[Action]:
        """A restarted coordinator's store is there: from now on its resolution is read."""
        if self.lost_at is None:
            self.lost_at = self.now
        self.on_new_store = True
        return []

    def resolution_read(self, value: str | None) -> list[Action]:
        """The restarted coordinator's resolution of this generation (None: not yet)."""
        if value is None or self.decided:
            return []
        self._adopt(value)
        return []

    def tick(self, now: float) -> list[Action]:
        self.now = max(self.now, now)
        if self.decided:
            return []
        if self.lost_at is not None:
            if self.now - self.lost_at > self.bound:
                self.failure = Failed(f"generation {self.generation}: its commit point was lost and no coordinator "
                                      f"resolved it in {self.bound:.0f} s")
                self.status = Status.FAILED
            return []
        if self.now - self.started > self.timeout and not self.abort_written:
            self.abort_written = True
            return [WriteAbort(f"aborted: no decision in {self.timeout:.0f} s")]
        return []

    # ---- internals ----------------------------------------------------------------------------
    def _adopt(self, value: str) -> None:
        if is_committed(value):
            if self.voter and self.error:
                # only a tampered store says so: never train on a world that was not built
                self.failure = Failed(f"generation {self.generation} committed although {self.member} failed: "
                                      f"{self.error}")
                self.status = Status.FAILED
                return
            self._decide(Status.COMMITTED, COMMITTED)
        else:
            self._decide(Status.ABORTED, value if value.startswith("aborted") else f"aborted: {value}")

    def _decide(self, status: Status, decision: str) -> None:
        if self.decided:
            return
        self.status = status
        self.decision = decision

