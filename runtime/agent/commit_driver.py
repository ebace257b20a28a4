"""The store's side of a live transition's commit point: ``CommitDriver``.

``commit_point.CommitPoint`` decides (pure: what to write, what to conclude); this module does
its I/O. A worker drives it from its training thread in ``live_switch.decide``, polling until a
verdict; the protocol simulator (``liveshard.dev.sim``) drives the same class one poll per
simulated wake-up. Its only seams are the ones a simulator must swap:

* ``link``: the process's store clients (``StoreLink``: ``epoch``, the number of clients made
  so far, and ``store``, the current client); the plan's store is the one of ``epoch`` given
  at the start. A worker passes its ``StoreClients``;
* ``clock``: seconds, monotonic.

The rules (``CommitPoint``'s docstring has the why):

* a new member's ready vote is a confirmed write: set, then read back (a ``set`` to a store
  whose server died can return without error);
* whoever sets the last ready key sees every member's (each sets its own, then looks) and
  writes the commit with a compare-and-set (``JobStore.decide``): first valid writer wins;
* a member that failed writes an abort decision (compare-and-set), in the plan's store and, if
  the coordinator restarted meanwhile, in the new one as well;
* while waiting: the timeout's abort in a store that answers, else the decision read there; once
  the plan's store is lost and a restarted coordinator's store is there, its resolution (decision
  or outcome of the generation) is read instead.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

from liveshard.runtime.agent.commit_point import CommitPoint, WriteReady
from liveshard.runtime.agent.kept_writes import KeptWrites
from liveshard.runtime.contract.keys import COMMITTED, Keys
from liveshard.runtime.control.barrier import STORE_BACKOFF, Backoff
from liveshard.runtime.control.store import JobStore

log = logging.getLogger("liveshard.worker")

# How often a store that stopped answering is tried again during the commit point.
LOST_STORE_POLL = 0.25
NOT_AUTHENTIC = "aborted: the decision is not authentic"


class StoreLink(Protocol):
    """A process's store clients: ``epoch`` counts the clients made after the first (a new one
    per coordinator restart); ``store`` is the calling thread's current client; ``kept``: the
    writes kept written until their generation is decided (``kept_writes``)."""

    @property
    def epoch(self) -> int: ...

    @property
    def store(self) -> JobStore: ...

    @property
    def kept(self) -> KeptWrites: ...


class CommitDriver:
    """Carries out ``cp``'s writes and reads over ``link``; ``epoch``: the plan's store.
    ``on_voted``: called after this member's ready vote, before it looks at the others' (tests
    kill processes there: "commit-window")."""

    def __init__(self, cp: CommitPoint, link: StoreLink, epoch: int, *,
                 clock: Callable[[], float] = time.monotonic, on_voted: Callable[[], None] | None = None,
                 incarnation: str | None = None) -> None:
        self.cp = cp
        self.link = link
        self.epoch = epoch
        self.clock = clock
        self.on_voted = on_voted
        self.incarnation = incarnation  # this process's: one declared dead votes no (``_vote_ready``)
        self.gen = cp.generation
        self.key = Keys.decision(cp.generation)
        self._announced = False

    # ---- the plan's store ------------------------------------------------------------------------
    def _in_plan_store(self, op: Callable[[JobStore], None]) -> None:
        """``op`` on the plan's store, under the commit point's lock (a worker's control thread
        reads the commit point under it when it re-announces); the store lost if it is gone."""
        cp = self.cp
        with cp.lock:
            if self.link.epoch != self.epoch:
                cp.store_lost(self.clock())
                cp.reconnected()
                return
            try:
                op(self.link.store)
            except Exception as e:  # the store is going away with its coordinator
                if not cp.lost:
                    log.warning("generation %d: the commit point's store does not answer: %s", self.gen, e)
                cp.store_lost(self.clock())

    def _cas(self, value: str) -> Callable[[JobStore], None]:
        return lambda store: self.cp.decision_read(store.decide(self.key, value) or NOT_AUTHENTIC)

    def _timeout_decision(self, abort: str) -> Callable[[JobStore], None]:
        """No decision within the timeout: the abort, unless every member's ready vote is in the
        store (then nothing can have aborted the generation but a decision since deleted, and
        the commit is the decision to write: atomic commitment's validity holds, and a member
        that read the deleted "committed" is not contradicted)."""
        def write(store: JobStore) -> None:
            keys = [Keys.ready(self.gen, m) for m in self.cp.plan.members]
            every_vote = bool(keys) and all(store.get(k) == "1" for k in keys)
            self.cp.decision_read(store.decide(self.key, COMMITTED if every_vote else abort) or NOT_AUTHENTIC)
        return write

    def _vote_ready(self, store: JobStore) -> None:
        confirmed = False
        ready = Keys.ready(self.gen, self.cp.member)
        if self.incarnation is not None and store.get(Keys.dead(self.cp.member)) == self.incarnation:
            # declared dead meanwhile (frozen past the timeout): the job went on without this
            # process and the coordinator aborts the generation; a yes from it would contradict
            # that if the abort's key were deleted before everyone read it
            self.cp.error = "this process was declared dead during the switch"
            self.cp.decision_read(store.decide(self.key, f"aborted: {self.cp.member}: {self.cp.error}")
                                  or NOT_AUTHENTIC)
            self.cp.voted(ok=False, write_confirmed=True)
            return
        try:
            self.link.kept.write(store, self.gen, ready, "1")  # a vote is never taken back: kept written
            confirmed = store.get(ready) == "1"
        finally:
            self.cp.voted(ok=True, write_confirmed=confirmed)

    def _commit_if_all_ready(self, store: JobStore) -> None:
        keys = [Keys.ready(self.gen, m) for m in self.cp.plan.members]
        if self.cp.ready and store.store.check(keys) and all(store.get(k) == "1" for k in keys):
            self.cp.decision_read(store.decide(self.key, COMMITTED))

    # ---- the protocol ----------------------------------------------------------------------------
    def open(self) -> None:
        """This member's vote (a ready vote and, if it was the last, the commit; or an abort)."""
        cp = self.cp
        for action in cp.start():
            if isinstance(action, WriteReady):
                self._in_plan_store(self._vote_ready)
                if not cp.vote_written:
                    cp.voted(ok=True, write_confirmed=False)  # the store was gone before the vote
                if self.on_voted is not None:
                    self.on_voted()
                self._in_plan_store(self._commit_if_all_ready)
            else:  # this member failed: it aborts, and says so
                self._in_plan_store(self._cas(action.value))
                cp.voted(ok=False, write_confirmed=cp.decided)
                if self.link.epoch != self.epoch:
                    # and to the restarted coordinator's store, where a leaver waiting for the
                    # resolution reads it: no commit can contradict it (the commit needed this
                    # member's ready vote), and a new coordinator never reuses this generation
                    with contextlib.suppress(Exception):
                        self.link.store.decide(self.key, action.value)

    def poll(self) -> bool:
        """One look: the timeout's abort in a store that answers, else the decision read (or a
        restarted coordinator's resolution). True once there is a verdict."""
        cp = self.cp
        if cp.decided:
            return True
        for action in cp.tick(self.clock()):
            self._in_plan_store(self._timeout_decision(action.value))
        if cp.verdict() is not None:
            return True
        if cp.polls_resolution:
            if not self._announced:
                self._announced = True
                log.warning("generation %d: the coordinator restarted inside the commit window; waiting for "
                            "the new one to resolve it (ready vote %s)", self.gen,
                            "cast" if cp.ready else "not cast")
            try:  # the new coordinator's resolution, in its store (the current one)
                store = self.link.store
                cp.resolution_read(store.get(self.key) or store.get(Keys.outcome(self.gen)))
            except Exception:  # that coordinator is restarting too: the process reconnects
                pass
        else:
            self._in_plan_store(lambda store: cp.decision_read(store.get(self.key)))
        return cp.verdict() is not None

    def backoff(self, attempt: int) -> float:
        """The pause before the next ``poll``: a store that stopped answering is tried now and
        then until a restarted coordinator's store is there (each failed try is logged by c10d)."""
        cp = self.cp
        return (Backoff.fixed(LOST_STORE_POLL) if cp.lost and not cp.polls_resolution else STORE_BACKOFF)(attempt)
