"""The simulated job: the real coordinator core and commit points, modelled workers, a store, a
plan source, a clock — and the faults.

Time is a number advanced by an event queue, so one schedule of a minute of a job's life runs in
milliseconds. What runs for real: ``coordinator.core.CoordinatorCore`` (with its liveness judge
and generation judgement) and each worker's ``agent.commit_point.CommitPoint``. What is modelled:
the workers' training loop and switch (prepare, a step boundary, a transfer, the vote), the store
(``sim.store``) and the planner (a world is its members in order; a "tp" world holds each of two
shards on every other member, a "dp" world a full copy on each).
"""

from __future__ import annotations

import contextlib
import heapq
import random
from dataclasses import dataclass

from liveshard.dev.sim.faults import Faults
from liveshard.dev.sim.store import Reader, SimStore, StoreDown
from liveshard.runtime.agent.commit_point import CommitPoint, Failed, WriteAbort, WriteReady
from liveshard.runtime.contract.keys import COMMITTED, Keys
from liveshard.runtime.control.protocol import Heartbeat, MemberResult, WorldPlan, transition_members
from liveshard.runtime.coordinator.core import CoordinatorCore
from liveshard.runtime.coordinator.events import (
    CheckpointView,
    Decide,
    MarkDead,
    Observation,
    Publish,
    Registration,
    Stop,
    WriteOutcome,
)
from liveshard.runtime.coordinator.membership import LOST_PROCESS, BeatRead
from liveshard.runtime.coordinator.requests import PlanningInputs, PlanRequest
from liveshard.runtime.coordinator.world_choice import WorldChooser
from liveshard.runtime.planner import Constraints
from liveshard.runtime.planner.precompute import PlanCache

HB_INTERVAL = 1.0
POLL = 0.5
HB_TIMEOUT = 4.0
COORD_TICK = 0.5  # while a generation is pending; twice that otherwise (as the real loop idles)
STEP_TIME = 1.0
TRANSITION_TIMEOUT = 20.0
COMMIT_TIMEOUT = 10.0  # a member waiting for the decision in a live store, then it aborts
COMMIT_BOUND = 30.0  # a member waiting for a restarted coordinator to resolve its generation
COLLECTIVE_TIMEOUT = 20.0  # a collective blocked on a frozen peer gives up
CHECKPOINT_EVERY = 4

FAULTS = ("kill", "restart", "coordinator", "forge", "replay", "delete", "slow", "freeze", "clock", "counter",
          "damage", "lose-write")


# ---- the planner, modelled ---------------------------------------------------------------------
@dataclass(frozen=True)
class _Gpu:
    id: str
    node: str = "sim"


@dataclass(frozen=True)
class _World:
    config: str
    gpus: tuple[_Gpu, ...]
    standby: tuple[_Gpu, ...] = ()
    standby_reason: str = ""


def shards(config: str) -> int:
    return 2 if config.startswith("tp") else 1


class SimChooser(WorldChooser):
    def __init__(self) -> None:
        super().__init__(spec=None, plans=PlanCache())  # type: ignore[arg-type]

    def choose(self, request, members, *, current, dead, inputs, node_of, memory_of=None, count=True):
        config = request.config or (current.config if current and current.config else "dp")
        if request.config is None and shards(config) > len(members):
            config = "dp"  # the planner picks a layout that fits
        if shards(config) > len(members):
            from liveshard.runtime.errors import ConfigError

            raise ConfigError("config", f"{config} needs {shards(config)} workers, {len(members)} given", "")
        return _World(config, tuple(_Gpu(m) for m in members))

    def no_live_copy(self, plan: WorldPlan, current: WorldPlan, count: bool = True) -> str | None:
        if current.is_stop:
            return "stopped"
        dead = set(plan.dead)
        k = shards(current.config)
        for s in range(k):
            if all(m in dead for i, m in enumerate(current.members) if i % k == s):
                return f"shard {s} of generation {current.generation} is held only by dead members"
        return None


