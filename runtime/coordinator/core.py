"""The coordinator's decisions as a state machine: observations in, actions out, time injected.

``CoordinatorCore.step(obs)`` takes what the loop read this tick (heartbeats, the pending
generation's results and decision, a request, registrations after a restart) and returns what to
do (publish a plan, write a decision, declare a member dead, stop, report). It does no I/O and
reads no clock: every time it uses is the observation's (``obs.now`` to judge, ``obs.wall`` to
stamp), and the loop (``coordinator.loop``) does the I/O; the protocol simulator
(``liveshard.dev.sim``) drives this same class on a simulated clock with seeded faults.

Its phase is one value derived from its ``ControlState`` (``phases.phase_of``); what it does in
each lives in functions over the core: ``planning`` (requests into plans), ``adoption`` (a
takeover after a restart), ``switching`` (the pending generation). ``waiting`` says what it waits
for, for the status.

One authority per event: this core is the only judge of liveness (``membership.Liveness``) and
the only writer of a generation's outcome; the decision of a live transition has one key and its
first valid value stands (``generations``).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from liveshard.runtime.contract.env import Defaults
from liveshard.runtime.contract.keys import COMMITTED
from liveshard.runtime.control.protocol import WorkerPhase, WorldPlan
from liveshard.runtime.coordinator import phases, planning, switching
from liveshard.runtime.coordinator.adoption import take_over
from liveshard.runtime.coordinator.events import Action, CheckpointView, Decide, MarkDead, Observation, Report
from liveshard.runtime.coordinator.generations import Generation, involved
from liveshard.runtime.coordinator.membership import Liveness
from liveshard.runtime.coordinator.phases import ControlState, Phase
from liveshard.runtime.coordinator.requests import PlanningInputs, PlanRequest
from liveshard.runtime.coordinator.status import progress_of
from liveshard.runtime.coordinator.world_choice import WorldChooser

log = logging.getLogger("liveshard.coordinator")

MAX_BROKEN_RECOVERIES = 5  # broken-world recoveries in a row without a commit before the run fails


class CoordinatorCore:
    def __init__(self, chooser: WorldChooser, planning: PlanningInputs, *, heartbeat_timeout: float = Defaults.HEARTBEAT_TIMEOUT,
                 transition_timeout: float = Defaults.TRANSITION_TIMEOUT, checkpoints: CheckpointView | None = None,
                 stragglers: Any = None, precompute: bool = True, adoption_grace: float | None = None) -> None:
        self.chooser = chooser
        self.planning = planning
        self.heartbeat_timeout = heartbeat_timeout
        self.transition_timeout = transition_timeout
        self.checkpoints = checkpoints or CheckpointView()
        self.stragglers = stragglers  # control.stragglers.StragglerLoop, or None
        self.precompute = precompute
        self.adoption_grace = 2 * heartbeat_timeout if adoption_grace is None else adoption_grace
        self.liveness = Liveness(heartbeat_timeout)
        self.state = ControlState()  # what the phases decide over (``phases``)
        self.next_generation = 0
        self.history: list[dict[str, Any]] = []
        self.telemetry: dict[str, dict[str, Any]] = {}
        self.adopted_checkpoint: dict[str, Any] | None = None  # announced by workers after a restart
        self.nodes: dict[str, str] = {}  # each live worker's node, as it registered
        self.memory: dict[str, int] = {}  # each live worker's device memory, where it announced one
        self.broken_since: dict[str, float] = {}  # members reporting the current world broken, since when
        self.broken_recoveries = 0
        self.unresponsive: dict[str, float] = {}  # silent in an aborted first world: since when
        self.silent_in: dict[str, int] = {}  # aborted generations in a row a member gave no result in
        self.retried: dict[str, int] = {}  # a change whose members' transition failed: tries again so far
        self.retry_hold: switching.RetryHold | None = None  # a change asked again, waiting for its unheard members
        self.recovery_refused: dict[str, float] = {}  # why a recovery was refused, since when
        self.now = 0.0  # the last observation's monotonic time
        self.wall = 0.0  # and its unix time
        self.read_inputs: PlanningInputs | None = None

    train_iters: int | None = None  # the job's trainIters (set by the loop from the training spec)

    # ---- the state, and what the loop should read ----------------------------------------------
    def change(self, **fields: Any) -> None:
        """Move to a new ``ControlState`` (the fields given replaced)."""
        self.state = replace(self.state, **fields)

    @property
    def phase(self) -> Phase:
        return phases.phase_of(self.state)

    @property
    def current(self) -> WorldPlan | None:
        return self.state.current

    @property
    def pending(self) -> Generation | None:
        return self.state.pending

    @property
    def failure(self) -> dict[str, Any] | None:
        return self.state.failure

    @property
    def finished(self) -> dict[str, Any] | None:
        return self.state.finished

    @property
    def dead(self) -> set[str]:
        return self.liveness.dead

    @property
    def adopting(self) -> bool:
        return phases.reads_adoption(self.state)

    @property
    def wants_registrations(self) -> bool:
        """Whether the loop should read the registrations this tick (besides with a request):
        the phase's need (``phases.wants_registrations``), or a member of an adopted world whose
        holding process has not re-registered yet."""
        return phases.wants_registrations(self.state) or \
            (self.phase not in phases.TERMINAL and self.liveness.awaiting_holders())

    def deferred_members(self) -> tuple[str, ...]:
        return self.state.deferred.request.members if self.state.deferred is not None else ()

    @property
    def wants_request(self) -> bool:
        """Whether the loop should poll the plan source this tick."""
        return phases.wants_request(self.state)

    @property
    def accepting(self) -> bool:
        """Whether a request would be taken now (the loop reads the planning inputs only then)."""
        return phases.accepting(self.state)

    @property
    def waiting(self) -> str | None:
        """What the coordinator waits for, in words, as of the last observation (the status's
        ``waiting``); None while it waits for nothing."""
        limits = phases.Limits(self.heartbeat_timeout, self.transition_timeout, self.liveness.never_seen_grace,
                               self.adoption_grace)
        waits = phases.Waits(refused=self.recovery_refused, broken=self.broken_since,
                             holders_missing=self.liveness.awaiting_holders(), dead=frozenset(self.dead))
        return phases.waiting_reason(self.state, self.now, limits, waits)

    def watched(self) -> set[str]:
        """The members whose heartbeats matter now, the dead (who may come back as new) and the
        silent of an aborted first world (a beat since brings them back into the next one)."""
        out: set[str] = set(self.dead) | set(self.unresponsive)
        if self.current:
            out |= {*self.current.members, *self.current.standbys}
        if self.pending:
            out |= set(self.pending.plan.members)
            out |= set(involved(self.current, self.pending.plan))
        hold = self.retry_hold
        if hold is not None and any(r is hold.request for r in self.state.reissue):
            out |= set(hold.unheard)  # asked again once they beat, dropped if they die
        return out

    def involved_alive(self) -> tuple[str, ...]:
        if self.pending is None:
            return ()
        return tuple(m for m in involved(self.current, self.pending.plan) if m not in self.dead)

    # ---- one tick ----------------------------------------------------------------------------
    def step(self, obs: Observation) -> list[Action]:
        self.now, self.wall = obs.now, obs.wall
        if obs.inputs is not None:
            self.read_inputs = obs.inputs
        if self.failure is not None:
            return []  # terminal: nothing more is planned (the workers were told to stop)
        if isinstance(obs.finished, dict) and obs.finished.get("error") and self.finished is None:
            # rank 0 at trainIters: the final checkpoint could not be saved anywhere (its retries,
            # fallback and wait for space spent: ``agent.final_save``). Judged before liveness:
            # the workers exit right after saying so, and their exits are no deaths to recover.
            return planning.fail(self, "FinalCheckpointFailed", str(obs.finished["error"]))
        if self.finished is not None:
            # trainIters reached and the final checkpoint saved: the job is done. The workers exit
            # now; their silence (or a forger hiding their last beats) is no loss to recover.
            return []
        out: list[Action] = []
        if self.adopting and obs.registrations:
            out += take_over(self, obs.registrations, obs.now)
        if obs.registrations:
            self._registered(obs)
        out += self._judge_liveness(obs)
        self._measure(obs)
        if self.pending is not None:
            out += self._finished_before_the_change(obs) or switching.collect(self, obs)
        if self.failure is None and self.pending is None and self.current is not None \
                and any(m in self.dead for m in self.current.members):
            out += planning.recover(self)
        out += self._note_broken(obs.now)
        if self.finished is None and self.pending is None and obs.finished is not None:
            self.change(finished=obs.finished)
            log.info("training finished at step %s; final checkpoint %s", obs.finished.get("step"),
                     obs.finished.get("checkpoint"))
            out.append(Report())
        if self.accepting:
            out += self._next_request(obs)
        elif obs.request is not None and self.failure is None:
            # polled while this core took requests, then this tick began an adoption (a restarted
            # coordinator's first registrations): owed, asked after it, never dropped unanswered
            self.change(reissue=(*self.state.reissue, obs.request))
            log.warning("request %r waits for the adoption of the running world", obs.request.reason)
        return out

    def _next_request(self, obs: Observation) -> list[Action]:
        """While accepting, the first owed change is started: a first world again, a deferred
        request, a plan owed after a restart, the source's request, else the straggler policy's."""
        state = self.state
        if state.restart is not None:
            return planning.restart_request(self, obs) if obs.registrations is not None else []
        if state.deferred is not None:
            return planning.start(self, state.deferred.request, obs)
        if state.reissue:
            request, *rest = state.reissue
            if switching.held(self, request):
                return []  # a change asked again waits for a sign of life of the members it names
            self.change(reissue=tuple(rest))
            return planning.start(self, request, obs)
        if obs.request is not None:
            return planning.start(self, obs.request, obs)
        return self._consider_stragglers(obs)

    def _finished_before_the_change(self, obs: Observation) -> list[Action]:
        """Rank 0 of the world that runs reported trainIters reached and the final checkpoint
        saved while a change to another world was pending and undecided: its workers exit, so
        the change can never commit. The report is taken now (the job is finished: nothing more
        is planned, no recovery of the world whose workers end), and the change decided aborted
        (a write-once decision: one that stands wins, and then it is recorded as it stands)."""
        report, gen, current = obs.finished, self.pending, self.current
        if not isinstance(report, dict) or report.get("error") or gen is None or current is None:
            return []
        if report.get("generation") != current.generation or obs.decision is not None:
            return []
        if any((b := self.liveness.latest(m)) is not None and b.generation == gen.plan.generation
               for m in gen.plan.members):
            return []  # a member trains in the new world: it read a commit (``switching.collect``)
        self.change(finished=report)
        log.info("training finished at step %s in generation %d while generation %d was pending; final "
                 "checkpoint %s", report.get("step"), current.generation, gen.plan.generation, report.get("checkpoint"))
        return [Decide(gen.plan.generation, f"aborted: training finished in generation {current.generation}"), Report()]

    def decided(self, generation: int, value: str | None, now: float) -> list[Action]:
        """The value that stands at ``generation``'s commit point after a ``Decide``."""
        self.now = now
        gen = self.pending
        if gen is None or gen.plan.generation != generation:
            return []
        if value == COMMITTED and any(m not in gen.results for m in self.involved_alive()):
            return []  # the members' reports (phase timings) follow at once: the next ticks wait for them
        return switching.finish(self, gen, value or "aborted: the decision is not authentic", now)

    # ---- registrations, liveness, measurements ------------------------------------------------
    def _registered(self, obs: Observation) -> None:
        """Note each live registered worker's node and memory, and the holders re-registering."""
        for m, reg in (obs.registrations or {}).items():
            if m not in self.dead:
                self.nodes.setdefault(m, reg.node)
                if reg.gpu_memory_bytes is not None:
                    self.memory.setdefault(m, reg.gpu_memory_bytes)
            if self.current is not None and (
                    (reg.plan is not None and reg.plan.generation == self.current.generation)
                    or (reg.open is not None and reg.open.generation == self.current.generation)):
                # a holder re-registering late: it trains in the world, or is inside the commit
                # window of the generation adopted as committed (it reads that decision next)
                self.liveness.hold(m, reg.incarnation)

    def _measure(self, obs: Observation) -> None:
        """Telemetry and the straggler loop's measurements, stamped with the observation's time."""
        for m, hb in obs.telemetry.items():
            self.telemetry[m] = hb
            if self.stragglers is not None:
                self.stragglers.observe(m, hb)
        if self.current is not None and self.stragglers is not None:
            self.stragglers.update((m for m in self.current.members if m not in self.dead), now=obs.wall)

    def _judge_liveness(self, obs: Observation) -> list[Action]:
        if obs.paused > 0 and self.pending is not None:
            self.pending.pause(obs.paused)
        busy: set[str] = set(self.current.members) if self.current else set()
        if self.pending is not None:
            busy |= set(self.pending.plan.members) | set(involved(self.current, self.pending.plan))
            for m in obs.results:
                if m not in self.pending.results:  # read for the first time (``switching.collect`` keeps it)
                    self.liveness.sign_of_life(m, obs.now)
        verdict = self.liveness.judge(obs.now, self.watched() - self.dead, obs.beats, paused=obs.paused,
                                      corroborated=self._peer_loss_reported(), busy=frozenset(busy))
        out: list[Action] = []
        for d in verdict.dead:
            self.forget(d.member)
            self.broken_since.pop(d.member, None)
            log.warning("member %s is dead: %s", d.member, d.why)
            out.append(MarkDead(d.member, d.incarnation))
        for m in verdict.readmitted:
            self.forget(m)  # a new process: perhaps on another node
            log.warning("%s is back as a new member", m)
        # A dead member's heartbeats may still be read (readmission), never judged: judge() only
        # looks at the watched members that are alive.
        for m in verdict.readmitted:
            read = obs.beats.get(m)
            if read is not None and m in obs.telemetry:
                self.telemetry[m] = obs.telemetry[m]
        if verdict.dead:
            out.append(Report())
        return out

    def forget(self, member: str) -> None:
        """A process gone (or replaced): its node and memory are no longer known."""
        self.nodes.pop(member, None)
        self.memory.pop(member, None)

    def _peer_loss_reported(self) -> frozenset[str]:
        """The current world's members, when another of them reports that world broken (from the
        last heartbeats read): a failed collective, the first sign of a peer lost without notice.
        None once one of them is dead: that death explains the break, and the report says
        nothing more about the others (whose keys an attacker may be overwriting)."""
        current = self.current
        if current is None or any(m in self.dead for m in current.members):
            return frozenset()
        reporting = [m for m in current.members if m not in self.dead
                     and (b := self.liveness.latest(m)) is not None and b.state == WorkerPhase.BROKEN
                     and b.generation == current.generation]
        return frozenset(m for m in current.members if m not in reporting) if reporting else frozenset()

    def _note_broken(self, now: float) -> list[Action]:
        """Recover a current world whose members report it broken while none of them is dead: a
        collective that failed without a death, or a generation aborted after its vote (the
        members hold the old state but its groups are gone). ``MAX_BROKEN_RECOVERIES`` attempts
        in a row without a commit end the run."""
        current = self.current
        if current is None or self.failure is not None:
            return []
        for m in current.members:
            b = self.liveness.latest(m)
            if b is not None and b.state == WorkerPhase.BROKEN and b.generation == current.generation:
                self.broken_since.setdefault(m, now)
            else:
                self.broken_since.pop(m, None)
        if not self.broken_since or self.pending is not None or any(m in self.dead for m in current.members):
            return []
        member, since = min(self.broken_since.items(), key=lambda kv: kv[1])
        if now - since <= self.heartbeat_timeout:  # a death is detected within the timeout: let it be the cause
            return []
        self.broken_since.clear()
        self.broken_recoveries += 1
        if self.broken_recoveries > MAX_BROKEN_RECOVERIES:
            return planning.fail(self, "RecoveryFailing", f"the world of generation {current.generation} stayed "
                                                          f"broken through {MAX_BROKEN_RECOVERIES} recoveries in a row")
        log.warning("the world of generation %d is broken (%s) with every member alive: recovering",
                    current.generation, member)
        return planning.recover(self, reason=f"world of generation {current.generation} broken without a death")

    # ---- stragglers --------------------------------------------------------------------------
    def _consider_stragglers(self, obs: Observation) -> list[Action]:
        """The straggler policy's plan, if a switch pays (``control.stragglers``)."""
        current, loop = self.current, self.stragglers
        if loop is None or current is None or any(m in self.dead for m in current.members):
            return []
        progress = self.progress() or {}
        if progress.get("step") is None:
            return []
        inputs = obs.inputs
        if inputs is not None and inputs.adaptive is not None and inputs.adaptive != loop.policy:
            loop.set_policy(inputs.adaptive)  # the job's spec was edited
        step = int(progress["step"])
        left = self.train_iters - step if self.train_iters is not None else None
        alive = replace(current, standbys=tuple(m for m in current.standbys if m not in self.dead))
        request = loop.consider(alive, step, progress.get("step_seconds"),
                                [h for h in self.history if h.get("generation") is not None], left, now=obs.wall)
        if request is None:
            return []
        generation = self.next_generation
        out = planning.start(self, PlanRequest(**request), obs)
        if self.pending is not None and self.pending.plan.generation == generation:
            loop.taken(generation, now=obs.wall)
        else:
            loop.rejected(now=obs.wall)
        return out

    def progress(self) -> dict[str, Any] | None:
        """Where training is, from the members' heartbeats (``status.progress_of``)."""
        return progress_of(self.current, self.telemetry)
