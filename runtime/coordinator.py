"""The job's coordinator: hosts the c10d store, turns requests into world plans, watches health.

It is a small state machine over store keys (``contract.keys``; messages in ``control.protocol``):

* it takes plan requests from a ``PlanSource`` (the local driver through the store, or the
  operator through the job's status), gives each a generation and publishes it;
* it watches heartbeats; a member silent for ``heartbeat_timeout`` is dead (for half of it once
  a peer reports their world broken), and the
  coordinator publishes a recovery plan for the survivors at once (the runtime cannot wait for
  an operator to notice a killed process);
* it collects every member's result for a generation and its outcome: for a live transition
  the decision the members write at the commit point (``gen/<N>/decision``; the coordinator
  writes "aborted" there itself on a death, a failure or a timeout), otherwise all results ok;
  it records phase timings and downtime and acknowledges the outcome to the plan source;
* when the run cannot go on (state lost with no copy and no checkpoint), it reports a terminal
  failure and tells every worker to stop.

Training does not touch the coordinator between reconfigurations: workers only write
heartbeats. If the coordinator restarts, workers re-register with their current generation and
the coordinator adopts it (``recover``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from liveshard.runtime.contract.causes import Cause
from liveshard.runtime.contract.keys import COMMITTED, Keys
from liveshard.runtime.contract.status import pod_of
from liveshard.runtime.contract.times import iso
from liveshard.runtime.contract.training import TrainingSpec
from liveshard.runtime.control.metrics import JobMetrics
from liveshard.runtime.control.protocol import MemberResult, WorldPlan, transition_members
from liveshard.runtime.control.store import JobStore
from liveshard.runtime.control.stragglers import StragglerLoop
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.planner import GPU, Constraints, NoFeasiblePlan, ParallelPlan, plan_world
from liveshard.runtime.planner.adapt import AdaptivePolicy, layer_caps_for
from liveshard.runtime.planner.precompute import PlanCache
from liveshard.runtime.spec import ModelSpec

log = logging.getLogger("liveshard.coordinator")

MAX_BROKEN_RECOVERIES = 5  # broken-world recoveries in a row without a commit before the run fails


@dataclass
class PlanRequest:
    """A wish for a new world: explicit members (in rank order) and config, or "plan a world
    for these workers" (``config`` None: the planner chooses the config and the rank order)."""

    members: tuple[str, ...]
    config: str | None = None
    reason: str = ""
    switch_at_step: int | None = None
    deadline: float | None = None
    cause: str | None = None  # a contract.Cause value
    # Whether ``members`` is the rank order (the operator's plans: its planner chose it); if not,
    # the planner places an explicit config over them too.
    ordered: bool = True


@dataclass(frozen=True)
class PlanningInputs:
    """What the planner is given besides the workers: the job's constraints (the same the
    operator plans with), each GPU's memory, and measured relative speeds per pod."""

    constraints: Constraints
    gpu_memory_bytes: int = 80 << 30
    speeds: Mapping[str, float] = field(default_factory=dict)
    adaptive: AdaptivePolicy | None = None  # the straggler policy (spec.elasticity.adaptive)


class PlanSource(Protocol):
    def poll(self) -> PlanRequest | None: ...

    def report(self, status: dict) -> None: ...

    def planning(self) -> PlanningInputs | None:
        """The job's current planning inputs, or None to keep the coordinator's own."""
        ...


def whole_pods(workers: tuple[str, ...], gpus_per_pod: int) -> tuple[str, ...]:
    """The workers of pods all of whose ``gpus_per_pod`` processes are here, in the order given:
    plans come in whole pods (a pod that lost one process keeps the others as standbys)."""
    if gpus_per_pod <= 1:
        return workers
    have: dict[str, set[str]] = {}
    for w in workers:
        have.setdefault(pod_of(w), set()).add(w)
    return tuple(w for w in workers if len(have[pod_of(w)]) == gpus_per_pod)