# ---- one modelled worker ------------------------------------------------------------------------
@dataclass
class Worker:
    id: str
    incarnation: int = 0
    alive: bool = True
    frozen_until: float = 0.0  # SIGSTOP or a GIL-bound stall: no beats, no steps, no polls
    phase: str = "waiting"
    world: WorldPlan | None = None  # the committed world it belongs to
    state_step: int | None = None  # the step its training state is at (None: holds none)
    target: WorldPlan | None = None  # the plan being switched to
    prep_done: float = 0.0
    torn_down: bool = False  # the old world's groups are gone (a member past the vote)
    cp: CommitPoint | None = None
    reader: Reader | None = None
    handled: int = -1
    latest_seen: int = -1
    seq: int = 0
    clock_skew: float = 0.0
    last_valid_beat: float = -1e9  # sim time of its last beat written to a live store
    broken_at: float | None = None  # when its world's collective will fail
    switch_step: int | None = None  # the step the state it transfers is at
    next_beat: float = 0.0
    exit_reason: str | None = None

    @property
    def inc(self) -> str:
        return f"{self.id}.{self.incarnation}"


@dataclass
class WorldTrack:
    start: int | None = None
    step: int = 0
    running: bool = False


@dataclass
class SimResult:
    seed: int
    ok: bool
    violations: list[str]
    trace: list[str]
    faults: dict[str, int]
    outcome: str
    steps: int


class SimCheckpoints(CheckpointView):
    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def latest(self) -> dict | None:
        good = [c for c in self.sim.checkpoints if c["verified"]]
        return good[-1] if good else None

    def on_volume(self) -> dict | None:
        return self.latest()  # the volume holds every checkpoint (none before the first world)


