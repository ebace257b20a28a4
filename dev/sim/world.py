"""The simulated job: the shipped protocol code over a simulated transport, clock and processes.

Time is a number advanced by an event queue, so one schedule of a minute of a job's life runs in
milliseconds. What runs as shipped, unmodified:

* the job's store: ``control.store.JobStore`` (MACs, sequences, write-once keys, tamper
  accounting) in every process, over ``sim.store.SimClient`` (the wire);
* the coordinator: ``coordinator.loop.Coordinator`` (its observe/apply, hence
  ``CoordinatorCore``, the liveness judge and the generation judgement), ticked on the simulated
  clock with the planner swapped for ``SimChooser`` (a world is its members in order);
* each worker's commit point: ``agent.commit_driver.CommitDriver`` over ``CommitPoint``, and its
  results through ``agent.connection.report_result``.

What is modelled: the workers' training loop and switch (prepare, a step boundary, a transfer,
arrival; a "tp" world holds each of two shards on every other member, a "dp" world a full copy
on each), their heartbeats and registrations (the contract's ``Heartbeat``/``Registration``),
the plan source and the checkpoints. The invariants are checked against the simulator's own
ledger of who wrote what (``sim.store.Write``), never against the code under test.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import random
from dataclasses import dataclass, field

from liveshard.dev.sim.faults import Faults
from liveshard.dev.sim.kinds import FAULTS
from liveshard.dev.sim.store import ATTACKER, JOB, Link, SimClient, SimServer, Write, seal_parts
from liveshard.runtime.agent.commit_driver import CommitDriver
from liveshard.runtime.agent.commit_point import CommitPoint, Failed
from liveshard.runtime.agent.connection import register_again_if_lost, report_result
from liveshard.runtime.agent.control import (
    REGISTRATION_CHECK,
    Uptake,
    in_flight,
    involved,
    left_behind,
    not_this_process,
    takes_up,
)
from liveshard.runtime.agent.final_save import (
    FINISHED_REPORT_PATIENCE,
    GaveUp,
    Saved,
    attempts,
    finished_record,
    give_up_reason,
    verdict,
)
from liveshard.runtime.contract.keys import COMMITTED, Keys
from liveshard.runtime.control.protocol import (
    Heartbeat,
    MemberResult,
    Registration,
    WorldPlan,
    transition_members,
)
from liveshard.runtime.control.store import JobStore
from liveshard.runtime.coordinator.events import CheckpointView, restore_choice
from liveshard.runtime.coordinator.loop import Coordinator
from liveshard.runtime.coordinator.membership import LOST_PROCESS
from liveshard.runtime.coordinator.requests import PlanningInputs, PlanRequest
from liveshard.runtime.coordinator.world_choice import WorldChooser
from liveshard.runtime.planner import Constraints
from liveshard.runtime.planner.precompute import PlanCache

SECRET = b"the job's secret (simulated)"
INCARNATION = "sim-job"
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
FINAL_SAVE_PATIENCE = 6.0  # seconds a final save waits for space, in all (``final_save.attempts``)




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
    """The planner, modelled: every member trains, or at most ``most`` of them (the running
    world's first, as the planner's fewest-changes objective keeps them) and the rest stand by,
    as when the global batch fits no more data-parallel ranks."""

    def __init__(self, most: int | None = None) -> None:
        super().__init__(spec=None, plans=PlanCache())  # type: ignore[arg-type]
        self.most = most

    def choose(self, request, members, *, current, dead, inputs, node_of, memory_of=None, count=True):
        config = request.config or (current.config if current and current.config else "dp")
        if request.config is None and shards(config) > len(members):
            config = "dp"  # the planner picks a layout that fits
        if shards(config) > len(members):
            from liveshard.runtime.errors import ConfigError

            raise ConfigError("config", f"{config} needs {shards(config)} workers, {len(members)} given", "")
        if self.most is None or len(members) <= self.most:
            return _World(config, tuple(_Gpu(m) for m in members))
        running = set(current.members) if current else set()
        ordered = sorted(members, key=lambda m: m not in running)  # stable: the running world's first
        return _World(config, tuple(_Gpu(m) for m in ordered[:self.most]), tuple(_Gpu(m) for m in ordered[self.most:]),
                      f"the global batch fits at most {self.most} data-parallel ranks")

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
    target_epoch: int = -1  # the store (link epoch) the plan was read from
    prep_done: float = 0.0
    torn_down: bool = False  # the old world's groups are gone (a member past the vote)
    driver: CommitDriver | None = None  # in its commit window (the shipped driver)
    building: tuple[WorldPlan, str, str] | None = None  # a new member building its world: (plan, error, process)
    last_cp: CommitPoint | None = None  # the newest commit point it entered, decided or not (as ``state.commit_point``)
    preparing: WorldPlan | None = None  # the newest plan it started to prepare (as ``ControlThread.preparing``)
    known: set[int] = field(default_factory=set)  # generations it took up (as ``Preparations.known``)
    link: Link = field(default_factory=Link)
    handled: int = -1
    latest_seen: int = -1
    seq: int = 0
    clock_skew: float = 0.0
    last_valid_beat: float = -1e9  # sim time of its last beat written to a live store
    broken_at: float | None = None  # when its world's collective will fail
    switch_step: int | None = None  # the step the state it transfers is at
    next_beat: float = 0.0
    next_registration_check: float = 0.0
    exit_reason: str | None = None
    finished_report: tuple[dict, float] | None = None  # rank 0 telling the end of training: (record, give up at)

    @property
    def inc(self) -> str:
        return f"{self.id}.{self.incarnation}"

    @property
    def cp(self) -> CommitPoint | None:
        return self.driver.cp if self.driver is not None else None


@dataclass
class WorldTrack:
    start: int | None = None
    step: int = 0


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
    """The job's volume is the simulator's list of checkpoints (all of them, seen by every
    coordinator); ``checkpoint/latest`` is read from the coordinator's store and the choice is
    the shipped rule's (``events.restore_choice``)."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def latest(self) -> dict | None:
        good = [c for c in self.sim.checkpoints if c["verified"]]
        pointer = None
        if self.sim.cstore is not None:
            with contextlib.suppress(Exception):  # a store that is gone: no pointer
                pointer = self.sim.cstore.get_json(Keys.CHECKPOINT)
        named = next((c for c in self.sim.checkpoints if pointer and c["path"] == pointer.get("path")), None)
        problem = None if named is None or named["verified"] else "its files do not verify"
        choice, _ = restore_choice(pointer, problem, good[-1] if good else None)
        return choice

    def on_volume(self) -> dict | None:
        return self.latest()  # the volume holds every checkpoint (none before the first world)


