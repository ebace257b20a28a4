"""The coordinator's decisions as a state machine: observations in, actions out, time injected.

``CoordinatorCore.step(obs)`` takes what the loop read this tick (heartbeats, the pending
generation's results and decision, a request, registrations after a restart) and returns what to
do (publish a plan, write a decision, declare a member dead, stop, report). It does no I/O and
reads no clock: the loop (``coordinator.loop``) does both, and the protocol simulator
(``liveshard.dev.sim``) drives this same class on a simulated clock with seeded faults.

One authority per event: this core is the only judge of liveness (``membership.Liveness``) and
the only writer of a generation's outcome; the decision of a live transition has one key and its
first valid value stands (``generations``).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from liveshard.runtime.contract.env import Defaults
from liveshard.runtime.contract.keys import COMMITTED
from liveshard.runtime.control.protocol import GenerationOutcome, MemberResult, WorkerPhase, WorldPlan
from liveshard.runtime.coordinator.adoption import Adopting
from liveshard.runtime.coordinator.events import (
    Action,
    CheckpointView,
    Decide,
    MarkDead,
    Observation,
    Precompute,
    Report,
    WriteOutcome,
)
from liveshard.runtime.coordinator.generations import TIMED_OUT, Generation, involved, judge, resolve_open
from liveshard.runtime.coordinator.membership import Liveness
from liveshard.runtime.coordinator.planning import Planning
from liveshard.runtime.coordinator.requests import PlanningInputs, PlanRequest
from liveshard.runtime.coordinator.status import progress_of
from liveshard.runtime.coordinator.world_choice import WorldChooser

log = logging.getLogger("liveshard.coordinator")

MAX_BROKEN_RECOVERIES = 5  # broken-world recoveries in a row without a commit before the run fails


class CoordinatorCore(Planning, Adopting):
    def __init__(self, chooser: WorldChooser, planning: PlanningInputs, *, heartbeat_timeout: float = Defaults.HEARTBEAT_TIMEOUT,
                 transition_timeout: float = Defaults.TRANSITION_TIMEOUT, checkpoints: CheckpointView | None = None,
                 stragglers=None, precompute: bool = True, adoption_grace: float | None = None) -> None:
        self.chooser = chooser
        self.planning = planning
        self.heartbeat_timeout = heartbeat_timeout
        self.transition_timeout = transition_timeout
        self.checkpoints = checkpoints or CheckpointView()
        self.stragglers = stragglers  # control.stragglers.StragglerLoop, or None
        self.precompute = precompute
        self.adoption_grace = 2 * heartbeat_timeout if adoption_grace is None else adoption_grace
        self.liveness = Liveness(heartbeat_timeout)
        self.current: WorldPlan | None = None  # the committed world
        self.pending: Generation | None = None  # a generation being switched to
        self.next_generation = 0
        self.history: list[dict] = []
        self.telemetry: dict[str, dict] = {}
        self.failure: dict | None = None  # why the run cannot go on (terminal)
        self.finished: dict | None = None
        self.adopted_checkpoint: dict | None = None  # announced by workers after a restart
        self.nodes: dict[str, str] = {}  # each live worker's node, as it registered
        self.memory: dict[str, int] = {}  # each live worker's device memory, where it announced one
        self._broken_since: dict[str, float] = {}
        self._broken_recoveries = 0
        self._reissue: list[PlanRequest] = []  # plans a restarted coordinator owes the workers
        # A first world to make again (every worker of the running world lost, or a first world
        # aborted): from the newest verified checkpoint (or afresh), asked since then
        self._restart: tuple[bool, float] | None = None
        self._unresponsive: dict[str, float] = {}  # silent in an aborted first world: since when
        self._silent_in: dict[str, int] = {}  # aborted generations in a row a member gave no result in
        self._recovery_refused: dict[str, float] = {}  # why a recovery was refused, since when
        self._deferred: tuple[PlanRequest, float] | None = None  # a request waiting for its workers to register
        self._adopting_since: float | None = None
        self._awaiting_adoption = False  # registrations say workers ran plans: wait for their world
        self._now = 0.0
        self._wall = 0.0
        self._read_inputs: PlanningInputs | None = None

    # ---- what the loop should read -----------------------------------------------------------
    @property
    def dead(self) -> set[str]:
        return self.liveness.dead

    @property
    def adopting(self) -> bool:
        return self.current is None and self.pending is None and self.failure is None and self._restart is None

    @property
    def wants_registrations(self) -> bool:
        """Whether the loop should read the registrations this tick (besides with a request)."""
        return self.adopting or self._deferred is not None or self._restart is not None or bool(self._reissue) \
            or (self.pending is not None and self.pending.reopened) or self.liveness.awaiting_holders()

    def deferred_members(self) -> tuple[str, ...]:
        return self._deferred[0].members if self._deferred is not None else ()

    @property
    def wants_request(self) -> bool:
        """Whether the loop should poll the plan source this tick."""
        return self.accepting and self._deferred is None and not self._reissue and self._restart is None

    @property
    def accepting(self) -> bool:
        """Whether a request would be taken now (the loop polls the source only then): not while
        a restarted coordinator waits to learn what the workers run."""
        return self.failure is None and self.pending is None and self.finished is None and not self._awaiting_adoption

    def watched(self) -> set[str]:
        """The members whose heartbeats matter now, the dead (who may come back as new) and the
        silent of an aborted first world (a beat since brings them back into the next one)."""
        out: set[str] = set(self.dead) | set(self._unresponsive)
        if self.current:
            out |= {*self.current.members, *self.current.standbys}
        if self.pending:
            out |= set(self.pending.plan.members)
            out |= set(involved(self.current, self.pending.plan))
        return out

    def involved_alive(self) -> tuple[str, ...]:
        if self.pending is None:
            return ()
        return tuple(m for m in involved(self.current, self.pending.plan) if m not in self.dead)

    # ---- one tick ----------------------------------------------------------------------------
    def step(self, obs: Observation) -> list[Action]:
        self._now, self._wall = obs.now, obs.wall
        if obs.inputs is not None:
            self._read_inputs = obs.inputs
        if self.failure is not None:
            return []  # terminal: nothing more is planned (the workers were told to stop)
        if isinstance(obs.finished, dict) and obs.finished.get("error") and self.finished is None:
            # rank 0 at trainIters: the final checkpoint could not be saved anywhere (its retries,
            # fallback and wait for space spent: ``agent.final_save``). Judged before liveness:
            # the workers exit right after saying so, and their exits are no deaths to recover.
            return self._fail("FinalCheckpointFailed", str(obs.finished["error"]))
        if self.finished is not None:
            # trainIters reached and the final checkpoint saved: the job is done. The workers exit
            # now; their silence (or a forger hiding their last beats) is no loss to recover.
            return []
        out: list[Action] = []
        if self.adopting and obs.registrations:
            out += self._adopt(obs.registrations, obs.now)
        if obs.registrations:
            for m, reg in obs.registrations.items():
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
        out += self._judge_liveness(obs)
        for m, hb in obs.telemetry.items():
            self.telemetry[m] = hb
            if self.stragglers is not None:
                self.stragglers.observe(m, hb)
        if self.current is not None and self.stragglers is not None:
            self.stragglers.update(m for m in self.current.members if m not in self.dead)
        if self.pending is not None:
            out += self._collect(obs)
        if self.failure is None and self.pending is None and self.current is not None \
                and any(m in self.dead for m in self.current.members):
            out += self._recover()
        out += self._note_broken(obs.now)
        if self.finished is None and self.pending is None and obs.finished is not None:
            self.finished = obs.finished
            log.info("training finished at step %s; final checkpoint %s", obs.finished.get("step"),
                     obs.finished.get("checkpoint"))
            out.append(Report())
        if self.accepting:
            if self._restart is not None:
                if obs.registrations is not None:
                    out += self._restart_request(obs)
            elif self._deferred is not None:
                out += self._start(self._deferred[0], obs)
            elif self._reissue:
                out += self._start(self._reissue.pop(0), obs)
            elif obs.request is not None:
                out += self._start(obs.request, obs)
            else:
                out += self._consider_stragglers(obs)
        return out

    def decided(self, generation: int, value: str | None, now: float) -> list[Action]:
        """The value that stands at ``generation``'s commit point after a ``Decide``."""
        self._now = now
        gen = self.pending
        if gen is None or gen.plan.generation != generation:
            return []
        if value == COMMITTED and any(m not in gen.results for m in self.involved_alive()):
            return []  # the members' reports (phase timings) follow at once: the next ticks wait for them
        return self._finish(gen, value or "aborted: the decision is not authentic", now)

    # ---- liveness ----------------------------------------------------------------------------
    def _judge_liveness(self, obs: Observation) -> list[Action]:
        busy: set[str] = set(self.current.members) if self.current else set()
        if self.pending is not None:
            busy |= set(self.pending.plan.members) | set(involved(self.current, self.pending.plan))
        verdict = self.liveness.judge(obs.now, self.watched() - self.dead, obs.beats,
                                      corroborated=self._peer_loss_reported(), busy=frozenset(busy))
        out: list[Action] = []
        for d in verdict.dead:
            self.nodes.pop(d.member, None)
            self.memory.pop(d.member, None)
            self._broken_since.pop(d.member, None)
            log.warning("member %s is dead: %s", d.member, d.why)
            out.append(MarkDead(d.member, d.incarnation))
        for m in verdict.readmitted:
            self.nodes.pop(m, None)  # a new process: perhaps on another node
            self.memory.pop(m, None)
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

    def _peer_loss_reported(self) -> frozenset[str]:
        """The current world's members, when another of them reports that world broken (from the
        last heartbeats read): a failed collective, the first sign of a peer lost without notice."""
        current = self.current
        if current is None:
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
                self._broken_since.setdefault(m, now)
            else:
                self._broken_since.pop(m, None)
        if not self._broken_since or self.pending is not None or any(m in self.dead for m in current.members):
            return []
        member, since = min(self._broken_since.items(), key=lambda kv: kv[1])
        if now - since <= self.heartbeat_timeout:  # a death is detected within the timeout: let it be the cause
            return []
        self._broken_since.clear()
        self._broken_recoveries += 1
        if self._broken_recoveries > MAX_BROKEN_RECOVERIES:
            return self._fail("RecoveryFailing", f"the world of generation {current.generation} stayed broken "
                                                 f"through {MAX_BROKEN_RECOVERIES} recoveries in a row")
        log.warning("the world of generation %d is broken (%s) with every member alive: recovering",
                    current.generation, member)
        return self._recover(reason=f"world of generation {current.generation} broken without a death")

    # ---- the pending generation --------------------------------------------------------------
    def _collect(self, obs: Observation) -> list[Action]:
        gen = self.pending
        assert gen is not None
        for m, r in obs.results.items():
            gen.results.setdefault(m, r)
        if gen.reopened and obs.decision is None:
            regs = obs.registrations or {}
            votes = {m: r.open for m, r in regs.items() if r.open is not None}
            adopted = [m for m, r in regs.items() if r.plan is not None and r.plan.generation == gen.plan.generation]
            value = resolve_open(gen.plan, votes, regs.keys(), self.dead, adopted)
            return [] if value is None else [Decide(gen.plan.generation, value)]
        if not gen.plan.is_live_transition:
            # A member heartbeating from inside the new world has taken it up: as good as its
            # result (which one write carries, and an attacker can delete; beats keep coming).
            for m in gen.plan.members:
                b = self.liveness.latest(m)
                if m not in gen.results and b is not None and b.generation == gen.plan.generation \
                        and b.state == WorkerPhase.TRAINING:
                    gen.results[m] = MemberResult(ok=True)
        if self.current is not None:
            for m in self.involved_alive():
                b = self.liveness.latest(m)
                if b is not None and b.state == WorkerPhase.TRAINING and b.step is not None \
                        and b.generation == self.current.generation and b.preparing == gen.plan.generation:
                    gen.saw_step(m, b.step, obs.now)
        verdict = judge(gen, self.current, self.dead, decision=obs.decision, arrived=obs.arrived, ready=obs.ready,
                        now=obs.now, timeout=self.transition_timeout)
        if verdict.decide is not None:
            return [Decide(gen.plan.generation, verdict.decide)]
        if verdict.finish is not None:
            return self._finish(gen, verdict.finish, obs.now)
        return []

    def _finish(self, gen: Generation, outcome: str, now: float) -> list[Action]:
        plan = gen.plan
        gen.outcome = outcome
        phases: dict[str, float] = {}
        for r in gen.results.values():
            for k, v in r.phases.items():
                phases[k] = max(phases.get(k, 0.0), v)
        self._history(GenerationOutcome(
            plan.generation, outcome, reason=plan.reason, config=plan.config, world_size=len(plan.members),
            cause=plan.cause, phases=phases, downtime=phases.get("downtime", 0.0),
            switch_step=max((r.step for r in gen.results.values()), default=-1), seconds=now - gen.started))
        out: list[Action] = [WriteOutcome(plan.generation, outcome)]
        if outcome == COMMITTED:
            self.current = plan
            self._broken_recoveries = 0
            if self.stragglers is not None:
                self.stragglers.committed(plan)
            for m in plan.members:
                self._broken_since.pop(m, None)
            # The plan's own dead (gone without notice when it was made) stay dead under any
            # coordinator: one restarted since then never saw the verdict, and the process may
            # be alive after all (frozen): it must drop the world the job went past and come back
            # as a new process.
            for m in plan.dead:
                death = self.liveness.declare(m, f"named dead by generation {plan.generation}")
                if death is not None:
                    self.nodes.pop(m, None)
                    self.memory.pop(m, None)
                    out.append(MarkDead(m, death.incarnation))
        self.pending = None
        log.info("generation %d %s", plan.generation, outcome)
        out += self._unanswered(gen, outcome)
        if outcome != COMMITTED and plan.previous is None and self.current is None and not plan.is_stop:
            # A first world that did not start: made again with the workers that answered. Only a
            # timeout says something of the silent: after a member's death the others may still
            # be waiting for it in the world's rendezvous (they answer once that fails).
            if outcome.startswith(TIMED_OUT):
                for m in plan.members:
                    if m not in gen.results:
                        self._unresponsive[m] = now
            self._restart = (plan.restore_from is not None, now)
        out.append(Report())
        if outcome == COMMITTED:
            out += self._precompute_action()
        if self.current is not None and any(m in self.dead for m in self.current.members):
            out += self._recover()  # the world lost a member (before this generation, or after its commit point)
        return out

    def _unanswered(self, gen: Generation, outcome: str) -> list[Action]:
        """A member that gave no result in two aborted generations in a row answers nothing (a
        process alive but hung, whose heartbeats still come): the liveness judge declares it
        dead, so the next plan goes without it instead of timing out again."""
        out: list[Action] = []
        if outcome == COMMITTED:
            self._silent_in.clear()
            return out
        if not outcome.startswith(TIMED_OUT) or not gen.results:
            # aborted for a death or a failure, or nobody answered (the transition could not
            # form: a cause elsewhere): a missing result says nothing of the member
            return out
        for m in involved(self.current, gen.plan):
            if m in gen.results:
                self._silent_in.pop(m, None)
            elif m not in self.dead:
                self._silent_in[m] = self._silent_in.get(m, 0) + 1
                if self._silent_in[m] >= 2:
                    death = self.liveness.declare(m, "no result in two generations in a row")
                    if death is not None:
                        self._silent_in.pop(m, None)
                        log.warning("member %s is dead: %s", m, death.why)
                        out.append(MarkDead(m, death.incarnation))
        return out

    def _precompute_action(self) -> list[Action]:
        current = self.current
        self.chooser.plans.clear()  # the questions of the previous world will not be asked again
        if not self.precompute or current is None or current.is_stop or not current.members:
            return []
        if any(m in self.dead for m in current.members):
            return []  # a recovery follows at once
        return [Precompute(current, frozenset(self.dead))]

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
                                [h for h in self.history if h.get("generation") is not None], left)
        if request is None:
            return []
        generation = self.next_generation
        out = self._start(PlanRequest(**request), obs)
        if self.pending is not None and self.pending.plan.generation == generation:
            loop.taken(generation)
        else:
            loop.rejected()
        return out

    train_iters: int | None = None  # the job's trainIters (set by the loop from the training spec)

    def progress(self) -> dict | None:
        """Where training is, from the members' heartbeats (``status.progress_of``)."""
        return progress_of(self.current, self.telemetry)


