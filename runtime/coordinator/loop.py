"""The coordinator process's loop: read the store, step the core, carry out its actions.

All I/O of the coordinator is here: the store reads that make an ``Observation``, the writes an
action asks for, the plan source, metrics, the status report and the background precomputation.
Every decision is the core's (``coordinator.core``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from liveshard.runtime.contract.env import Defaults
from liveshard.runtime.contract.keys import COMMITTED, Keys
from liveshard.runtime.contract.training import TrainingSpec
from liveshard.runtime.control.metrics import JobMetrics
from liveshard.runtime.control.protocol import Heartbeat, MemberResult, WorldPlan
from liveshard.runtime.control.store import JobStore
from liveshard.runtime.control.stragglers import StragglerLoop
from liveshard.runtime.coordinator.core import CoordinatorCore
from liveshard.runtime.coordinator.events import (
    Action,
    CheckpointView,
    Decide,
    MarkDead,
    Observation,
    Precompute,
    Publish,
    Registration,
    Report,
    Stop,
    WriteOutcome,
    restore_choice,
)
from liveshard.runtime.coordinator.generations import Generation
from liveshard.runtime.coordinator.kept import KeptKeys
from liveshard.runtime.coordinator.membership import BeatRead
from liveshard.runtime.coordinator.requests import PlanningInputs, PlanRequest, PlanSource
from liveshard.runtime.coordinator.status import CoordinatorStatus, progress_with_eta
from liveshard.runtime.coordinator.world_choice import WorldChooser
from liveshard.runtime.planner.adapt import AdaptivePolicy, layer_caps_for
from liveshard.runtime.planner.precompute import PlanCache
from liveshard.runtime.spec import ModelSpec

log = logging.getLogger("liveshard.coordinator")



class _StoreCheckpoints(CheckpointView):
    def __init__(self, loop: Coordinator) -> None:
        self.loop = loop

    def latest(self) -> dict[str, Any] | None:
        return self.loop.latest_checkpoint()

    def on_volume(self) -> dict[str, Any] | None:
        if not self.loop.checkpoint_dir:
            return None
        from liveshard.runtime.agent.checkpoint import newest_complete
        from liveshard.runtime.contract.checkpoint import JobIdentity

        return newest_complete(self.loop.checkpoint_dir, JobIdentity.from_env())  # its own run only


class Coordinator:
    """Hosts nothing itself (the command serves the store); ticks the core over ``store``."""

    def __init__(self, store: JobStore, spec: ModelSpec | None, source: PlanSource, planning: PlanningInputs, *,
                 heartbeat_timeout: float = Defaults.HEARTBEAT_TIMEOUT,
                 transition_timeout: float = Defaults.TRANSITION_TIMEOUT,
                 training: TrainingSpec | None = None, metrics: JobMetrics | None = None,
                 checkpoint_dir: str | None = None, stragglers: StragglerLoop | None = None,
                 precompute: bool = True, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, chooser: WorldChooser | None = None,
                 checkpoints: CheckpointView | None = None) -> None:
        """``clock`` (monotonic seconds, every judgement of time), ``wall`` (epoch seconds, for
        what is reported), ``chooser`` (the planner; by default ``WorldChooser(spec)``) and
        ``checkpoints`` (by default the store's record and ``checkpoint_dir``) are the seams a
        simulator swaps; ``spec`` None: no straggler loop (a simulator's modelled world)."""
        self.store = store
        self.spec = spec
        self.source = source
        self.training = training  # the job's training spec: progress, ETA
        self.metrics = metrics  # Prometheus gauges of the job (None: not exported)
        self.checkpoint_dir = checkpoint_dir  # the job's checkpoints (the first world continues the newest)
        self.clock = clock
        self.wall = wall
        if stragglers is None and spec is not None:
            stragglers = self._straggler_loop(planning)
        if chooser is None:
            assert spec is not None, "a Coordinator without a chooser plans from the model's spec"
            chooser = WorldChooser(spec)
        self.core = CoordinatorCore(chooser, planning, heartbeat_timeout=heartbeat_timeout,
                                    transition_timeout=transition_timeout,
                                    checkpoints=checkpoints or _StoreCheckpoints(self),
                                    stragglers=stragglers, precompute=precompute)
        self.core.train_iters = training.train_iters if training else None
        self.precomputed: dict[str, Any] | None = None  # the last precomputation: generation, events, seconds
        self.report_interval = 2.0
        self._last_report = float("-inf")
        self._observed_history = 0
        self.kept = KeptKeys(store)  # what it wrote that must stay written (``kept``)

    def _straggler_loop(self, planning: PlanningInputs) -> StragglerLoop:
        assert self.spec is not None
        c, t = planning.constraints, self.training
        return StragglerLoop(self.spec, planning.adaptive or AdaptivePolicy(),
                             global_batch=t.global_batch if t else c.global_batch,
                             micro_batch=t.micro_batch if t else c.micro_batch,
                             seq_length=t.seq_length if t else (c.seq_length or self.spec.max_sequence_length),
                             granularity=c.granularity,
                             layer_caps=layer_caps_for(self.spec, c, planning.gpu_memory_bytes),
                             allowed_pp=c.pp, max_world=c.max_gpus)

    # ---- the core's state, for callers and tests ----------------------------------------------
    @property
    def current(self) -> WorldPlan | None:
        return self.core.current

    @property
    def pending(self) -> Generation | None:
        return self.core.pending

    @property
    def dead(self) -> set[str]:
        return self.core.dead

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.core.history

    @property
    def failure(self) -> dict[str, Any] | None:
        return self.core.failure

    @property
    def finished(self) -> dict[str, Any] | None:
        return self.core.finished

    @property
    def telemetry(self) -> dict[str, dict[str, Any]]:
        return self.core.telemetry

    @property
    def plans(self) -> PlanCache:
        return self.core.chooser.plans

    @property
    def stragglers(self) -> StragglerLoop | None:
        loop: StragglerLoop | None = self.core.stragglers
        return loop

    @property
    def heartbeat_timeout(self) -> float:
        return self.core.heartbeat_timeout

    # ---- main loop ---------------------------------------------------------------------------
    def run(self, stop_after: float | None = None, period: float = 0.02, idle_period: float = 0.2) -> None:
        """Tick until stopped: every ``period`` seconds while a generation is being switched to,
        every ``idle_period`` otherwise (each tick reads every watched member's heartbeat;
        between reconfigurations that is all there is to do, and the workers need the CPU)."""
        end = None if stop_after is None else time.monotonic() + stop_after
        last: float | None = None
        while end is None or time.monotonic() < end:
            if self.store.has(Keys.STOP) and self.pending is None:
                self._drain()
                self._report()
                return
            paused = self.paused_since(last)
            last = self.clock()
            self.tick(paused)
            time.sleep(period if self.pending is not None else idle_period)

    def _drain(self, timeout: float = 60.0) -> None:
        """After a stop, keep the store up until the workers have seen it and exited: they read
        the stop key from it (a restarted coordinator would have a store without it). Every
        registered worker counts, not only the world's members and standbys: a replacement or a
        joiner still waiting for its first plan must read the stop too."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            current = self.current
            named = (*current.members, *current.standbys) if current else ()
            try:
                registered = tuple(self.store.members())
            except Exception:  # the store is this process's own: only a bug gets here
                registered = ()
            live = [m for m in dict.fromkeys((*named, *registered)) if m not in self.dead]
            reads = {m: self._beat_read(m) for m in live}
            # the one liveness judge decides who is gone (on this process's clock, never the sender's)
            self.core.liveness.judge(self.clock(), live, reads)
            if all(m in self.dead or (r.beat is not None and r.beat.ended) for m, r in reads.items()):
                return
            time.sleep(0.1)

    def paused_since(self, last_tick: float | None) -> float:
        """How long this process was stopped since ``last_tick`` (its clock's time of the tick
        before): a gap past half the heartbeat timeout, where the loop ticks many times a second,
        is a stop (SIGSTOP, a VM pause, a long GC) of this process and of the store it serves,
        in which no beat could land; 0 otherwise."""
        gap = self.clock() - last_tick if last_tick is not None else 0.0
        return gap if gap > self.heartbeat_timeout / 2 else 0.0

    def tick(self, paused: float = 0.0) -> None:
        """One look and its actions; ``paused``: seconds this process was stopped before it
        (``paused_since``), which the liveness judge and the pending generation do not count."""
        core = self.core
        if core.failure is not None:
            return
        now = self.clock()
        self.kept.restore(core.dead, now)
        summarize = getattr(self.store, "log_tampering", None)
        if summarize is not None:
            summarize()  # the tampering summary, when one is due
        observation = self._observe(now)
        if paused > 0:
            log.warning("this coordinator did not run for %.1f s: that time counts against no member", paused)
            observation = replace(observation, paused=paused)
        actions = core.step(observation)
        self._apply(actions, now)
        if self.metrics is not None and self.current is not None and self.current.members:
            t = self.training
            self.metrics.observe_heartbeats(self.telemetry, self.current.members, generation=self.current.generation,
                                            train_iters=t.train_iters if t else None,
                                            tokens_per_step=t.global_batch * t.seq_length if t else None)
        if now - self._last_report > self.report_interval:
            self._report()

    # ---- reads -------------------------------------------------------------------------------
    def _read(self, key: str) -> tuple[object, bool]:
        """(the decoded valid value or None, whether the key showed tampering this read)."""
        read = getattr(self.store, "read", None)
        if read is None:  # a store without tamper reports: a bad value reads as absent
            text = self.store.get(key)
            return (None if text is None else _json(text)), False
        r = read(key)
        return (None if r.value is None else _json(r.value)), r.tampered

    def _observe(self, now: float) -> Observation:
        core, store = self.core, self.store
        beats: dict[str, BeatRead] = {}
        telemetry: dict[str, dict[str, Any]] = {}
        for m in sorted(core.watched()):
            beats[m] = self._beat_read(m, telemetry)
        results: dict[str, MemberResult] = {}
        decision: str | None = None
        arrived = 0
        ready: frozenset[str] = frozenset()
        gen = core.pending
        if gen is not None:
            g = gen.plan.generation
            for m in core.involved_alive():
                if m not in gen.results:
                    text = store.get(Keys.result(g, m))
                    if text is not None:
                        try:
                            results[m] = MemberResult.from_json(text)
                        except (TypeError, ValueError):
                            log.error("result of %s for generation %d is malformed: ignored", m, g)
            if self.current is not None and gen.plan.is_live_transition:
                decision = store.get(Keys.decision(g))
                arrived = sum(store.get(Keys.arrived(g, m)) == "1" for m in gen.plan.members)
                if decision is None:
                    ready = frozenset(m for m in gen.plan.members if store.get(Keys.ready(g, m)) == "1")
        request: PlanRequest | None = None
        inputs = None
        if core.wants_request:
            request = self.source.poll()
        if core.accepting:
            inputs = self.source.planning()
        registrations = None
        if core.wants_registrations or request is not None:
            named = (*(request.members if request else ()), *core.deferred_members())
            registrations = self._registrations(named)
        finished = None
        if core.finished is None:
            # read while a generation is pending too: a final save that gave up ends the job at
            # once (its workers exit right after saying so, and no generation can complete)
            finished = store.get_json(Keys.FINISHED)
        return Observation(now=now, wall=self.wall(), beats=beats, telemetry=telemetry, results=results,
                           decision=decision, arrived=arrived, ready=ready, request=request,
                           registrations=registrations,
                           finished=finished, inputs=inputs)

    def _beat_read(self, m: str, telemetry: dict[str, dict[str, Any]] | None = None) -> BeatRead:
        """What the store holds of ``m``'s liveness: its last valid heartbeat (and whether the
        key was tampered with), else its registration."""
        data, tampered = self._read(Keys.heartbeat(m))
        beat = Heartbeat.parse(data)
        registered, incarnation = False, None
        if beat is None:
            info = self.store.get_json(Keys.member(m))
            registered = isinstance(info, dict)
            incarnation = info.get("incarnation") if registered else None
        elif telemetry is not None and isinstance(data, dict):
            telemetry[m] = data
        return BeatRead(beat=beat, tampered=tampered, registered=registered, registered_incarnation=incarnation)

    def _registrations(self, named: Iterable[str] = ()) -> dict[str, Registration]:
        """Every registered worker's announcement (the registration order, and the workers a
        request names, looked up directly)."""
        out = {}
        for m in dict.fromkeys((*self.store.members(), *named)):
            reg = Registration.parse(m, self.store.get_json(Keys.member(m)))
            if reg is not None:
                out[m] = reg
        return out

    # ---- writes ------------------------------------------------------------------------------
    def _apply(self, actions: Iterable[Action], now: float) -> None:
        report = False
        queue = list(actions)
        while queue:
            a = queue.pop(0)
            if isinstance(a, Publish):
                self.store.publish_plan(a.plan)
                self.kept.written(Keys.plan(a.plan.generation), a.plan.to_json())
                self.kept.written(Keys.LATEST, str(a.plan.generation))
            elif isinstance(a, Decide):
                stands = self.store.decide(Keys.decision(a.generation), a.value)
                self.kept.written(Keys.decision(a.generation), stands)
                queue[:0] = self.core.decided(a.generation, stands, now)
            elif isinstance(a, WriteOutcome):
                self.store.set(Keys.outcome(a.generation), a.outcome)
                self.kept.written(Keys.outcome(a.generation), a.outcome)
                if a.outcome == COMMITTED:
                    self.kept.write(Keys.CURRENT, str(a.generation))
            elif isinstance(a, MarkDead):
                # the process itself learns it from here (it may be only frozen): it rejoins as new
                self.kept.write(Keys.dead(a.member), a.incarnation or "")
            elif isinstance(a, Stop):
                self.kept.write(Keys.STOP, "1")
            elif isinstance(a, Report):
                report = True
            elif isinstance(a, Precompute):
                self._precompute(a)
        if self.metrics is not None:
            for entry in self.history[self._observed_history:]:
                if entry.get("generation") is not None and entry.get("phases") is not None:
                    self.metrics.observe_generation(entry["outcome"], entry["phases"])
        self._observed_history = len(self.history)
        if report:
            self._report()

    def _precompute(self, a: Precompute) -> None:
        """Ask the likeliest next events' plans in a background thread; the inputs that need the
        store or the plan source are read here, in the coordinator's thread."""
        everyone = set(a.current.members) | set(a.current.standbys)
        waiting = tuple(m for m in self.store.members() if m not in everyone and m not in a.dead)
        nodes = {m: self._node_of(m) for m in (*a.current.members, *a.current.standbys, *waiting)}
        memory = dict(self.core.memory)
        inputs = self.source.planning() or self.core.planning
        core = self.core

        def moved_on() -> bool:
            try:
                seen = frozenset(core.dead)
            except RuntimeError:  # the set is changing in the coordinator's thread right now
                return True
            return core.current is not a.current or core.pending is not None or seen != a.dead

        def work() -> None:
            self.precomputed = core.chooser.precompute(a.current, a.dead, inputs, nodes, waiting, moved_on, memory)

        threading.Thread(target=work, name="precompute-plans", daemon=True).start()

    def _node_of(self, worker: str) -> str:
        node = self.core.nodes.get(worker)
        if node is None:
            reg = Registration.parse(worker, self.store.get_json(Keys.member(worker)))
            node = reg.node if reg is not None else worker
            if reg is not None:
                self.core.nodes[worker] = node  # fixed for the process; forgotten when it dies
                if reg.gpu_memory_bytes is not None:
                    self.core.memory.setdefault(worker, reg.gpu_memory_bytes)
        return node

    # ---- status ------------------------------------------------------------------------------
    def progress(self) -> dict[str, Any] | None:
        return progress_with_eta(self.core.progress(), self.training)

    def status(self) -> dict[str, Any]:
        core, current = self.core, self.core.current
        counts = getattr(self.store, "tampering_counts", None)
        tampering = counts() if counts is not None else None
        return CoordinatorStatus(
            generation=current.generation if current else None,
            config=current.config if current else None,
            members=list(current.members) if current else [],
            standbys=list(current.standbys) if current else [],
            pending=core.pending.plan.generation if core.pending else None,
            dead=sorted(core.dead),
            history=core.history,
            telemetry=core.telemetry,
            health=core.stragglers.summary(current.members if current else ()) if core.stragglers else {},
            progress=self.progress(),
            finished=core.finished,
            failure=core.failure,
            checkpoints=self._checkpoints(),
            contested=list(core.liveness.contested()),
            waiting=core.waiting,
            tampering={str(k): int(v) for k, v in dict(tampering).items()} if tampering else {},
        ).to_dict()

    def _checkpoints(self) -> dict[str, Any]:
        """What the workers reported about the job's checkpoints: the newest complete one, the
        last failed save, why the directory is unusable (each None when there is nothing)."""
        out = {}
        for name, key in (("latest", Keys.CHECKPOINT), ("failed", Keys.CHECKPOINT_FAILED),
                          ("unavailable", Keys.CHECKPOINT_UNAVAILABLE)):
            try:
                out[name] = self.store.get_json(key)
            except Exception:  # a value that is not JSON is reported as absent, never raised
                out[name] = None
        if out["latest"] is None and self.core.adopted_checkpoint is not None:
            out["latest"] = self.core.adopted_checkpoint
        return out

    def latest_checkpoint(self) -> dict[str, Any] | None:
        """The newest complete checkpoint the workers reported (rank 0 writes it after a save);
        where this coordinator sees the job's volume, the newest of the job's checkpoints there
        that verifies: one named by the pointer that fails verification gives way to it, and so
        does an older one (a validly sealed pointer replayed to a reader that had not read the
        newer one: a replay must not roll the job back)."""
        try:
            info = self.store.get_json(Keys.CHECKPOINT) or self.core.adopted_checkpoint
        except ValueError:
            info = self.core.adopted_checkpoint
        if not self.checkpoint_dir or not os.path.isdir(self.checkpoint_dir):
            return info
        from liveshard.runtime.agent.checkpoint import newest_complete, verify
        from liveshard.runtime.contract.checkpoint import JobIdentity

        problem = verify(info["path"]) if info and os.path.isdir(str(info.get("path"))) else None
        choice, warning = restore_choice(info, problem, newest_complete(self.checkpoint_dir, JobIdentity.from_env()))
        if warning is not None:
            log.warning("%s", warning)
        return choice

    def _report(self) -> None:
        self._last_report = self.clock()
        status = self.status()
        if self.metrics is not None:
            self.metrics.observe_checkpoints(status["checkpoints"])
            self.metrics.observe_speeds(status["health"])
            counts = getattr(self.store, "tampering_counts", None)
            if counts is not None:
                self.metrics.observe_store_tampering(counts())
        try:
            self.source.report(status)
        except Exception:  # a plan source's I/O never takes the coordinator down
            log.exception("reporting the status to the plan source failed")
        self.store.set(Keys.COORDINATOR_STATUS, json.dumps(status, sort_keys=True, default=str))


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return text