class SimSource:
    """The plan source: scheduled requests, and a join for each worker waiting outside the world."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.queue: list[PlanRequest] = []
        self.asked_join: set[str] = set()

    def poll(self) -> PlanRequest | None:
        if self.queue:
            return self.queue.pop(0)
        core = self.sim.core
        if core is None or core.current is None:
            return None
        world = set(core.current.members) | set(core.current.standbys)
        waiting = [w for w in self.sim.workers.values()
                   if w.alive and w.phase == "waiting" and w.id not in world and w.inc not in self.asked_join
                   and w.id not in core.dead]
        if waiting:
            self.asked_join.update(w.inc for w in waiting)
            members = (*core.current.members, *core.current.standbys, *(w.id for w in waiting))
            return PlanRequest(members=members, reason="workers waiting")
        return None


class Simulation(Faults):
    def __init__(self, seed: int, faults: frozenset[str] = frozenset(FAULTS), workers: int | None = None,
                 duration: float = 20.0) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.faults = faults
        self.now = 0.0
        self.duration = duration  # faults happen before this; then the job must settle
        self.settle = TRANSITION_TIMEOUT + COMMIT_BOUND + 4 * HB_TIMEOUT
        n = workers or self.rng.randint(2, 5)
        self.workers = {f"w{i}": Worker(f"w{i}") for i in range(n)}
        self.epoch = 0
        self.store = SimStore(0)
        self.core: CoordinatorCore | None = None
        self.creader: Reader | None = None
        self.source = SimSource(self)
        self.checkpoints: list[dict] = []
        self.tracks: dict[int, WorldTrack] = {}
        # generation -> {process: the decision it acted on}; a process declared dead is cut off,
        # and what it did no longer counts
        self.acted: dict[int, dict[str, str]] = {}
        self.violations: list[str] = []
        self.trace: list[str] = []
        self.fault_count: dict[str, int] = {}
        self.failure: dict | None = None  # the job ended Failed (kept by the plan source)
        self.published: dict[int, WorldPlan] = {}
        self.seen_plans: dict[int, WorldPlan] = {}  # what some worker read under each generation
        self.forged_beats: set[str] = set()  # heartbeat keys overwritten by an attacker all along
        self._queue: list[tuple[float, int, str, str]] = []
        self._n = 0
        self.faults_left = 0  # fault events still queued
        self.last_fault = 0.0
        self.step_at_last_fault = 0
        self._start_coordinator()
        config = "tp" if n >= 2 and self.rng.random() < 0.4 else "dp"
        self.source.queue.append(PlanRequest(members=tuple(self.workers), config=config, reason="start"))
        for w in self.workers.values():
            self.at(self.rng.uniform(0.0, 1.0), "wake", w.id)
        self.at(COORD_TICK, "coord", "")
        self.at(STEP_TIME, "steps", "")
        self._plan_faults()

    # ---- the event queue ----------------------------------------------------------------------
    def at(self, t: float, kind: str, target: str) -> None:
        self._n += 1
        if kind == "fault":
            self.faults_left += 1
        heapq.heappush(self._queue, (t, self._n, kind, target))

    def log(self, text: str) -> None:
        self.trace.append(f"{self.now:7.2f} {text}")

    def violate(self, text: str) -> None:
        self.violations.append(f"t={self.now:.2f}: {text}")
        self.log(f"VIOLATION {text}")

    def run(self) -> SimResult:
        while self._queue and not self.violations:
            t, _, kind, target = heapq.heappop(self._queue)
            if t > self.last_fault + self.settle and not self.faults_left:
                break  # the bound: _check_settled says whether the job got there
            self.now = t
            if kind == "wake":
                self._wake(self.workers[target])
            elif kind == "coord":
                self._coord_tick()
            elif kind == "steps":
                self._steps()
            elif kind == "fault":
                self.faults_left -= 1
                self.last_fault = self.now
                self.step_at_last_fault = max((t.step for t in self.tracks.values()), default=0)
                self._fault(target)
            elif kind == "coord-up":
                self._start_coordinator()
        if not self.violations:
            self._check_settled()
        steps = max((t.step for t in self.tracks.values()), default=0)
        outcome = self._outcome()
        return SimResult(self.seed, not self.violations, self.violations, self.trace, dict(self.fault_count), outcome,
                         steps)

    # ---- the coordinator ----------------------------------------------------------------------
    def _start_coordinator(self) -> None:
        if self.core is not None or self.failure is not None:
            return
        if self.creader is not None:  # a restart: a new, empty store
            self.epoch += 1
            self.store = SimStore(self.epoch)
            self.log(f"coordinator up, store epoch {self.epoch}")
        planning = PlanningInputs(Constraints(global_batch=8, micro_batch=1))
        self.core = CoordinatorCore(SimChooser(), planning, heartbeat_timeout=HB_TIMEOUT,
                                    transition_timeout=TRANSITION_TIMEOUT, checkpoints=SimCheckpoints(self),
                                    precompute=False)
        self.creader = Reader(self.store)

    def _coord_tick(self) -> None:
        core = self.core
        self.at(self.now + (COORD_TICK if core is not None and core.pending is not None else 2 * COORD_TICK),
                "coord", "")
        if core is None or not self.store.up:
            return
        r, store = self.creader, self.store
        beats, telemetry = {}, {}
        for m in sorted(core.watched()):
            key = Keys.heartbeat(m)
            if m in self.forged_beats and self.rng.random() < 0.7:
                store.forge(key)
            text, tampered = r.read(key)
            data = text
            beat = Heartbeat.parse(data)
            registered, inc = False, None
            if beat is None:
                info, _ = r.read(Keys.member(m))
                if info:
                    registered, inc = True, info.get("incarnation")
            else:
                telemetry[m] = data
            beats[m] = BeatRead(beat, tampered, registered, inc)
        results, decision, arrived, ready = {}, None, 0, frozenset()
        if core.pending is not None:
            g = core.pending.plan.generation
            for m in core.involved_alive():
                text = r.get(Keys.result(g, m))
                if text is not None:
                    results[m] = text
            if core.current is not None and core.pending.plan.is_live_transition:
                decision = r.get(Keys.decision(g))
                arrived = sum(r.get(Keys.arrived(g, m)) == "1" for m in core.pending.plan.members)
                if decision is None:
                    ready = frozenset(m for m in core.pending.plan.members if r.get(Keys.ready(g, m)) == "1")
        request = self.source.poll() if core.wants_request else None
        regs = None
        if core.wants_registrations or request is not None:
            regs = {}
            named = (*(request.members if request else ()), *core.deferred_members())
            for m in dict.fromkeys((*self.workers, *named)):
                text = r.get(Keys.member(m))
                if text is not None:
                    reg = Registration.parse(m, text)
                    if reg is not None:
                        regs[m] = reg
        obs = Observation(now=self.now, wall=self.now, beats=beats, telemetry=telemetry, results=results,
                          decision=decision, arrived=arrived, ready=ready, request=request, registrations=regs)
        queue = list(core.step(obs))
        while queue:
            a = queue.pop(0)
            if isinstance(a, Publish):
                known = self.seen_plans.get(a.plan.generation)
                if known is not None and (known.members, known.config, known.previous) != \
                        (a.plan.members, a.plan.config, a.plan.previous):
                    self.violate(f"generation {a.plan.generation}, which a worker saw, reused for another plan")
                store.set(Keys.plan(a.plan.generation), a.plan)
                self.published[a.plan.generation] = a.plan
                store.set(Keys.LATEST, a.plan.generation)
                self.log(f"publish {a.plan.generation} {a.plan.config} {a.plan.members} prev={a.plan.previous} "
                         f"restore={a.plan.restore_from} ({a.plan.reason})")
                if a.plan.restore_from is not None and a.plan.generation not in self.published:
                    ck = next((c for c in self.checkpoints if c["path"] == a.plan.restore_from), None)
                    if ck is None or not ck["verified"]:
                        self.violate(f"plan {a.plan.generation} restores unverified checkpoint {a.plan.restore_from}")
            elif isinstance(a, Decide):
                stands = store.decide(Keys.decision(a.generation), a.value)
                queue[:0] = core.decided(a.generation, stands, self.now)
            elif isinstance(a, WriteOutcome):
                store.set(Keys.outcome(a.generation), a.outcome)
                if a.outcome == COMMITTED:
                    store.set(Keys.CURRENT, a.generation)
                self.log(f"outcome {a.generation}: {a.outcome}")
            elif isinstance(a, MarkDead):
                self._check_death(a.member, a.incarnation)
                store.set(Keys.dead(a.member), a.incarnation or "")
            elif isinstance(a, Stop):
                store.set(Keys.STOP, "1")
                self.failure = core.failure  # the operator records it in the job: terminal
                self.log(f"stop: {core.failure}")

    def _check_death(self, member: str, incarnation: str | None) -> None:
        w = self.workers[member]
        for acts in self.acted.values():
            for inc in [i for i in acts if i == incarnation or (incarnation == LOST_PROCESS and i.split(".")[0] == member)]:
                del acts[inc]
        self.log(f"declared dead: {member} ({incarnation})")
        cur = self.core.current if self.core else None
        stale = (w.world is not None and cur is not None and w.world.generation < cur.generation
                 and member not in cur.members)
        holder = incarnation == LOST_PROCESS and w.world is not None and cur is not None \
            and w.world.generation == cur.generation and w.state_step is not None
        if w.alive and not stale and (w.inc == incarnation or holder) and self.now - w.last_valid_beat < HB_TIMEOUT / 2 \
                and w.reader is not None and w.reader.store is self.store:
            self.violate(f"{member} declared dead while heartbeating validly (last beat "
                         f"{self.now - w.last_valid_beat:.2f} s ago)")

    # ---- workers ------------------------------------------------------------------------------
    def _wake(self, w: Worker) -> None:
        if not w.alive:
            return
        self.at(self.now + POLL * self.rng.uniform(0.8, 1.2), "wake", w.id)
        if self.now < w.frozen_until:
            return
        if not self._connected(w):
            self._commit_step(w)  # a member waiting in its commit window keeps counting
            return
        try:
            if self.now >= w.next_beat:
                w.next_beat = self.now + HB_INTERVAL
                self._beat(w)
            self._poll(w)
        except StoreDown:
            if w.cp is not None:
                w.cp.store_lost(self.now)
            self._commit_step(w)

    def _connected(self, w: Worker) -> bool:
        """Whether ``w`` talks to a live store; connects to a restarted coordinator's (and
        announces itself there) when the one it knew is gone."""
        if w.reader is not None and w.reader.store is self.store and self.store.up:
            return True
        if w.reader is not None and w.reader.store.up:
            return True
        if not self.store.up or self.core is None:
            if w.cp is not None:
                w.cp.store_lost(self.now)
            return False
        w.reader = Reader(self.store)
        if w.cp is not None:
            w.cp.reconnected()
        self._register(w)
        if w.target is not None and w.cp is None:
            # plans of the old store that never took effect are gone with it (reported above as
            # ``pending_plan``: the new coordinator asks for them again)
            w.target = None
            if w.phase == "preparing":
                w.phase = "training" if w.state_step is not None else "waiting"
        return True

    def _register(self, w: Worker) -> None:
        info: dict = {"node": w.id, "incarnation": w.inc, "latest_seen": w.latest_seen}
        if w.world is not None and w.state_step is not None:
            info["plan"] = w.world
        if w.cp is not None:  # in its commit window, or decided and not switched yet (as a real worker)
            info["open"] = w.cp.report().to_dict()
        elif w.target is not None and w.phase in ("preparing", "transfer"):
            info["pending_plan"] = w.target
        store = w.reader.store
        store.set(Keys.member(w.id), info)
        i = store.add(Keys.MEMBER_COUNT, 1) - 1
        store.set(Keys.member_index(i), w.id)
        w.handled = -1
        self.log(f"{w.inc} registers in epoch {store.epoch} ({w.phase})")

    def _beat(self, w: Worker) -> None:
        w.seq += 1
        beat = {"time": self.now + w.clock_skew, "seq": w.seq, "state": self._state(w), "incarnation": w.inc,
                "generation": w.world.generation if w.world else None, "step": w.state_step,
                "preparing": w.target.generation if w.target is not None and w.phase in ("preparing", "transfer") else None}
        w.reader.store.set(Keys.heartbeat(w.id), beat)
        if w.reader.store.up:
            w.last_valid_beat = self.now

    @staticmethod
    def _state(w: Worker) -> str:
        return {"preparing": "training", "transfer": "committing", "commit": "committing"}.get(w.phase, w.phase)

    def _poll(self, w: Worker) -> None:
        r = w.reader
        if r.get(Keys.STOP) is not None:
            self._exit(w, "stopped by the job")
            return
        if r.get(Keys.dead(w.id)) == w.inc and w.phase not in ("left", "exited"):
            self.log(f"{w.inc} finds itself declared dead: rejoins as a new process")
            self._rejoin(w)
            return
        current = r.get(Keys.CURRENT)
        if w.world is not None and w.cp is None and current is not None and current > w.world.generation:
            plan = r.get(Keys.plan(current))
            if plan is not None and (w.id in plan.dead or w.id not in (*plan.members, *plan.standbys)):
                self.log(f"{w.inc}: generation {current} went on without it: rejoins as a new process")
                self._rejoin(w)
                return
        if w.phase == "commit":
            self._commit_step(w)
            return
        if w.target is not None and w.cp is None:
            outcome = r.get(Keys.outcome(w.target.generation))
            if outcome is not None:  # decided without this process's switch: dropped
                self.log(f"{w.inc} drops its preparation of {w.target.generation} ({outcome})")
                w.target = None
                if w.phase == "preparing":
                    w.phase = "training" if w.state_step is not None else "waiting"
        latest = r.get(Keys.LATEST)
        latest = -1 if latest is None else latest
        w.latest_seen = max(w.latest_seen, latest)
        if latest <= w.handled:
            return
        if w.target is not None and w.cp is None and latest > w.target.generation:
            self.log(f"{w.inc} drops its preparation of {w.target.generation}: plan {latest} is newer")
            w.target = None  # a newer plan supersedes it (it never switched)
            if w.phase == "preparing":
                w.phase = "training" if w.state_step is not None else "waiting"
        ptext = r.get(Keys.plan(latest))
        if ptext is None:
            return
        if r.get(Keys.outcome(latest)) is not None and w.cp is None:
            w.handled = latest  # decided already: nothing to prepare
            return
        plan = ptext
        self.seen_plans.setdefault(plan.generation, plan)
        w.handled = latest
        if w.world is not None and plan.generation <= w.world.generation:
            return
        if plan.previous is None or plan.restore_from is not None:
            self._start_world(w, plan)
        elif w.phase in ("training", "broken", "standby", "waiting", "preparing") and self._involved(w, plan):
            if w.world is not None and plan.previous != w.world.generation:
                if plan.previous is not None and plan.previous > w.world.generation:
                    # the job moved past this process's world: what it holds is stale
                    self.log(f"{w.inc}: plan {plan.generation} follows {plan.previous}, past its world "
                             f"{w.world.generation}: rejoins as a new process")
                    w.handled = latest - 1
                    self._rejoin(w)
                return  # a plan about another world than ours
            if w.phase == "waiting" and w.id not in plan.members:
                return
            if w.world is None:
                prev = r.get(Keys.plan(plan.previous))
                if prev is None or w.id in prev.members:
                    return  # named as a process of the old world it does not hold: not this one
            w.target, w.phase = plan, "preparing" if w.phase != "broken" else "broken"
            w.prep_done = self.now + self.rng.uniform(0.2, 1.5)
            r.store.set(Keys.prepared(plan.generation, w.id), "pending")
            self.log(f"{w.inc} prepares {plan.generation}")

    def _rejoin(self, w: Worker) -> None:
        """The job went on without this process: whatever it holds is stale; it comes back as a
        new one (``WorkerAgent.rejoin``)."""
        w.incarnation += 1
        w.phase, w.world, w.state_step, w.target, w.cp, w.torn_down = "waiting", None, None, None, None, False
        w.broken_at = None
        self._register(w)

    @staticmethod
    def _involved(w: Worker, plan: WorldPlan) -> bool:
        if w.id in plan.members or w.id in plan.standbys:
            return True
        return w.world is not None and plan.previous == w.world.generation and w.id in w.world.members

    def _start_world(self, w: Worker, plan: WorldPlan) -> None:
        if w.id not in plan.members:
            if w.id in plan.standbys:
                w.world, w.phase, w.state_step = plan, "standby", None
            return
        t = self.tracks.get(plan.generation)
        if t is not None and t.start is not None and t.step > t.start:
            return  # its members met long ago: this process's rendezvous would wait alone
        step = 0
        if plan.restore_from is not None:
            ck = next((c for c in self.checkpoints if c["path"] == plan.restore_from), None)
            step = ck["step"] if ck else 0
        w.world, w.phase, w.state_step, w.target, w.cp, w.torn_down = plan, "training", step, None, None, False
        w.broken_at = None
        self._adopted(w, plan)
        w.reader.store.set(Keys.result(plan.generation, w.id), MemberResult(ok=True))

    def _adopted(self, w: Worker, plan: WorldPlan) -> None:
        """``w`` trains in ``plan`` from now on: the samples invariant."""
        t = self.tracks.setdefault(plan.generation, WorldTrack())
        if t.start is None:
            t.start = t.step = w.state_step
        elif w.state_step != t.step:
            self.violate(f"{w.id} enters generation {plan.generation} at step {w.state_step}, the world is at "
                         f"{t.step}: samples skipped or repeated")
        self.log(f"{w.inc} trains in {plan.generation} from step {w.state_step}")

    # ---- the world's steps and switches (what collectives make simultaneous) ------------------
    def _steps(self) -> None:
        self.at(self.now + STEP_TIME, "steps", "")
        if not self.faults_left and self.now > self.last_fault + 2 * HB_TIMEOUT and self._settled() is None:
            self._queue.clear()  # settled: the rest of the schedule is steady training
            return
        by_gen: dict[int, list[Worker]] = {}
        for w in self.workers.values():
            if w.world is not None and w.state_step is not None and w.alive and w.phase in ("training", "preparing"):
                by_gen.setdefault(w.world.generation, []).append(w)
        for gen, ws in by_gen.items():
            plan = ws[0].world
            members = [self.workers[m] for m in plan.members]
            gone = [m for m in members if not m.alive or m.world is None or m.world.generation != gen
                    or m.phase not in ("training", "preparing")]
            frozen = [m for m in members if m.alive and self.now < m.frozen_until]
            if gone or frozen:
                for m in ws:
                    if m.broken_at is None:
                        # a dead peer fails the collective at once; a frozen one blocks it until
                        # the peer is declared dead (its communicators are aborted) or it times out
                        m.broken_at = self.now + (0.5 if gone else COLLECTIVE_TIMEOUT)
                    declared = any(self._is_declared(m, f) for f in frozen)
                    if self.now >= m.broken_at or declared:
                        m.phase, m.broken_at = "broken", None
                        self.log(f"{m.inc}: world {gen} broken")
                continue
            t = self.tracks[gen]
            t.step += 1
            for m in ws:
                m.state_step = t.step
                m.broken_at = None
            if t.step % CHECKPOINT_EVERY == 0:
                self.checkpoints.append({"path": f"ckpt/{gen}/{t.step}", "step": t.step, "verified": True})
        self._switches()

    def _is_declared(self, w: Worker, peer: Worker) -> bool:
        try:
            return w.reader is not None and w.reader.get(Keys.dead(peer.id)) == peer.inc
        except StoreDown:
            return False

    def _switches(self) -> None:
        """A prepared plan switches once every live process of its transition prepared."""
        targets = {w.target.generation: w.target for w in self.workers.values()
                   if w.alive and w.target is not None and w.phase in ("preparing", "broken") and w.cp is None}
        for gen, plan in targets.items():
            old = next((w.world for w in self.workers.values() if w.world is not None
                        and w.world.generation == plan.previous), None)
            if old is None:
                continue
            procs = [self.workers[m] for m in transition_members(old, plan)]
            if any(p.alive and (p.target is None or p.target.generation != gen or self.now < p.prep_done
                                or self.now < p.frozen_until) for p in procs):
                continue
            if any(not p.alive for p in procs):
                continue  # the transition group cannot form: the coordinator aborts it
            ok = all(p.phase != "broken" or p.state_step is not None for p in procs)
            self.log(f"switch to {gen} ({'transfer' if ok else 'fails'})")
            sources = [p for p in procs if p.world is not None and p.world.generation == old.generation
                       and p.state_step is not None]
            step = max((p.state_step for p in sources), default=None)
            for p in procs:
                p.phase = "commit"
                p.torn_down = p.id in plan.members and p.world is not None and p.world.generation == old.generation
                error = "" if ok and step is not None else "transfer failed"
                p.cp = CommitPoint(plan, p.id, error=error, now=self.now, timeout=COMMIT_TIMEOUT, bound=COMMIT_BOUND)
                p.switch_step = step
                self._cp_actions(p, p.cp.start())
                if p.id in plan.members:
                    with contextlib.suppress(StoreDown):
                        p.reader.store.set_confirmed(Keys.arrived(gen, p.id), "1")

    def _cp_actions(self, w: Worker, actions: list) -> None:
        store = w.reader.store if w.reader else None
        for a in actions:
            try:
                if isinstance(a, WriteReady):
                    if "lose-write" in self.faults and self.core is not None and self.rng.random() < 0.03 \
                            and self.fault_count.get("lose-write", 0) < 2 and self.now < self.duration:
                        # the coordinator dies under the vote: the set returns, nothing confirms it
                        self.last_fault = self.now
                        self._count("lose-write")
                        store.set(Keys.ready(w.cp.generation, w.id), "1")
                        self._kill_coordinator("under a ready vote")
                        w.cp.voted(True, False)
                        continue
                    store.set_confirmed(Keys.ready(w.cp.generation, w.id), "1")
                    w.cp.voted(True, True)
                    plan = w.cp.plan
                    if all(store.data.get(Keys.ready(plan.generation, m)) is not None for m in plan.members):
                        w.cp.decision_read(store.decide(Keys.decision(plan.generation), COMMITTED))
                elif isinstance(a, WriteAbort):
                    plan = w.cp.plan
                    value = a.value
                    if not w.cp.error and all(w.reader.get(Keys.ready(plan.generation, m)) == "1"
                                              for m in plan.members):
                        value = COMMITTED  # every vote is yes: the decision was written (and lost)
                    w.cp.decision_read(store.decide(Keys.decision(w.cp.generation), value))
            except (StoreDown, AttributeError):
                w.cp.store_lost(self.now)

    def _commit_step(self, w: Worker) -> None:
        cp = w.cp
        if cp is None or not w.alive:
            return
        r = w.reader
        try:
            if cp.polls_old_store and r is not None:
                cp.decision_read(r.get(Keys.decision(cp.generation)))
            elif cp.polls_resolution and r is not None and r.store.up:
                cp.resolution_read(r.get(Keys.decision(cp.generation)) or r.get(Keys.outcome(cp.generation)))
        except StoreDown:
            cp.store_lost(self.now)
        self._cp_actions(w, cp.tick(self.now))
        verdict = cp.verdict()
        if verdict is None:
            return
        plan = cp.plan
        if r is not None and r.store.up and verdict == COMMITTED:
            with contextlib.suppress(StoreDown):
                r.get(Keys.decision(plan.generation))  # read once more: puts a deleted decision back
        if not isinstance(verdict, Failed):
            acts = self.acted.setdefault(plan.generation, {})
            acts[w.inc] = "committed" if verdict == COMMITTED else "aborted"
            if len(set(acts.values())) > 1:
                self.violate(f"generation {plan.generation}: live processes acted on different decisions {acts}")
        w.cp = None
        w.target = None
        if isinstance(verdict, Failed):
            self._exit(w, verdict.reason)
            return
        result = MemberResult(ok=verdict == COMMITTED, error="" if verdict == COMMITTED else verdict,
                              step=w.switch_step if w.switch_step is not None else -1)
        if verdict == COMMITTED:
            if w.id in plan.members:
                w.world, w.phase, w.state_step = plan, "training", w.switch_step
                w.broken_at = None
                self._adopted(w, plan)
            elif w.id in plan.standbys:
                w.world, w.phase, w.state_step = plan, "standby", None
            else:
                w.state_step = None
                self._exit(w, "left by plan")
        else:
            if w.world is None or w.state_step is None:
                w.phase, w.world, w.state_step = "waiting", None, None  # a joiner: back to waiting
            else:
                w.phase = "broken" if w.torn_down else "training"
            self.log(f"{w.inc}: {plan.generation} {verdict}; back to {w.phase}")
        w.torn_down = False
        try:
            if r is not None and r.store.up:
                r.store.set(Keys.result(plan.generation, w.id), result)
        except StoreDown:
            pass

    def _exit(self, w: Worker, why: str) -> None:
        w.phase = "exited"
        if w.reader is not None and w.reader.store.up:
            self._beat(w)  # its last word: gone on purpose
        w.alive, w.exit_reason = False, why
        self.log(f"{w.inc} exits: {why}")

    def _count(self, fault: str) -> None:
        self.fault_count[fault] = self.fault_count.get(fault, 0) + 1