class SimSource:
    """The plan source: scheduled requests, and a join for each worker waiting outside the world."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.queue: list[PlanRequest] = []
        self.asked_join: set[str] = set()
        self.handed_to: object = None  # the coordinator the job's plan was last handed to

    def poll(self) -> PlanRequest | None:
        if self.queue:
            self.handed_to = self.sim.coordinator
            return self.queue.pop(0)
        core = self.sim.core
        if core is None:
            return None
        if core.current is None:
            # a restarted coordinator that found no world to adopt (every process restarted
            # too): the operator's plan, which is in the job's status, is handed to it anew
            alive = tuple(w.id for w in self.sim.workers.values() if w.alive and w.id not in core.dead)
            if self.handed_to is not self.sim.coordinator and alive:
                self.handed_to = self.sim.coordinator
                return PlanRequest(members=alive, reason="the job's plan, handed to a restarted coordinator")
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

    def planning(self) -> PlanningInputs | None:
        return None

    def report(self, status: dict) -> None:
        self.sim.reported = status


@dataclass
class Ledger:
    """What the simulator saw written (by whom), for the safety invariants."""

    votes: dict[int, set[str]] = field(default_factory=dict)  # generation -> members whose ready vote landed
    decisions: dict[int, str] = field(default_factory=dict)  # generation -> the first decision a process wrote
    outcomes: dict[int, set[str]] = field(default_factory=dict)  # generation -> outcomes coordinators wrote
    fault_serial_at_publish: dict[int, int] = field(default_factory=dict)


class Simulation(Faults):
    def __init__(self, seed: int, faults: frozenset[str] = frozenset(FAULTS), workers: int | None = None,
                 duration: float = 20.0, script: tuple[tuple[float, str], ...] | None = None,
                 absent: tuple[str, ...] = (), config: str | None = None, most: int | None = None) -> None:
        """``script``: scripted events (time, a fault kind such as ``kill:w2`` or ``respawn:w1``,
        or a request ``request:<reason>:<member,member,...>``) instead of random faults;
        ``absent``: workers whose process starts later (by a ``respawn:`` event); ``most``: the
        planner trains at most this many workers, the others stand by (``SimChooser``)."""
        self.rng = random.Random(seed)
        self.seed = seed
        self.faults = faults
        self.now = 0.0
        self.duration = duration  # faults happen before this; then the job must settle
        self.settle = TRANSITION_TIMEOUT + COMMIT_BOUND + 4 * HB_TIMEOUT
        n = workers or self.rng.randint(2, 5)
        if most is None and script is None and n >= 3:
            # a random schedule keeps one worker standing by in some runs (a stream of its own:
            # the faults drawn for a seed stay the same)
            shape = random.Random(seed * 104729 + 5)
            most = n - 1 if shape.random() < 0.3 else None
        self.most = most
        # in some random schedules the operator's plan for a loss follows the runtime's recovery
        # (``_operator_plan_for_the_loss``); its delays are drawn from a stream of their own
        ops = random.Random(seed * 104729 + 11)
        self.operator_plans = random.Random(seed * 7 + 3) if script is None and ops.random() < 0.3 else None
        self.workers = {f"w{i}": Worker(f"w{i}") for i in range(n)}
        self.epoch = 0
        self.server = SimServer(0, lambda: self.now, self._on_write)
        self.coordinator: Coordinator | None = None
        self.coord_frozen_until = 0.0  # the coordinator's process (and its store) stopped until then
        self.coord_frozen_from = 0.0
        self.beating_at_freeze: set[str] = set()  # processes whose beats were landing when it stopped
        self.last_coord_tick: float | None = None
        self.cstore: JobStore | None = None
        self.source = SimSource(self)
        self.reported: dict | None = None
        # The final save, drawn from a stream of its own: trainIters (None: the schedule ends
        # before it), whether a fallback directory is configured, until when each directory is
        # full (inf: for good), and the chance that one rank's write fails on its own
        save = random.Random(seed * 7919 + 17)
        self.train_iters = save.choice((None, save.randint(8, 40)))
        self.fallback = save.random() < 0.5
        self.full_until = {"ckpt": save.choice((0.0, 0.0, save.uniform(0.0, 30.0), float("inf"))),
                           "fallback": save.choice((0.0, 0.0, float("inf")))}
        self.rank_failure = save.choice((0.0, 0.0, 0.3))
        self.save_rng = save
        self.saving: dict[int, tuple[Saved | GaveUp, int, tuple[str, ...], bool]] = {}
        self.finish_checked = False
        self.clients: list[tuple[str, SimClient, JobStore]] = []  # every process's client, for accounting
        self.checkpoints: list[dict] = []
        self.tracks: dict[int, WorldTrack] = {}
        # generation -> {process: the decision it acted on}; a process declared dead is cut off,
        # and what it did no longer counts
        self.acted: dict[int, dict[str, str]] = {}
        self.ledger = Ledger()
        self.fault_serial = 0  # faults injected so far (non-triviality: none while a generation ran)
        self.violations: list[str] = []
        self.trace: list[str] = []
        self.fault_count: dict[str, int] = {}
        self.failure: dict | None = None  # the job ended Failed (kept by the plan source)
        self.published: dict[int, WorldPlan] = {}
        self.seen_plans: dict[int, WorldPlan] = {}  # what some worker read under each generation
        self.seen_by: dict[int, set[str]] = {}  # the processes that read it
        self.forged_beats: set[str] = set()  # heartbeat keys overwritten by an attacker all along
        self.captured_pointer: bytes | None = None  # checkpoint/latest's bytes an attacker kept (a replay)
        self.delete_pending_for = 0.0  # seconds of each pending generation in which its keys are deleted
        self.delete_pending_plans = True  # the plans and pointers too (else only the generation's own keys)
        self.pending_since: dict[int, float] = {}  # generation -> when it was first seen pending
        self.solid_forged: set[str] = set()  # ... before every read of the coordinator
        self.rendezvous_broken = 0  # live transitions still to fail in their rendezvous (c10d keys overwritten)
        self.broken_rendezvous: set[int] = set()  # the generations whose rendezvous was broken
        self._queue: list[tuple[float, int, str, str]] = []
        self._n = 0
        self.faults_left = 0  # fault events still queued
        self.last_fault = 0.0
        self.step_at_last_fault = 0
        self._start_coordinator()
        config = config or ("tp" if n >= 2 and self.rng.random() < 0.4 else "dp")
        for m in absent:
            self.workers[m].alive, self.workers[m].incarnation = False, -1
        present = tuple(m for m in self.workers if m not in absent)
        self.source.queue.append(PlanRequest(members=present, config=config, reason="start"))
        for m in present:
            self.at(self.rng.uniform(0.0, 1.0), "wake", m)
        self.at(COORD_TICK, "coord", "")
        self.at(STEP_TIME, "steps", "")
        if script is None:
            self._plan_faults()
        for t, event in script or ():
            self.at(t, "fault", event)

    @property
    def core(self):
        return self.coordinator.core if self.coordinator is not None else None

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
                self.fault_serial += 1
                self._fault(target)
            elif kind == "vote":
                self._vote(self.workers[target])
            elif kind == "saved":
                self._saved(int(target))
            elif kind == "coord-up":
                self._start_coordinator()
            self._check_tamper_accounting()
        if not self.violations:
            self._check_settled()
        steps = max((t.step for t in self.tracks.values()), default=0)
        outcome = self._outcome()
        return SimResult(self.seed, not self.violations, self.violations, self.trace, dict(self.fault_count), outcome,
                         steps)

    # ---- processes' store clients ---------------------------------------------------------------
    def _connect(self, who: str, skew: float = 0.0) -> tuple[SimClient, JobStore]:
        client = SimClient(self.server, who)
        store = JobStore(client, JOB, SECRET, incarnation=INCARNATION,
                         clock=lambda: int((self.now + skew) * 1e9))
        self.clients.append((who, client, store))
        return client, store

    # ---- the coordinator ----------------------------------------------------------------------
    def _start_coordinator(self) -> None:
        if self.coordinator is not None or self.failure is not None:
            return
        if self.cstore is not None:  # a restart: a new, empty store
            self.epoch += 1
            self.server = SimServer(self.epoch, lambda: self.now, self._on_write)
            self.log(f"coordinator up, store epoch {self.epoch}")
        _, self.cstore = self._connect(f"coordinator.{self.epoch}")
        self.last_coord_tick = None
        planning = PlanningInputs(Constraints(global_batch=8, micro_batch=1))
        self.coordinator = Coordinator(self.cstore, None, self.source, planning, heartbeat_timeout=HB_TIMEOUT,
                                       transition_timeout=TRANSITION_TIMEOUT, precompute=False,
                                       clock=lambda: self.now, wall=lambda: self.now, chooser=SimChooser(self.most),
                                       checkpoints=SimCheckpoints(self))

    def _coord_tick(self) -> None:
        coordinator = self.coordinator
        pending = coordinator is not None and coordinator.pending is not None
        self.at(self.now + (COORD_TICK if pending else 2 * COORD_TICK), "coord", "")
        if coordinator is None or not self.server.up:
            return
        for m in sorted(self.forged_beats):
            if self.rng.random() < 0.7 or m in self.solid_forged:  # an attacker overwriting a heartbeat all along
                w = self.workers.get(m)
                self.server.forge(Keys.heartbeat(m), Heartbeat(time=self.now, state="training",
                                                               incarnation=w.inc if w else None).to_json())
        if self.delete_pending_for and coordinator.pending is not None:
            self._delete_pending_keys(coordinator.pending.plan.generation)
        if self.now < self.coord_frozen_until:
            return  # SIGSTOP: no tick (its store answers nobody either: ``SimServer.frozen_until``)
        paused = coordinator.paused_since(self.last_coord_tick)  # as ``Coordinator.run`` measures it
        self.last_coord_tick = self.now
        coordinator.tick(paused)
        self._check_finished()
        self._pods_ended()

    def _on_write(self, w: Write) -> None:
        """Every write that lands: who wrote what is the ground truth of the invariants."""
        if w.writer == ATTACKER:
            return
        parts = seal_parts(w.raw)
        if parts is None:
            return  # a counter (``add``) or an unsealed c10d key
        flag, value = parts
        key = w.key
        if flag == "d":
            return
        if key.startswith("plan/") and key[5:].isdigit():
            self._published(WorldPlan.from_json(value))
        elif key.startswith("gen/") and "/ready/" in key:
            gen, member = int(key.split("/")[1]), key.split("/ready/")[1]
            if value == "1" and w.writer.split(".")[0] == member:
                self.ledger.votes.setdefault(gen, set()).add(member)
        elif key.startswith("members/") and not key.startswith("members/index"):
            # a member that re-announces itself inside the commit window of a generation, not
            # having failed, votes ready there (the restarted coordinator may count it so)
            reg = Registration.parse(key[8:], json.loads(value))
            if reg is not None and reg.open is not None and reg.open.decision is None \
                    and w.writer.split(".")[0] == key[8:]:
                self.ledger.votes.setdefault(reg.open.generation, set()).add(key[8:])
        elif key.startswith("gen/") and key.endswith("/decision"):
            self._decision_written(int(key.split("/")[1]), value, w.writer)
        elif key.startswith("gen/") and key.endswith("/outcome") and w.writer.startswith("coordinator"):
            self._outcome_written(int(key.split("/")[1]), value)
        elif key.startswith("dead/") and w.writer.startswith("coordinator"):
            self._check_death(key[5:], value or None)
        elif key == Keys.STOP and w.writer.startswith("coordinator"):
            self.failure = self.core.failure if self.core is not None else {"reason": "stopped"}
            self.log(f"stop: {self.failure}")
            self._check_failure_justified(self.failure)
        if key.startswith("gen/") and "/ready/" in key and "lose-write" in self.faults and self.coordinator \
                and self.rng.random() < 0.03 and self.fault_count.get("lose-write", 0) < 2 and self.now < self.duration:
            # the coordinator dies under the vote: the set landed, nothing confirms it
            self.last_fault = self.now
            self.fault_serial += 1
            self._count("lose-write")
            self._kill_coordinator("under a ready vote")

    # ---- safety invariants ----------------------------------------------------------------------
    def _published(self, plan: WorldPlan) -> None:
        if self.published.get(plan.generation) == plan:
            return  # the same plan written back (a reader repairing a deleted write-once key)
        known = self.seen_plans.get(plan.generation)
        readers = [w.inc for w in self.workers.values() if w.alive and w.inc in self.seen_by.get(plan.generation, ())]
        if known is not None and readers and (known.members, known.config, known.previous) != \
                (plan.members, plan.config, plan.previous):
            self.violate(f"generation {plan.generation}, which {readers} read, reused for another plan")
        if plan.generation in self.published:
            self._forget(plan.generation)  # reused where no live process knew it: a new generation
        if plan.generation not in self.published:
            self.ledger.fault_serial_at_publish[plan.generation] = self.fault_serial
            if plan.restore_from is not None:
                ck = next((c for c in self.checkpoints if c["path"] == plan.restore_from), None)
                if ck is None or not ck["verified"]:
                    self.violate(f"plan {plan.generation} restores unverified checkpoint {plan.restore_from}")
                newest = max((c["step"] for c in self.checkpoints if c["verified"]), default=None)
                if ck is not None and newest is not None and ck["step"] < newest:
                    self.violate(f"plan {plan.generation} restores step {ck['step']} although step {newest} "
                                 "verifies (a rollback)")
        self.published[plan.generation] = plan
        self.log(f"publish {plan.generation} {plan.config} {plan.members} prev={plan.previous} "
                 f"restore={plan.restore_from} ({plan.reason})")

    def _forget(self, gen: int) -> None:
        for book in (self.ledger.votes, self.ledger.decisions, self.ledger.outcomes, self.acted, self.tracks,
                     self.published, self.seen_plans, self.seen_by):
            book.pop(gen, None)

    def _missing_votes(self, gen: int) -> list[str] | None:
        plan = self.published.get(gen)
        if plan is None or not plan.is_live_transition:
            return None
        votes = self.ledger.votes.get(gen, set())
        return [m for m in plan.members if m not in votes]

    def _decision_written(self, gen: int, value: str, writer: str) -> None:
        """Validity: a commit only after every member's ready vote; non-triviality: no abort when
        every member voted ready and nothing failed while the generation ran."""
        missing = self._missing_votes(gen)
        if value == COMMITTED and missing:
            self.violate(f"generation {gen} committed by {writer} without the ready votes of {missing}")
        first = self.ledger.decisions.setdefault(gen, value)
        if first is value and value != COMMITTED and missing == [] \
                and self.ledger.fault_serial_at_publish.get(gen) == self.fault_serial:
            self.violate(f"generation {gen} aborted by {writer} although every member voted ready and nothing "
                         f"failed: {value}")
        self.log(f"decision {gen} by {writer}: {value}")

    def _outcome_written(self, gen: int, outcome: str) -> None:
        committed = outcome == COMMITTED
        missing = self._missing_votes(gen)
        if committed and missing:
            self.violate(f"outcome of generation {gen} is committed without the ready votes of {missing}")
        kinds = self.ledger.outcomes.setdefault(gen, set())
        kinds.add("committed" if committed else "aborted")
        if len(kinds) > 1:
            self.violate(f"generation {gen} given both outcomes by coordinators")
        acted = set(self.acted.get(gen, {}).values())
        if acted and acted != {"committed" if committed else "aborted"}:
            self.violate(f"generation {gen}: a coordinator resolved it {outcome} while live processes acted "
                         f"on {self.acted[gen]}")
        self.log(f"outcome {gen}: {outcome}")

    def _check_failure_justified(self, failure: dict | None) -> None:
        """A job ends ``Failed`` only for a reason the simulator's ground truth bears out."""
        reason = (failure or {}).get("reason")
        verified = [c["path"] for c in self.checkpoints if c["verified"]]
        if reason == "NoSurvivingCopy" and verified:
            self.violate(f"the job failed with no surviving copy although checkpoint {verified[-1]} verifies")

    def _check_tamper_accounting(self) -> None:
        """Every forged value a process's store client returned was counted as tampering by its
        ``JobStore`` (and so never taken as valid)."""
        for who, client, store in self.clients:
            if client.forged_read:
                counted = store.tampering_counts()["forged"]
                if counted < len(client.forged_read):
                    self.violate(f"{who} read {len(client.forged_read)} forged values and counted {counted} "
                                 f"as forged")
                taken = [k for k, a in store._accepted.items() if a.raw in self.server.forged]
                if taken:
                    self.violate(f"{who} took forged values for valid: {taken}")

    def _check_death(self, member: str, incarnation: str | None) -> None:
        w = self.workers[member]
        for acts in self.acted.values():
            for inc in [i for i in acts if i == incarnation or (incarnation == LOST_PROCESS and i.split(".")[0] == member)]:
                del acts[inc]
        self.log(f"declared dead: {member} ({incarnation})")
        core = self.core
        cur = core.current if core else None
        stale = (w.world is not None and cur is not None and w.world.generation < cur.generation
                 and member not in cur.members)
        holder = incarnation == LOST_PROCESS and w.world is not None and cur is not None \
            and w.world.generation == cur.generation and w.state_step is not None
        if w.alive and not stale and (w.inc == incarnation or holder) and self.now - w.last_valid_beat < HB_TIMEOUT / 2 \
                and w.link.server is self.server:
            self.violate(f"{member} declared dead while heartbeating validly (last beat "
                         f"{self.now - w.last_valid_beat:.2f} s ago)")
        # beating when the coordinator (and its store) stopped, not stopped itself since, and the
        # coordinator just woke: its silence is the coordinator's own
        if w.alive and w.inc == incarnation and w.inc in self.beating_at_freeze \
                and self.now - self.coord_frozen_until < HB_TIMEOUT / 2 and w.frozen_until <= self.coord_frozen_from:
            self.violate(f"{member} declared dead {self.now - self.coord_frozen_until:.2f} s after the coordinator "
                         f"woke, though it was beating when the coordinator stopped")

    # ---- workers ------------------------------------------------------------------------------
    def _wake(self, w: Worker) -> None:
        if not w.alive:
            return
        self.at(self.now + POLL * self.rng.uniform(0.8, 1.2), "wake", w.id)
        if self.now < w.frozen_until:
            return
        if self.delete_pending_for and self.coordinator is not None and self.coordinator.pending is not None:
            self._delete_pending_keys(self.coordinator.pending.plan.generation)  # the attacker reads first
        if w.finished_report is not None:
            self._report_finished(w)
            return
        if not self._connected(w):
            self._commit_step(w)  # a member waiting in its commit window keeps counting
            return
        try:
            if self.now >= w.next_beat:
                w.next_beat = self.now + HB_INTERVAL
                self._beat(w)
            w.link.kept.restore(w.link.store, self.now)  # as the control thread's poll
            if self.now >= w.next_registration_check:
                w.next_registration_check = self.now + REGISTRATION_CHECK
                if register_again_if_lost(w.link, w.id, lambda: self._registration(w, reconnected=True)):
                    w.handled = -1
                    self.log(f"{w.inc} registers again (its registration was deleted)")
            self._poll(w)
        except Exception as e:  # the store's server is gone or stopped (a DistStoreError)
            if (w.link.server is not None and w.link.server.frozen) or not self.server.up \
                    or w.link.server is not self.server:
                self._commit_step(w)
            else:
                raise RuntimeError(f"{w.inc}: {e}") from e

    def _connected(self, w: Worker) -> bool:
        """Whether ``w`` talks to a live store; connects to a restarted coordinator's (and
        announces itself there) when the one it knew is gone."""
        server = w.link.server
        if server is not None and server.up:
            return True
        if not self.server.up or self.coordinator is None:
            return False
        # a new client (as ``StoreClients.replace``, once it announced itself: ``reannounce``);
        # the commit driver sees the epoch change
        before = (w.link.client, w.link._store, w.link.epoch)
        w.link.client, w.link._store = self._connect(w.inc, w.clock_skew)
        w.link.epoch += 1
        try:
            self._register(w, reconnected=w.link.epoch > 0)
        except Exception:  # that store does not answer (its process is stopped): try again later
            w.link.client, w.link._store, w.link.epoch = before
            return False
        if w.target is not None and w.driver is None:
            # plans of the old store that never took effect are gone with it (reported above as
            # ``pending_plan``: the new coordinator asks for them again)
            w.target = None
            if w.phase == "preparing":
                w.phase = "training" if w.state_step is not None else "waiting"
        return True

    def _register(self, w: Worker, reconnected: bool = False) -> None:
        w.link.registration_slot = w.link.store.register_member(w.id, self._registration(w, reconnected).to_dict())
        w.handled = -1
        self.log(f"{w.inc} registers in epoch {w.link.server.epoch} ({w.phase})")

    def _registration(self, w: Worker, reconnected: bool) -> Registration:
        """What the process announces: its world, and what is in flight (the shipped rule,
        ``control.in_flight``: its newest commit point, decided or not, while that generation is
        not older than its world; the newest plan it prepared whose outcome it never learned)."""
        world = w.world if w.world is not None and w.state_step is not None else None
        opened, pending = in_flight(w.last_cp, w.preparing, world.generation if world else None)
        return Registration(node=w.id, incarnation=w.inc, latest_seen=w.latest_seen, time=self.now,
                            reconnected=reconnected, plan=world, open=opened, pending_plan=pending)

    def _beat(self, w: Worker) -> None:
        w.seq += 1
        beat = Heartbeat(time=self.now + w.clock_skew, seq=w.seq, state=self._state(w), incarnation=w.inc,
                         generation=w.world.generation if w.world else None, step=w.state_step,
                         preparing=w.target.generation if w.target is not None
                         and w.phase in ("preparing", "transfer") else None)
        w.link.store.set(Keys.heartbeat(w.id), beat.to_json())
        if w.link.server is not None and w.link.server.up:
            w.last_valid_beat = self.now

    @staticmethod
    def _state(w: Worker) -> str:
        return {"preparing": "training", "transfer": "committing", "commit": "committing",
                "saving": "training"}.get(w.phase, w.phase)

    def _poll(self, w: Worker) -> None:
        r = w.link.store
        if r.get(Keys.STOP) is not None:
            self._exit(w, "stopped by the job")
            return
        if r.get(Keys.dead(w.id)) == w.inc and w.phase not in ("left", "exited"):
            self.log(f"{w.inc} finds itself declared dead: rejoins as a new process")
            self._rejoin(w)
            return
        if left_behind(w.id, w.world.generation if w.world else None, w.driver is not None, r):
            self.log(f"{w.inc}: generation {r.get(Keys.CURRENT)} went on without it: rejoins as a new process")
            self._rejoin(w)
            return
        if w.phase == "commit":
            self._commit_step(w)
            return
        if w.target is not None and w.driver is None:
            outcome = r.get(Keys.outcome(w.target.generation))
            if outcome is not None:  # decided without this process's switch: dropped
                self.log(f"{w.inc} drops its preparation of {w.target.generation} ({outcome})")
                self._drop_target(w)
        latest = r.latest_generation()
        w.latest_seen = max(w.latest_seen, latest)
        if latest <= w.handled:
            return
        if w.target is not None and w.driver is None and latest > w.target.generation:
            self.log(f"{w.inc} drops its preparation of {w.target.generation}: plan {latest} is newer")
            self._drop_target(w)  # a newer plan supersedes it (it never switched)
        plan = r.plan(latest)
        if plan is None:
            return
        if r.get(Keys.outcome(latest)) is not None and w.driver is None:
            w.handled = latest  # decided already: nothing to prepare
            return
        self.seen_plans.setdefault(plan.generation, plan)
        self.seen_by.setdefault(plan.generation, set()).add(w.inc)
        w.handled = latest
        if w.world is not None and plan.generation <= w.world.generation:
            return
        if plan.previous is None or plan.restore_from is not None:
            self._start_world(w, plan)
        elif w.phase in ("training", "broken", "standby", "waiting", "preparing") and self._involved(w, plan):
            self._take_up(w, plan, latest)

    def _drop_target(self, w: Worker) -> None:
        w.target = None
        if w.phase == "preparing":
            w.phase = "training" if w.state_step is not None else "waiting"

    def _take_up(self, w: Worker, plan: WorldPlan, latest: int) -> None:
        """Prepare ``plan`` (a live transition this process is part of)."""
        r = w.link.store
        if w.world is not None and plan.previous != w.world.generation:
            if plan.previous is not None and plan.previous > w.world.generation:
                # the job moved past this process's world: what it holds is stale
                self.log(f"{w.inc}: plan {plan.generation} follows {plan.previous}, past its world "
                         f"{w.world.generation}: rejoins as a new process")
                w.handled = latest - 1
                self._rejoin(w)
            return  # a plan about another world than ours
        generation = w.world.generation if w.world else None
        uptake = takes_up(w.id, plan, generation=generation, world=w.world, known=plan.generation in w.known,
                          decided=False,  # (read by ``_poll`` before)
                          replacement=lambda: not_this_process(w.id, generation, plan, r))
        if uptake is not Uptake.PREPARE:
            return
        w.known.add(plan.generation)
        w.target, w.target_epoch, w.preparing = plan, w.link.epoch, plan
        w.phase = "preparing" if w.phase != "broken" else "broken"
        w.prep_done = self.now + self.rng.uniform(0.2, 1.5)
        r.set(Keys.prepared(plan.generation, w.id), "pending")
        self.log(f"{w.inc} prepares {plan.generation}")

    def _rejoin(self, w: Worker) -> None:
        """The job went on without this process: whatever it holds is stale; it comes back as a
        new one (``WorkerAgent.rejoin``)."""
        w.incarnation += 1
        w.phase, w.world, w.state_step, w.target, w.driver, w.torn_down = "waiting", None, None, None, None, False
        w.broken_at, w.building, w.last_cp, w.preparing = None, None, None, None
        w.known = set()
        self._register(w)

    @staticmethod
    def _involved(w: Worker, plan: WorldPlan) -> bool:
        return involved(w.id, plan, w.world)

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
        w.world, w.phase, w.state_step, w.target, w.driver, w.torn_down = plan, "training", step, None, None, False
        w.broken_at = None
        self._adopted(w, plan)
        report_result(w.link.store, w.id, plan.generation, MemberResult(ok=True), w.link.kept)

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
            if self.train_iters is not None and t.step >= self.train_iters:
                self._final_save(gen, members, t.step)
                continue
            t.step += 1
            for m in ws:
                m.state_step = t.step
                m.broken_at = None
            if t.step % CHECKPOINT_EVERY == 0:
                record = {"path": f"ckpt/{self.epoch}.{gen}/{t.step}", "step": t.step}
                self.checkpoints.append({**record, "verified": True})
                with contextlib.suppress(Exception):  # rank 0 publishes it, as after a save; the store may be gone
                    ws[0].link.store.publish_checkpoint(record)
        self._switches()

    def _is_declared(self, w: Worker, peer: Worker) -> bool:
        try:
            return w.link.store.get(Keys.dead(peer.id)) == peer.inc
        except Exception:  # its store is gone
            return False

    def _switches(self) -> None:
        """A prepared plan switches once every live process of its transition prepared."""
        targets = {w.target.generation: w.target for w in self.workers.values()
                   if w.alive and w.target is not None and w.phase in ("preparing", "broken") and w.driver is None}
        for gen, plan in targets.items():
            old = next((w.world for w in self.workers.values() if w.world is not None
                        and w.world.generation == plan.previous), None)
            if old is None:
                continue
            procs = [self.workers[m] for m in transition_members(old, plan)]
            if any(p.alive and (p.target is None or p.target.generation != gen or self.now < p.prep_done
                                or self.now < p.frozen_until or p.phase == "saving" or p.driver is not None)
                   for p in procs):
                # (a process in its final save is inside its last step: it switches no more; one
                # in its commit window switched already)
                continue
            if any(not p.alive for p in procs):
                continue  # the transition group cannot form: the coordinator aborts it
            ok = all(p.phase != "broken" or p.state_step is not None for p in procs)
            if self.rendezvous_broken > 0 and gen not in self.broken_rendezvous:
                self.rendezvous_broken -= 1
                self.broken_rendezvous.add(gen)
            self.log(f"switch to {gen} ({'transfer' if ok and gen not in self.broken_rendezvous else 'fails'})")
            sources = [p for p in procs if p.world is not None and p.world.generation == old.generation
                       and p.state_step is not None]
            step = max((p.state_step for p in sources), default=None)
            error = "" if ok and step is not None else "transfer failed"
            if gen in self.broken_rendezvous:
                error = "prepare: gloo: Connection reset by peer (its rendezvous keys overwritten)"
            for p in procs:
                self._enter_commit_point(p, plan, error, step)
                if gen in self.broken_rendezvous:
                    p.torn_down = False  # it failed in prepare, before the step boundary: the old world is whole

    def _enter_commit_point(self, p: Worker, plan: WorldPlan, error: str, step: int | None) -> None:
        """Past the transfer and the vote's all-reduce: a new member arrives (``live_switch.arrive``)
        and builds; then every process of the transition runs the shipped commit driver."""
        gen = plan.generation
        p.phase = "commit"
        p.torn_down = p.id in plan.members and p.world is not None and p.world.generation == plan.previous
        p.switch_step = step
        if p.id in plan.members and not error:
            if p.link.epoch != p.target_epoch:
                error = f"the coordinator restarted during the switch to generation {gen}"
            else:
                try:
                    p.link.kept.write(p.link.store, gen, Keys.arrived(gen, p.id), "1")  # as ``live_switch.arrive``
                    p.link.store.store.add(Keys.arrivals(gen), 1)
                except Exception as e:  # the store is gone: it cannot build the world
                    error = f"arrive: {e}"
        if p.id in plan.members:
            # building the new world takes each member its own time: the votes come apart
            p.building = (plan, error, p.inc)
            self.at(self.now + self.rng.uniform(0.05, 1.5), "vote", p.id)
        else:
            self._open_commit_point(p, plan, error)

    def _vote(self, p: Worker) -> None:
        if p.building is None or not p.alive or p.building[2] != p.inc:
            return
        if self.now < p.frozen_until:
            self.at(p.frozen_until, "vote", p.id)
            return
        plan, error, _ = p.building
        p.building = None
        self._open_commit_point(p, plan, error)

    def _open_commit_point(self, p: Worker, plan: WorldPlan, error: str) -> None:
        timeout = COMMIT_TIMEOUT * (1 if p.id in plan.members else 3)
        cp = CommitPoint(plan, p.id, error=error, now=self.now, timeout=timeout, bound=COMMIT_BOUND)
        p.driver = CommitDriver(cp, p.link, p.target_epoch, clock=lambda: self.now, incarnation=p.inc)
        p.last_cp = cp
        p.driver.open()
        self._commit_step(p)

    def _commit_step(self, w: Worker) -> None:
        driver = w.driver
        if driver is None or not w.alive:
            return
        if not driver.poll():
            return
        cp = driver.cp
        verdict = cp.verdict()
        plan = cp.plan
        if verdict == COMMITTED:
            with contextlib.suppress(Exception):  # read once more: puts a deleted decision back
                w.link.store.get(Keys.decision(plan.generation))
        if not isinstance(verdict, Failed):
            acts = self.acted.setdefault(plan.generation, {})
            acts[w.inc] = "committed" if verdict == COMMITTED else "aborted"
            if len(set(acts.values())) > 1:
                self.violate(f"generation {plan.generation}: live processes acted on different decisions {acts}")
            resolved = self.ledger.outcomes.get(plan.generation)
            if resolved and resolved != {acts[w.inc]}:
                self.violate(f"generation {plan.generation}: {w.inc} acted on {verdict} after a coordinator "
                             f"resolved it {resolved}")
        w.driver = None
        w.target = None
        if isinstance(verdict, Failed):
            self._exit(w, verdict.reason)
            return
        result = MemberResult(ok=verdict == COMMITTED, error="" if verdict == COMMITTED else str(verdict),
                              step=w.switch_step if w.switch_step is not None else -1)
        if verdict == COMMITTED:
            if w.id in plan.members:
                w.world, w.phase, w.state_step = plan, "training", w.switch_step
                w.broken_at = None
                self._adopted(w, plan)
            elif w.id in plan.standbys:
                w.world, w.phase, w.state_step = plan, "standby", None
            else:
                # the state's safety: a leaver lets its state go only once the generation that
                # moved it elsewhere was decided committed by a process or a coordinator
                if (self.ledger.decisions.get(plan.generation) != COMMITTED
                        and COMMITTED not in self.ledger.outcomes.get(plan.generation, set())):
                    self.violate(f"{w.inc} left generation {plan.generation} (its state with it) that nobody "
                                 "decided committed")
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
            if w.link.server is not None and w.link.server.up:
                report_result(w.link.store, w.id, plan.generation, result, w.link.kept)
        except Exception:
            pass

    # ---- the final save at trainIters (``agent.final_save``'s schedule and verdict) --------------
    def _final_save(self, gen: int, members: list[Worker], step: int) -> None:
        """Every member of the world saves at ``step``: the shipped schedule of attempts (the
        checkpoint directory, the fallback, then both again after pauses) and the shipped verdict
        over every rank's error; the modelled disks say which attempt's writes fail. The save
        takes as long as its pauses; a peer lost meanwhile breaks it (``_saved``)."""
        tried, waited, last, outcome, written = [], 0.0, "", None, False
        for a in attempts("ckpt", "fallback" if self.fallback else None, FINAL_SAVE_PATIENCE,
                          first_pause=1.0, longest_pause=4.0):
            waited += a.wait
            full = self.now + waited < self.full_until[a.root]
            errors = [f"{a.root}: no space left on device" if full
                      else ("input/output error" if self.save_rng.random() < self.rank_failure else None)
                      for _ in members]
            failure = verdict(errors)
            if failure is None:
                outcome = Saved(f"{a.root}/{self.epoch}.{gen}/final-{step}")
                written = all(e is None for e in errors)  # the truth, whatever the verdict said
                break
            tried.append(a.root)
            last = failure
        if outcome is None:
            outcome = GaveUp(give_up_reason(step, tried, last, waited))
            roomy = [d for d in ("ckpt", "fallback") if (d == "ckpt" or self.fallback)
                     and self.full_until[d] < self.now + FINAL_SAVE_PATIENCE]
            if roomy and not self.rank_failure:
                self.violate(f"the final save gave up although {roomy} had room within its patience")
        for w in members:
            w.phase = "saving"
        self.saving[gen] = (outcome, step, tuple(w.inc for w in members), written)
        self.log(f"final save of generation {gen} at step {step}: {outcome} after {waited:.1f} s")
        self.at(self.now + waited + 0.2, "saved", str(gen))

    def _saved(self, gen: int) -> None:
        outcome, step, incs, written = self.saving[gen]
        members = [self.workers[i.split(".")[0]] for i in incs]
        if any(not w.alive or w.inc not in incs or w.phase != "saving" for w in members):
            for w in members:  # the attempt's all-gather failed: the world is broken
                if w.alive and w.inc in incs and w.phase == "saving":
                    w.phase = "broken"
                    self.log(f"{w.inc}: world {gen} broken during the final save")
            del self.saving[gen]
            return
        if any(self.now < w.frozen_until for w in members):
            self.at(max(w.frozen_until for w in members) + 0.1, "saved", str(gen))
            return
        del self.saving[gen]
        error = outcome.reason if isinstance(outcome, GaveUp) else None
        path = outcome.path if isinstance(outcome, Saved) else None
        if path is not None:
            self.checkpoints.append({"path": path, "step": step, "verified": written, "final": True})
        rank0 = members[0]
        for w in members:
            w.phase = "failed" if error else "finished"
        # rank 0 tells the coordinator, trying again on a restarted one's store for a while
        # (``WorkerAgent._report_finished``); the others end at once
        rank0.finished_report = (finished_record(step, step * 8, path, gen, self.now, error),
                                 self.now + FINISHED_REPORT_PATIENCE)
        for w in members[1:]:
            self._exit(w, error or "finished")
        self._report_finished(rank0)

    def _report_finished(self, w: Worker) -> None:
        assert w.finished_report is not None
        record, give_up = w.finished_report
        try:
            if self._connected(w):
                w.link.store.set_json(Keys.FINISHED, record)
                w.finished_report = None
                self._exit(w, record.get("error") or "finished")
                return
        except Exception:  # a store that does not answer: tried again at its next wake
            pass
        if self.now >= give_up:
            w.finished_report = None
            self._exit(w, "could not tell the coordinator that training finished")

    def _pods_ended(self) -> None:
        """The operator's part: when every worker's process ended after its final save gave up
        (each exits 1), the job ends ``Failed`` from the pods' exits, whether or not a
        coordinator read rank 0's report (a restarted one has a store without it)."""
        ws = list(self.workers.values())
        if self.failure is None and ws and all(not w.alive for w in ws) and any(w.phase == "failed" for w in ws):
            self.failure = {"reason": "FinalCheckpointFailed", "message": "every worker exited 1 (the operator)"}
            self.log("stop: every worker exited after a final save that gave up (the operator ends the job)")

    def _check_finished(self) -> None:
        """A job the coordinator calls finished saved a final checkpoint that verifies, at
        trainIters; a final save that gave up ends the job ``Failed``, never finished."""
        core = self.core
        if core is None or core.finished is None or self.finish_checked:
            return
        self.finish_checked = True
        record = core.finished
        ck = next((c for c in self.checkpoints if c.get("final") and c["path"] == record.get("checkpoint")), None)
        if record.get("error"):
            self.violate(f"the job finished although its final save gave up: {record['error']}")
        elif ck is None or not ck["verified"] or ck["step"] != self.train_iters:
            self.violate(f"the job finished with final checkpoint {record.get('checkpoint')}, which "
                         f"{'does not verify' if ck else 'was never saved'}")
        self.log(f"finished at step {record.get('step')}: {record.get('checkpoint')}")

    def _exit(self, w: Worker, why: str) -> None:
        if w.phase not in ("finished", "failed"):
            w.phase = "exited"
        if w.link.server is not None and w.link.server.up:
            with contextlib.suppress(Exception):  # a stopped store misses it
                self._beat(w)  # its last word: gone on purpose
        w.alive, w.exit_reason = False, why
        self.log(f"{w.inc} exits: {why}")

    def _count(self, fault: str) -> None:
        self.fault_count[fault] = self.fault_count.get(fault, 0) + 1

