"""The worker's control thread: heartbeats, watching for plans, triggering their preparation.

Training never waits on the store. This thread does it instead, a few times a second
(``WorkerOptions.poll_interval``):

* it heartbeats (``WorkerOptions.heartbeat_interval``), so the coordinator sees the worker alive;
* it notes a stop request (``control/stop``) and the newest plan generation (``latest_seen``),
  which the training thread reads at its next step boundary;
* it prepares each new plan that involves this worker (``prepare.Preparer``), in this thread,
  while training goes on;
* it cuts this worker's world off when the coordinator declares one of its members dead
  (``cutoff.PeerWatch``), so that training is never left blocked in a collective with it;
* it keeps what this worker wrote for a generation written until the generation is decided
  (``kept_writes.KeptWrites``): a key deleted before its reader read it would abort the
  generation at the transition timeout;
* when the store stops answering (the coordinator restarts), it connects to the new one and
  announces the world this worker trains in, the commit point it is in and the plan it was
  preparing (``connection.reannounce``), so the new coordinator resolves the one and re-issues
  the other.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from enum import StrEnum
from typing import TYPE_CHECKING

from liveshard.runtime.agent.connection import StoreClients, announcement, reannounce, register_again_if_lost
from liveshard.runtime.agent.cutoff import PeerWatch
from liveshard.runtime.comms import world as worlds
from liveshard.runtime.contract.keys import COMMITTED, Keys
from liveshard.runtime.control.protocol import OpenGeneration, WorldPlan

if TYPE_CHECKING:
    from liveshard.runtime.agent.checkpoint_schedule import SafetyCheckpoints
    from liveshard.runtime.agent.commit_point import CommitPoint
    from liveshard.runtime.agent.prepare import Preparations
    from liveshard.runtime.agent.worker import WorkerOptions, WorkerState
    from liveshard.runtime.control.store import JobStore

log = logging.getLogger("liveshard.worker")

# Seconds between checks that this worker's registration is still in the store (two reads).
REGISTRATION_CHECK = 5.0
# Heartbeats sent because a step ended are at least this far apart (a fast model's steps would
# otherwise write one per step).
STEP_BEAT_SPACING = 0.1


def involved(worker_id: str, plan: WorldPlan, current: WorldPlan | None) -> bool:
    """Whether ``plan`` concerns this worker: a member or standby of it, or a member of the
    world it follows."""
    if worker_id in plan.members or worker_id in plan.standbys:
        return True
    return current is not None and plan.previous == current.generation and worker_id in current.members


class Uptake(StrEnum):
    """What a worker does with the newest plan it read (``takes_up``)."""

    PREPARE = "prepare"
    NEVER = "never"  # not for this process, whatever happens next: not read again
    NOT_NOW = "not-now"  # it does not concern the world this process holds now: read again


def takes_up(worker_id: str, plan: WorldPlan, *, generation: int | None, world: WorldPlan | None, known: bool,
             decided: bool, replacement: Callable[[], bool]) -> Uptake:
    """What this worker does with ``plan``, the newest plan it read: never prepare one it prepared
    (or failed to) before (``known``: a generation is never switched to twice), one no newer than
    the world it trains in (``generation``), one decided already (``decided``), one that counts
    this id dead (a process cut off that came back: the transition leaves it out, and it rejoins
    as a new process once the plan commits, ``left_behind``), nor one that names
    as a process of the world before it an id this process never held (``replacement``:
    ``not_this_process``, asked last because it may read the store); prepare one that concerns it
    (``involved``: a member or standby of it, or a member of ``world``, which it follows); look
    again at any other once its world changes. The control thread and the protocol simulator's
    workers both decide with this."""
    current = generation if generation is not None else -1
    if known or plan.generation <= current or decided or worker_id in plan.dead or replacement():
        return Uptake.NEVER
    return Uptake.PREPARE if involved(worker_id, plan, world) else Uptake.NOT_NOW


def left_behind(worker_id: str, generation: int | None, in_commit_window: bool, store: JobStore) -> bool:
    """Whether the newest committed world (``Keys.CURRENT``) went on without the world this
    process trains in (``generation``): a newer one that does not count it (or counts it dead).
    Not inside a commit window, where only the decision tells."""
    if generation is None or in_commit_window:
        return False
    text = store.get(Keys.CURRENT)
    if text is None or int(text) <= generation:
        return False
    plan = store.plan(int(text))
    return plan is not None and (worker_id in plan.dead or worker_id not in (*plan.members, *plan.standbys))


def not_this_process(worker_id: str, generation: int | None, plan: WorldPlan, store: JobStore) -> bool:
    """Whether ``plan`` names this id as a process of the world before it, which this process
    never held (a replacement under the same id): not for it to act on."""
    if generation is not None or plan.previous is None:
        return False
    return worker_id in getattr(store.plan(plan.previous), "members", (worker_id,))


def in_flight(commit: CommitPoint | None, preparing: WorldPlan | None,
              generation: int | None) -> tuple[OpenGeneration | None, WorldPlan | None]:
    """What a restarted coordinator must resolve or re-issue: the commit point of a generation
    this worker does not train in yet (or just committed: ``commit`` is the newest it entered,
    decided or not), and the newest plan it prepared (``preparing``) whose outcome it never
    learned. ``generation``: the world it trains in."""
    current = generation if generation is not None else -1
    open_generation = commit.report() if commit is not None and commit.generation >= current else None
    learned = commit is not None and preparing is not None and commit.generation == preparing.generation \
        and commit.decided
    pending = preparing if preparing is not None and preparing.generation > current and not learned else None
    return open_generation, pending


class ControlThread:
    """Runs beside training; the training thread reads ``latest_seen`` and ``stop_requested``."""

    def __init__(self, worker_id: str, options: WorkerOptions, clients: StoreClients, state: WorkerState,
                 preparations: Preparations, checkpoints: SafetyCheckpoints,
                 prepare: Callable[[WorldPlan], None], heartbeat: Callable[[float], None]) -> None:
        self.id = worker_id
        self.options = options
        self.clients = clients
        self.state = state
        self.preparations = preparations
        self.checkpoints = checkpoints
        self.prepare = prepare
        self.heartbeat = heartbeat
        self.latest_seen = -1  # newest plan generation this worker has seen
        self.stop_requested = False  # the job asked every worker to finish
        self.excluded: int | None = None  # set when the coordinator declared this process dead
        self.preparing: WorldPlan | None = None  # the newest plan this thread started to prepare
        # plans read (authentic) by this thread or the training thread (``training.StepBoundary``):
        # a plan deleted from the store after one of them read it is still known to both
        self.plans_read: dict[int, WorldPlan] = {}
        self.peers = PeerWatch(worker_id, options, state)  # cuts the world off when a peer is declared dead
        self._registration_checked = time.monotonic()
        self._stop = threading.Event()
        self._stepped = threading.Event()  # a step ended: its compute sample goes out at once
        self.thread = threading.Thread(target=self._loop, name=f"control-{worker_id}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._stepped.set()

    def stepped(self) -> None:
        """A training step ended (called by the training thread): heartbeat and look for plans
        now, not at the next interval. The coordinator's straggler policy acts on each step's
        compute sample, and a plan it publishes is read at the next step boundary."""
        self._stepped.set()

    def _loop(self) -> None:
        next_hb = last_hb = 0.0
        owed = False
        failures = 0
        handled = -1  # newest generation whose plan this thread has looked at
        while not self._stop.is_set():
            now = time.time()
            owed = owed or self._stepped.is_set()  # a step's compute sample not sent yet
            self._stepped.clear()
            if now >= next_hb or (owed and now >= last_hb + STEP_BEAT_SPACING):
                owed, last_hb = False, now
                try:
                    self.heartbeat(now)
                except Exception:  # never let one bad heartbeat end the thread (and the worker's life)
                    log.exception("heartbeat failed")
                next_hb = now + self.options.heartbeat_interval
            try:
                handled = self._poll(handled)
                failures = 0
            except Exception:  # the coordinator (and its store) may be restarting
                failures += 1
                if failures >= 3:
                    if self._reconnect():
                        handled = -1  # a new store: look at its plans afresh
                    failures = 0
            # Every poll takes CPU (and the GIL) from training. Plans come with notice (a spot
            # warning gives minutes) and are prepared in the background, so a few polls a second
            # are prompt enough; a failed poll retries sooner (the coordinator may be restarting).
            # A step's end wakes it early (``stepped``); heartbeats at most every ``STEP_BEAT_SPACING``.
            wait = self.options.poll_interval if failures == 0 else 0.05
            if owed:
                wait = min(wait, max(0.0, last_hb + STEP_BEAT_SPACING - time.time()))
            self._stepped.wait(wait)

    def _poll(self, handled: int) -> int:
        """One look at the store; returns the newest generation whose plan has been acted on."""
        store = self.clients.store
        if store.has(Keys.STOP):
            self.stop_requested = True
        elif self.state.rank is None and store.has(Keys.FINISHED):
            # the job trained to trainIters and saved (rank 0 said so): a standby, or a joiner
            # whose plan will never come, is done too. It exits now, while the coordinator still
            # serves the store, instead of polling a store that goes away with the finished job.
            self.stop_requested = True
        latest = store.latest_generation()
        if latest > self.latest_seen:
            self.latest_seen = latest
        if self.excluded is None and (store.get(Keys.dead(self.id)) == self.state.incarnation
                                      or self._left_behind(store)):
            # the job went on without this process (it was silent: frozen, cut off): whatever it
            # holds is stale. It comes back as a new process would (WorkerAgent.rejoin).
            self.excluded = latest
            self.peers.excluded()  # a training thread blocked in the stale world must get out to rejoin
            return handled
        if latest > handled:  # read a plan until it is acted on, not on every poll after
            plan = self.plans_read.get(latest) or store.plan(latest)
            if plan is not None:
                self.plans_read[latest] = plan
                self.peers.plan_seen(plan)  # before preparing it: its transition group is never cut
                current = self.state.generation if self.state.generation is not None else -1
                known = self.preparations.known(latest)
                decided = not known and latest > current and store.has(Keys.outcome(latest))
                uptake = takes_up(self.id, plan, generation=self.state.generation, world=self.state.plan,
                                  known=known, decided=decided,
                                  replacement=lambda: not_this_process(self.id, self.state.generation, plan, store))
                if uptake is Uptake.PREPARE:
                    self.preparing = plan
                    self.prepare(plan)
                if uptake is not Uptake.NOT_NOW:
                    handled = latest
        self.peers.poll(store)
        self._abort_a_start_decided_against(store)
        now = time.monotonic()
        self.clients.kept.restore(store, now)
        if now - self._registration_checked > REGISTRATION_CHECK:
            self._registration_checked = now
            commit = self.state.commit_point
            register_again_if_lost(
                self.clients, self.id,
                lambda: announcement(self.state, lambda: self.checkpoints.last, self.latest_seen,
                                     lambda: self._in_flight(commit)),
                guard=(lambda: commit.lock) if commit is not None else None)
        return handled

    def _abort_a_start_decided_against(self, store: JobStore) -> None:
        """A world being made from scratch (``comms.world.Start``) whose generation the
        coordinator decided against (a member died: it aborts the generation ``T`` after the
        member's last beat) is aborted: its rendezvous and megatron's groups would otherwise wait
        for the lost member one collective timeout each, in turn."""
        start = worlds.Start.current()
        if start is None:
            return
        outcome = store.get(Keys.outcome(start.generation))
        if outcome is None or outcome == COMMITTED:
            return
        shut = start.abort(f"generation {start.generation} was decided: {outcome}"[:300])
        if shut is not None:
            log.warning("aborted the start of generation %d (%s): %d connection(s) shut down",
                        start.generation, outcome[:200], shut)

    def _left_behind(self, store: JobStore) -> bool:
        commit = self.state.commit_point
        return left_behind(self.id, self.state.generation, commit is not None and not commit.decided, store)

    def _reconnect(self) -> bool:
        """Connect to a restarted coordinator and announce the world this worker trains in, the
        commit point it is in and the plan it was preparing (``_in_flight``)."""
        commit = self.state.commit_point
        guard = (lambda: commit.lock) if commit is not None else None
        if not reannounce(self.clients, self.id, self.state, lambda: self.checkpoints.last, self.latest_seen,
                          in_flight=lambda: self._in_flight(commit), guard=guard):
            return False
        # Plans of the old store that never took effect here are gone with it: a restarted
        # coordinator numbers its plans above every generation announced to it, never reusing one
        # (a switch waiting for one of them gives up; the new coordinator re-issues the change).
        self.preparations.abandon_after(self.state.generation, self.latest_seen, "the coordinator restarted")
        self.heartbeat(time.time())
        self.latest_seen = max(self.latest_seen, self.state.generation or 0)
        log.warning("reconnected to the coordinator; announced generation %s", self.state.generation)
        return True

    def _in_flight(self, commit: CommitPoint | None) -> tuple[OpenGeneration | None, WorldPlan | None]:
        return in_flight(commit, self.preparing, self.state.generation)