class StorePlanSource:
    """Requests posted in the store by the local driver (``request/<k>``, counter ``request/count``)."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self.seen = 0

    @staticmethod
    def post(store: JobStore, request: PlanRequest) -> None:
        index = store.store.add(Keys.REQUEST_COUNT, 1) - 1
        store.set_json(Keys.request(index), request.__dict__)

    def poll(self) -> PlanRequest | None:
        count = self.store.store.add(Keys.REQUEST_COUNT, 0)
        if self.seen >= count:
            return None
        key = Keys.request(self.seen)
        data = self.store.get_json(key)
        if data is None:
            if self.store.store.check([key]):  # written, but not with the job's secret: skip it
                self.seen += 1
            return None  # else: counter bumped, value not written yet
        self.seen += 1
        data["members"] = tuple(data["members"])
        return PlanRequest(**data)

    def report(self, status: dict) -> None:
        pass  # the coordinator's status is in the store already (Keys.COORDINATOR_STATUS)

    def planning(self) -> PlanningInputs | None:
        return None


@dataclass
class Generation:
    plan: WorldPlan
    started: float
    results: dict[str, MemberResult] = field(default_factory=dict)
    outcome: str | None = None


class Coordinator:
    def __init__(self, store: JobStore, spec: ModelSpec, source: PlanSource, planning: PlanningInputs, *,
                 heartbeat_timeout: float = 3.0, transition_timeout: float = 120.0,
                 training: TrainingSpec | None = None, metrics: JobMetrics | None = None,
                 checkpoint_dir: str | None = None, stragglers: StragglerLoop | None = None,
                 precompute: bool = True) -> None:
        self.store = store
        self.training = training  # the job's training spec: progress, ETA
        self.metrics = metrics  # Prometheus gauges of the job (None: not exported)
        self.checkpoint_dir = checkpoint_dir  # the job's checkpoints (the first world continues the newest)
        self.spec = spec
        self.source = source
        self.planning = planning
        self.heartbeat_timeout = heartbeat_timeout
        self.transition_timeout = transition_timeout
        self.current: WorldPlan | None = None  # the committed world
        self.pending: Generation | None = None  # a generation being switched to
        self.next_generation = 0
        self.dead: set[str] = set()
        self.history: list[dict] = []
        self.telemetry: dict[str, dict] = {}
        # compute speed per device, stragglers and (if enabled) the adaptive policy; without a
        # training spec only the measurements (the policy needs the batch)
        self.stragglers = stragglers or self._straggler_loop()
        self._adopted_checkpoint: dict | None = None  # announced by workers after a restart
        self._last_report = 0.0
        self.report_interval = 2.0
        self._first_seen: dict[str, float] = {}
        self._broken_since: dict[str, float] = {}  # current members reporting a broken world
        self._dead_incarnation: dict[str, str | None] = {}  # the process each dead member was
        self._incarnation: dict[str, str | None] = {}  # the process each watched member is
        self._broken_recoveries = 0  # recoveries of broken worlds since the last commit
        self.finished: dict | None = None  # rank 0's report at trainIters (Keys.FINISHED)
        self.failure: dict | None = None  # why the run cannot go on (terminal), see _fail
        # Answers of the planner and of the no-live-copy check by their full inputs; after each
        # commit a background thread asks the questions of the likeliest next events
        # (``_precompute_next``), so that such an event finds its plan worked out.
        self.plans = PlanCache()
        self.precompute = precompute
        self.precomputed: dict | None = None  # the last precomputation: generation, events, seconds
        self._nodes: dict[str, str] = {}  # each live worker's node, as it registered

    def _straggler_loop(self) -> StragglerLoop:
        c, t = self.planning.constraints, self.training
        return StragglerLoop(self.spec, self.planning.adaptive or AdaptivePolicy(),
                             global_batch=t.global_batch if t else c.global_batch,
                             micro_batch=t.micro_batch if t else c.micro_batch,
                             seq_length=t.seq_length if t else (c.seq_length or self.spec.max_sequence_length),
                             granularity=c.granularity,
                             layer_caps=layer_caps_for(self.spec, c, self.planning.gpu_memory_bytes),
                             allowed_pp=c.pp, max_world=c.max_gpus)

    # ---- main loop ---------------------------------------------------------------------------
    def run(self, stop_after: float | None = None, period: float = 0.02, idle_period: float = 0.2) -> None:
        """Tick until stopped: every ``period`` seconds while a generation is being switched to,
        every ``idle_period`` otherwise (each tick reads every member's heartbeat; between
        reconfigurations that is all there is to do, and the workers need the CPU)."""
        end = None if stop_after is None else time.monotonic() + stop_after
        while end is None or time.monotonic() < end:
            if self.store.has(Keys.STOP) and self.pending is None:
                self._drain()
                self._report()
                return
            self.tick()
            time.sleep(period if self.pending is not None else idle_period)

    def _drain(self, timeout: float = 60.0) -> None:
        """After a stop, keep the store up until the workers have seen it and exited: they read
        the stop key from it (a restarted coordinator would have a store without it)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            live = [m for m in ((*self.current.members, *self.current.standbys) if self.current else ())
                    if m not in self.dead]
            beats = [self.store.get_json(Keys.heartbeat(m)) or {} for m in live]
            if all(b.get("state") in ("exited", "finished") or time.time() - b.get("time", 0) > self.heartbeat_timeout
                   for b in beats):
                return
            time.sleep(0.1)

    def tick(self) -> None:
        if self.failure is not None:
            return  # terminal: nothing more is planned (the workers were told to stop)
        if self.current is None and self.pending is None:
            self._adopt_running_world()
        self._watch_heartbeats()
        if self.current is not None:
            self.stragglers.update(m for m in self.current.members if m not in self.dead)
        if self.metrics is not None and self.current is not None and self.current.members:
            t = self.training
            self.metrics.observe_heartbeats(self.telemetry, self.current.members, generation=self.current.generation,
                                            train_iters=t.train_iters if t else None,
                                            tokens_per_step=t.global_batch * t.seq_length if t else None)
        self._collect_results()
        if self.finished is None and self.pending is None:
            self.finished = self.store.get_json(Keys.FINISHED)
            if self.finished is not None:
                log.info("training finished at step %s; final checkpoint %s", self.finished.get("step"),
                         self.finished.get("checkpoint"))
                self._report()
        if self.pending is None and self.finished is None:
            request = self.source.poll()
            if request is not None:
                self._start(request)
            else:
                self._consider_stragglers()
        if time.monotonic() - self._last_report > self.report_interval:
            self._report()

    # ---- plans -------------------------------------------------------------------------------
    def _start(self, request: PlanRequest) -> None:
        if request.config == "":
            self._start_stop(request)
            return
        members = tuple(m for m in request.members if m not in self.dead)
        try:
            world = self._choose_world(request, members)
        except (ConfigError, NoFeasiblePlan) as e:
            self._reject(request, str(e))
            return
        plan = self._world_plan(request, world, members, self.current, self.dead, self.next_generation)
        if self.current is None and self.checkpoint_dir:
            # A first world with a complete checkpoint on the job's volume continues from it:
            # every process of the job was replaced (a whole spot pool gone, a restart), not a new run.
            from liveshard.runtime.agent.checkpoint import newest_complete

            found = newest_complete(self.checkpoint_dir)
            if found is not None:
                log.warning("a first world with a checkpoint on the job's volume: continuing from step %d (%s)",
                            found["step"], found["path"])
                plan = replace(plan, restore_from=found["path"])
        if self.current is not None:
            try:
                no_copy = self._no_live_copy(plan)
            except (ConfigError, ValueError) as e:  # e.g. a device order the transition cannot use
                self._reject(request, str(e))
                return
            if no_copy is not None:  # the last checkpoint is the way back
                checkpoint = self.latest_checkpoint()
                if checkpoint is None:
                    why = f"{no_copy} (and no checkpoint to restore from)"
                    if any(m in self.dead for m in self.current.members):
                        self._fail("NoSurvivingCopy", why)  # the state is gone: nothing can continue the run
                    else:
                        self._reject(request, why)  # a plan the running world need not take
                    return
                log.warning("%s: restoring step %s from %s", no_copy, checkpoint.get("step"), checkpoint["path"])
                plan = replace(plan, restore_from=checkpoint["path"])
        self._publish(plan)

    def _world_plan(self, request: PlanRequest, world: ParallelPlan, members: tuple[str, ...],
                    current: WorldPlan | None, dead: set[str] | frozenset[str], generation: int) -> WorldPlan:
        ordered = tuple(g.id for g in world.gpus)
        used = set(ordered)
        return WorldPlan(
            generation=generation,
            config=str(world.config),
            members=ordered,
            standbys=tuple(m for m in members if m not in used),
            reason=request.reason,
            previous=current.generation if current else None,
            switch_at_step=request.switch_at_step,
            deadline=request.deadline,
            dead=tuple(sorted(dead & set(current.members))) if current else (),
            created=time.time(),
            cause=request.cause,
        )

    def _choose_world(self, request: PlanRequest, members: tuple[str, ...], *, current: WorldPlan | None = None,
                      dead: set[str] | frozenset[str] | None = None, inputs: PlanningInputs | None = None,
                      node_of=None, count: bool = True) -> ParallelPlan:
        """The planner's world for ``members``: a request's explicit config keeps the rank order
        it gives (the operator's planner chose it); otherwise the planner chooses both, from the
        inputs the operator has: the job's constraints, its GPU memory and measured speeds.

        From the running world, its dead members, the planning inputs and the workers' nodes
        as they are now, unless given (what a precomputation supposes); answered from
        ``self.plans`` when the same question was asked before."""
        if current is None:
            current = self.current
        dead = self.dead if dead is None else dead
        inputs = inputs or self.source.planning() or self.planning
        node_of = node_of or self._node_of
        c = inputs.constraints
        gpus = tuple(GPU(id=m, node=node_of(m), memory_bytes=inputs.gpu_memory_bytes,
                         speed=float(inputs.speeds.get(pod_of(m), 1.0))) for m in whole_pods(members, c.granularity))
        config = ParallelConfig.parse(request.config) if request.config is not None else None
        placed = config is not None and request.ordered  # the given order, as it is
        running = current if current is not None and not current.is_stop and not placed else None
        cfg = ParallelConfig.parse(running.config) if running else None
        running_members = running.members if running else ()
        lost = tuple(m for m in running.members if m in dead) if running else ()
        return self.plans.get(
            ("world", self.spec, gpus, c, config, cfg, running_members, lost),
            lambda: plan_world(self.spec, gpus, c, config=config, current=cfg, current_members=running_members,
                               lost=lost),
            count=count)

    def _node_of(self, worker: str) -> str:
        node = self._nodes.get(worker)
        if node is None:
            info = self.store.get_json(Keys.member(worker)) or {}
            node = str(info.get("node") or info.get("host") or worker)
            if info:
                self._nodes[worker] = node  # fixed for the process; forgotten when it dies
        return node

    def _no_live_copy(self, plan: WorldPlan, current: WorldPlan | None = None, count: bool = True) -> str | None:
        """Why ``plan`` cannot take its state from the running world (None: it can): whether
        some state is held only by dead members, from their holder sets (``lost_state``), not
        by planning the transition (each member plans its own part). Answered from
        ``self.plans`` when the same transition was asked about before."""
        from liveshard.runtime.agent.transition import transition_inputs
        from liveshard.runtime.vps.device_plan import lost_state

        current = current or self.current
        assert current is not None
        if current.is_stop:
            return "the job was stopped: its state is in its last checkpoint"
        inputs = transition_inputs(current, plan)
        return self.plans.get(("lost", self.spec, *inputs), lambda: lost_state(self.spec, *inputs), count=count)

    # ---- plans ahead of events ---------------------------------------------------------------
    def _precompute_next(self) -> None:
        """After a commit: ask, in a background thread, what the likeliest next events will ask
        (``_precompute``). The inputs that need the store or the plan source are read here, in
        the coordinator's thread; the thread itself only plans."""
        current = self.current
        self.plans.clear()  # the questions of the previous world will not be asked again
        if not self.precompute or current is None or current.is_stop or not current.members:
            return
        if any(m in self.dead for m in current.members):
            return  # a recovery follows at once
        everyone = (*current.members, *current.standbys)
        waiting = tuple(m for m in self.store.members() if m not in set(everyone) and m not in self.dead)
        nodes = {m: self._node_of(m) for m in (*everyone, *waiting)}
        inputs = self.source.planning() or self.planning
        threading.Thread(target=self._precompute, args=(current, frozenset(self.dead), inputs, nodes, waiting),
                         name="precompute-plans", daemon=True).start()

    def _precompute(self, current: WorldPlan, dead: frozenset[str], inputs: PlanningInputs,
                    nodes: dict[str, str], waiting: tuple[str, ...]) -> None:
        """The world plans, and their no-live-copy checks, for each node of ``current`` lost
        without notice (each worker, when they all share one node) and for each node of waiting
        workers joining (and all of them, when they are on several), asked exactly as
        ``_recover`` and a join request naming the running world's workers, then the joiners,
        would ask them."""
        t0 = time.perf_counter()
        everyone = (*current.members, *current.standbys)
        by_node: dict[str, list[str]] = {}
        for m in everyone:
            by_node.setdefault(nodes[m], []).append(m)
        domains = list(by_node.values()) if len(by_node) > 1 else [[m] for m in everyone]
        asked = 0
        try:
            for lost in domains:
                if self._event_since(current, dead):
                    break  # an event came: the world is changing, and the CPU is the transition's
                if not any(m in current.members for m in lost):
                    continue  # losing only standbys plans nothing
                gone = dead | set(lost)
                survivors = tuple(m for m in everyone if m not in gone)
                self._ask(current, PlanRequest(members=survivors, cause=Cause.LOST_WITHOUT_NOTICE), gone, inputs, nodes)
                asked += 1
            arriving: dict[str, list[str]] = {}
            for m in waiting:
                arriving.setdefault(nodes[m], []).append(m)
            joins = list(arriving.values()) + ([list(waiting)] if len(arriving) > 1 else [])
            for new in joins:  # each waiting node joining, and all of them together
                if self._event_since(current, dead):
                    break
                self._ask(current, PlanRequest(members=(*everyone, *new)), dead, inputs, nodes)
                asked += 1
        except Exception:  # a precomputation never takes the coordinator down: the event plans itself
            log.exception("precomputing plans for generation %d", current.generation)
        self.precomputed = {"generation": current.generation, "events": asked,
                            "seconds": time.perf_counter() - t0}
        log.info("generation %d: plans for %d likely events precomputed in %.2f s", current.generation, asked,
                 time.perf_counter() - t0)

    def _event_since(self, current: WorldPlan, dead: frozenset[str]) -> bool:
        """Whether the world moved on since a precomputation started: a plan pending, another
        world, or a death seen (before its recovery is even planned)."""
        try:
            seen = frozenset(self.dead)
        except RuntimeError:  # the set is changing in the coordinator's thread right now
            return True
        return self.current is not current or self.pending is not None or seen != dead

    def _ask(self, current: WorldPlan, request: PlanRequest, dead: frozenset[str], inputs: PlanningInputs,
             nodes: dict[str, str]) -> None:
        """Put ``request``'s world plan and its no-live-copy check into ``self.plans``, supposing
        ``dead`` (what ``_start`` asks when the request comes)."""
        members = tuple(m for m in request.members if m not in dead)
        try:
            world = self._choose_world(request, members, current=current, dead=dead, inputs=inputs,
                                       node_of=nodes.__getitem__, count=False)
        except (ConfigError, NoFeasiblePlan):
            return  # kept as the answer
        plan = self._world_plan(request, world, members, current, dead, current.generation + 1)
        with contextlib.suppress(ConfigError, ValueError):  # kept as the answer
            self._no_live_copy(plan, current, count=False)

    def _start_stop(self, request: PlanRequest) -> None:
        """A stop: the running world saves a checkpoint, and every worker waits for a plan that
        restores it (the operator's answer when no layout fits the workers that remain)."""
        if self.current is None or self.current.is_stop:
            self._reject(request, "no running world to stop")
            return
        alive = tuple(m for m in (*self.current.members, *self.current.standbys, *request.members)
                      if m not in self.dead)
        plan = WorldPlan(
            generation=self.next_generation,
            config="",
            members=(),
            standbys=tuple(dict.fromkeys(alive)),
            reason=request.reason,
            previous=self.current.generation,
            switch_at_step=request.switch_at_step,
            deadline=request.deadline,
            dead=tuple(sorted(self.dead & set(self.current.members))),
            created=time.time(),
        )
        self._publish(plan)

    def _fail(self, reason: str, message: str) -> None:
        """The run cannot go on (state lost with no copy and no checkpoint): a terminal status
        the operator turns into a Failed job, and a stop for every worker still waiting."""
        log.error("the job cannot continue: %s", message)
        self.failure = {"reason": reason, "message": message, "time": time.time()}
        self.history.append({"generation": None, "reason": "recovery", "outcome": f"failed: {message}"})
        self.store.set(Keys.STOP, "1")
        self._report()

    def _reject(self, request: PlanRequest, why: str) -> None:
        log.error("plan request rejected (%s): %s", request.reason, why)
        self.history.append({"generation": None, "reason": request.reason, "outcome": f"rejected: {why}"})
        self._report()

    def latest_checkpoint(self) -> dict | None:
        """The newest complete checkpoint the workers reported (rank 0 writes it after a save);
        where this coordinator sees the job's volume, one that fails verification gives way to
        the newest intact one there."""
        info = self.store.get_json(Keys.CHECKPOINT) or self._adopted_checkpoint
        if info and self.checkpoint_dir and os.path.isdir(str(info.get("path"))):
            from liveshard.runtime.agent.checkpoint import newest_complete, verify

            problem = verify(info["path"])
            if problem is not None:
                log.warning("checkpoint %s failed verification (%s): looking for an older one", info["path"], problem)
                return newest_complete(self.checkpoint_dir)
        return info

    def _publish(self, plan: WorldPlan) -> None:
        self.next_generation += 1
        self.pending = Generation(plan, time.monotonic())
        self.store.publish_plan(plan)
        log.info("published plan %d: %s on %d members (%s)", plan.generation, plan.config,
                 len(plan.members), plan.reason)
        self._report()

    def _collect_results(self) -> None:
        gen = self.pending
        if gen is None:
            return
        plan = gen.plan
        involved = (transition_members(self.current, plan) if self.current else plan.members)
        involved = tuple(m for m in involved if m not in self.dead)
        for m in involved:
            if m not in gen.results:
                text = self.store.get(Keys.result(plan.generation, m))
                if text is not None:
                    gen.results[m] = MemberResult.from_json(text)
        failed = [m for m, r in gen.results.items() if not r.ok]
        timed_out = time.monotonic() - gen.started > self.transition_timeout
        # A dead source (an old member that is leaving) fails the transition as a dead new member
        # does, until the vote: once a new member arrives to build the new world, every source
        # has delivered, and only the new members matter.
        lost = [m for m in plan.members if m in self.dead]
        if self.current is not None and not lost and plan.is_live_transition \
                and self.store.store.add(Keys.arrived(plan.generation), 0) == 0:
            lost = [m for m in transition_members(self.current, plan) if m in self.dead]
        complete = len(gen.results) == len(involved)
        why = None
        if failed:
            why = f"aborted: {failed[0]}: {gen.results[failed[0]].error}"
        elif lost:
            why = f"aborted: member {lost[0]} died during the transition"
        elif timed_out and not complete:
            missing = sorted(set(involved) - set(gen.results))
            why = f"aborted: no result from {', '.join(missing[:3])} in {self.transition_timeout:.0f} s"
        if self.current is not None and plan.is_live_transition:
            # The commit point is the generation's decision in the store, written once by
            # whoever comes first: the last member ready ("committed") or a failure
            # ("aborted"); the coordinator writes it on a death, a failure or a timeout.
            decision = self.store.get(Keys.decision(plan.generation))
            if decision is None and why is not None:
                decision = self.store.decide(Keys.decision(plan.generation), why) or why
            if decision is None:
                return
            if decision == COMMITTED and not (complete or why is not None):
                return  # the members' reports (phase timings) follow at once
            self._finish(gen, decision)
        elif why is not None or complete:
            self._finish(gen, why or COMMITTED)

    def _finish(self, gen: Generation, outcome: str) -> None:
        plan = gen.plan
        gen.outcome = outcome
        self.store.set(Keys.outcome(plan.generation), outcome)
        phases: dict[str, float] = {}
        for r in gen.results.values():
            for k, v in r.phases.items():
                phases[k] = max(phases.get(k, 0.0), v)
        entry = {
            "generation": plan.generation,
            "config": plan.config,
            "world_size": len(plan.members),
            "reason": plan.reason,
            "cause": plan.cause,
            "outcome": outcome,
            "phases": phases,
            "downtime": phases.get("downtime", 0.0),
            "switch_step": max((r.step for r in gen.results.values()), default=-1),
            "seconds": time.monotonic() - gen.started,
        }
        self.history.append(entry)
        if self.metrics is not None:
            self.metrics.observe_generation(outcome, phases)
        if outcome == COMMITTED:
            self.current = plan
            self._broken_recoveries = 0
            self.stragglers.committed(plan)
        self.pending = None
        log.info("generation %d %s", plan.generation, outcome)
        self._report()
        if outcome == COMMITTED:
            self._precompute_next()
        if self.current is not None and any(m in self.dead for m in self.current.members):
            self._recover()  # the world lost a member (before this generation, or after its commit point)

    # ---- health ------------------------------------------------------------------------------
    def _watch_heartbeats(self) -> None:
        watched: set[str] = set()
        if self.current:
            watched |= {*self.current.members, *self.current.standbys}
        if self.pending:
            # every process the transition waits for: its sources, new members, joiners
            plan = self.pending.plan
            watched |= {*plan.members, *(transition_members(self.current, plan) if self.current else ())}
        now = time.time()
        newly_dead = []
        corroborated = self._peer_loss_reported()
        for m in sorted(watched - self.dead):
            hb = self.store.get_json(Keys.heartbeat(m))
            if hb is None:
                # Registered (e.g. re-announced to a restarted coordinator) but silent since: the
                # registration is its last sign of life. Never seen: a long grace (still starting).
                info = self.store.get_json(Keys.member(m))
                if info is not None and now - float(info.get("time", now)) > self.heartbeat_timeout:
                    newly_dead.append(m)
                    continue
                first = self._first_seen.setdefault(m, now)
                if now - first > max(30.0, 10 * self.heartbeat_timeout):
                    newly_dead.append(m)
                continue
            self.telemetry[m] = hb
            self.stragglers.observe(m, hb)
            known = self._incarnation.setdefault(m, hb["incarnation"]) if hb.get("incarnation") else None
            if known and hb["incarnation"] != known:
                # another process under the same id (a pod's supervisor restarted it): the
                # state the old one held is gone with it
                newly_dead.append(m)
                continue
            if hb.get("state") in ("exited", "finished"):
                continue
            # A member of a world whose peers report it broken (their collective failed: gloo and
            # NCCL see a dead peer at once) is dead once silent for half the timeout, not all of it.
            limit = self.heartbeat_timeout / 2 if corroborated and m in corroborated else self.heartbeat_timeout
            if now - hb["time"] > limit:
                newly_dead.append(m)
        self._readmit(now)
        if not newly_dead:
            self._note_broken(now)
            return
        for m in newly_dead:
            self._nodes.pop(m, None)
            incarnation = self._incarnation.pop(m, None) or (self.store.get_json(Keys.member(m)) or {}).get("incarnation")
            self._dead_incarnation[m] = incarnation
            self._broken_since.pop(m, None)
            # the process itself learns it from here (it may be only frozen): it rejoins as new
            self.store.set(Keys.dead(m), incarnation or "")
        self.dead.update(newly_dead)
        log.warning("members without heartbeat: %s", ", ".join(newly_dead))
        if self.pending is not None:
            return  # _collect_results aborts it; recovery follows
        if self.current and any(m in self.current.members for m in newly_dead):
            self._recover()

    def _peer_loss_reported(self) -> frozenset[str]:
        """The current world's members, when another of them reports that world broken (from the
        last heartbeats read): a failed collective, the first sign of a peer lost without notice."""
        current = self.current
        if current is None:
            return frozenset()
        reporting = [m for m in current.members if m not in self.dead
                     and (self.telemetry.get(m) or {}).get("state") == "broken"
                     and (self.telemetry.get(m) or {}).get("generation") == current.generation]
        return frozenset(m for m in current.members if m not in reporting) if reporting else frozenset()

    def _readmit(self, now: float) -> None:
        """A dead member's id heartbeating again as another incarnation is a new process (a
        replacement pod, or the old process that found itself excluded and dropped its state):
        it may join again. The same incarnation heartbeating is the old process, still holding
        stale state: it stays out until it rejoins."""
        # never while the id is still part of the world (or of a transition) it died in: the
        # plans about that world must go on treating it as gone
        busy = set(self.current.members) if self.current else set()
        if self.pending is not None:
            busy |= set(self.pending.plan.members)
            if self.current is not None:
                busy |= set(transition_members(self.current, self.pending.plan))
        for m in sorted(self.dead - busy):
            hb = self.store.get_json(Keys.heartbeat(m))
            if (hb and now - hb.get("time", 0) <= self.heartbeat_timeout and hb.get("incarnation")
                    and hb["incarnation"] != self._dead_incarnation.get(m)):
                self.dead.discard(m)
                self._nodes.pop(m, None)  # a new process: perhaps on another node
                self._dead_incarnation.pop(m, None)
                self._incarnation[m] = hb["incarnation"]
                self.telemetry[m] = hb
                log.warning("%s is back as a new member (incarnation %s)", m, hb["incarnation"])

    def _note_broken(self, now: float) -> None:
        """Recover a current world whose members report it broken while none of them is dead: a
        collective that failed without a death, or a generation aborted after its vote (the
        members hold the old state but its groups are gone). Called after a tick's death checks;
        ``MAX_BROKEN_RECOVERIES`` attempts in a row without a commit end the run."""
        current = self.current
        if current is None:
            return
        for m in current.members:
            hb = self.telemetry.get(m) or {}
            if hb.get("state") == "broken" and hb.get("generation") == current.generation:
                self._broken_since.setdefault(m, now)
            else:
                self._broken_since.pop(m, None)
        if not self._broken_since or self.pending is not None or any(m in self.dead for m in current.members):
            return
        member, since = min(self._broken_since.items(), key=lambda kv: kv[1])
        # a death is detected within heartbeat_timeout: give it that long to be the cause
        if now - since <= self.heartbeat_timeout:
            return
        self._broken_since.clear()
        self._broken_recoveries += 1
        if self._broken_recoveries > MAX_BROKEN_RECOVERIES:
            self._fail("RecoveryFailing", f"the world of generation {current.generation} stayed broken through "
                                          f"{MAX_BROKEN_RECOVERIES} recoveries in a row")
            return
        log.warning("the world of generation %d is broken (%s) with every member alive: recovering",
                    current.generation, member)
        self._recover(reason=f"world of generation {current.generation} broken without a death")

    def _consider_stragglers(self) -> None:
        """The straggler policy's plan, if a switch pays (``control.stragglers``)."""
        current = self.current
        if current is None or any(m in self.dead for m in current.members):
            return
        progress = self.progress() or {}
        if progress.get("step") is None:
            return
        inputs = self.source.planning()
        if inputs is not None and inputs.adaptive is not None and inputs.adaptive != self.stragglers.policy:
            self.stragglers.set_policy(inputs.adaptive)  # the job's spec was edited
        step = int(progress["step"])
        left = self.training.train_iters - step if self.training is not None else None
        alive = replace(current, standbys=tuple(m for m in current.standbys if m not in self.dead))
        request = self.stragglers.consider(alive, step, progress.get("step_seconds"),
                                           [h for h in self.history if h.get("generation") is not None], left)
        if request is None:
            return
        generation = self.next_generation
        self._start(PlanRequest(**request))
        if self.pending is not None and self.pending.plan.generation == generation:
            self.stragglers.taken(generation)
        else:
            self.stragglers.rejected()

    def _recover(self, reason: str | None = None) -> None:
        assert self.current is not None
        survivors = tuple(m for m in (*self.current.members, *self.current.standbys) if m not in self.dead)
        self._start(PlanRequest(members=survivors, reason=reason or f"lost {', '.join(sorted(self.dead))} without notice",
                                cause=Cause.LOST_WITHOUT_NOTICE))

    # ---- status ------------------------------------------------------------------------------
    def status(self) -> dict:
        return {
            "generation": self.current.generation if self.current else None,
            "config": self.current.config if self.current else None,
            "members": list(self.current.members) if self.current else [],
            "standbys": list(self.current.standbys) if self.current else [],
            "pending": self.pending.plan.generation if self.pending else None,
            "dead": sorted(self.dead),
            "history": self.history,
            "telemetry": self.telemetry,
            "health": self.stragglers.summary(self.current.members if self.current else ()),
            "progress": self.progress(),
            "finished": self.finished,
            "failure": self.failure,
            "checkpoints": self._checkpoints(),
        }

    def _checkpoints(self) -> dict:
        """What the workers reported about the job's checkpoints: the newest complete one, the
        last failed save, why the directory is unusable (each None when there is nothing)."""
        out = {}
        for name, key in (("latest", Keys.CHECKPOINT), ("failed", Keys.CHECKPOINT_FAILED),
                          ("unavailable", Keys.CHECKPOINT_UNAVAILABLE)):
            try:
                out[name] = self.store.get_json(key)
            except Exception:  # a value that is not JSON is reported as absent, never raised
                out[name] = None
        if out["latest"] is None and self._adopted_checkpoint is not None:
            out["latest"] = self._adopted_checkpoint
        return out

    def progress(self) -> dict | None:
        """Where training is, from the members' heartbeats: step, samples, last loss, tokens/s, ETA."""
        if self.current is None:
            return None
        beats = [self.telemetry[m] for m in self.current.members if m in self.telemetry]
        steps = [int(b["step"]) for b in beats if b.get("step") is not None]
        if not steps:
            return None
        step = max(steps)
        loss = next((b["loss"] for b in beats if b.get("step") == step and b.get("loss") is not None), None)
        seconds = sorted(float(b["step_seconds"]) for b in beats if b.get("step_seconds"))
        step_seconds = seconds[len(seconds) // 2] if seconds else None
        consumed = max((int(b["consumed_samples"]) for b in beats if b.get("consumed_samples") is not None),
                       default=None)
        out: dict = {"step": step, "loss": loss, "consumed_samples": consumed, "step_seconds": step_seconds,
                     "time": time.time()}
        t = self.training
        if t is not None:
            out["train_iters"] = t.train_iters
            if step_seconds:
                out["tokens_per_second"] = t.global_batch * t.seq_length / step_seconds
                out["eta"] = iso(time.time() + max(0, t.train_iters - step) * step_seconds)
        return out

    def _adopt_running_world(self) -> None:
        """After a restart (the store is new and empty), take over the world the workers run.

        Workers re-register with the plan they train under; the newest one is the current world,
        and it is published again so later plans can name it as their ``previous``.
        """
        best: WorldPlan | None = None
        for m in self.store.members():
            info = self.store.get_json(Keys.member(m)) or {}
            # never reuse a generation a worker has seen (it may have prepared that plan)
            self.next_generation = max(self.next_generation, int(info.get("latest_seen", -1)) + 1)
            ckpt = info.get("checkpoint")
            if ckpt and (self._adopted_checkpoint is None or ckpt["step"] > self._adopted_checkpoint["step"]):
                self._adopted_checkpoint = ckpt
            if info.get("plan"):
                plan = WorldPlan.from_json(info["plan"])
                if best is None or plan.generation > best.generation:
                    best = plan
        if best is None:
            return
        self.current = best
        self.next_generation = max(self.next_generation, best.generation + 1)
        self.store.publish_plan(best)
        self.store.set(Keys.outcome(best.generation), "committed")
        self.history.append({"generation": best.generation, "config": best.config, "world_size": len(best.members),
                             "reason": "adopted after a coordinator restart", "outcome": "committed",
                             "phases": {}, "seconds": 0.0})
        log.info("adopted running world of generation %d (%s)", best.generation, best.config)
        self._report()
        self._precompute_next()

    def _report(self) -> None:
        self._last_report = time.monotonic()
        status = self.status()
        if self.metrics is not None:
            self.metrics.observe_checkpoints(status["checkpoints"])
            self.metrics.observe_speeds(status["health"])
        self.source.report(status)
        self.store.set(Keys.COORDINATOR_STATUS, json.dumps(status, sort_keys=True, default=str))
