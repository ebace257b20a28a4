"""Drive a whole job on this machine: the real coordinator and workers as processes (CPU, gloo).

``live`` mode sends each event to the coordinator as a plan request (a spot notice, a join, a
config change) with ``switch_at_step`` set to the event's step, so the switch happens exactly
there. Workers run through ``held_worker.py``: each waits at every event's step until the driver
releases it, so events land on exact steps. A ``kill`` event waits until the victims are held
at their step, SIGKILLs their process groups from here, and only then releases the survivors,
leaving detection and recovery to the runtime. ``checkpoint`` mode makes the same changes the
way restart-based systems do: at the event's step every worker saves a megatron checkpoint and
exits, and new processes start under the new config and load it (a kill restarts everybody from
the last periodic checkpoint).

The report (``run.json``) has, per step, the loss, config, world size and consumed samples; per
event its kind, phase timings and downtime; and layout-independent checksums of the final state
per logical tensor, so runs can be compared bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from liveshard.dev.localrun.events import PLAN_KINDS, Event
from liveshard.dev.ports import free_port
from liveshard.runtime.contract.env import Env
from liveshard.runtime.contract.jobspec import AdaptivePolicy
from liveshard.runtime.contract.keys import SECRET_ENV, Keys
from liveshard.runtime.contract.training import TRAINING_ENV, TrainingSpec, read_training
from liveshard.runtime.data.batches import BatchPlan
from liveshard.runtime.errors import ConfigError, RunFailed, RunTimedOut, exit_text
from liveshard.runtime.lifeline import preexec
from liveshard.runtime.notice import NOTICES_ENV
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.planner import FEWEST_CHANGES, GPU, Constraints, ParallelPlan, plan_world
from liveshard.runtime.quiet import WARNINGS_ENV
from liveshard.runtime.spec import ModelSpec


class CoordinatorExited(RunFailed):
    """The coordinator process ended before its store answered."""

    def __init__(self, port: int, code: int | None, log: str) -> None:
        self.log = log
        super().__init__(f"the coordinator exited with {exit_text(code)} before serving 127.0.0.1:{port}"
                         + (f": {log.splitlines()[-1]}" if log else ""))


@dataclass
class RunSpec:
    spec: ModelSpec  # its params_dtype is the training's precision
    training: TrainingSpec  # what every worker trains (handed over as LIVESHARD_TRAINING)
    workers: int
    parallel: str
    events: list[Event]
    mode: str = "live"
    verify: bool = False
    preallocate: str = "auto"  # liveshard worker --preallocate
    build_world_ahead: str = "auto"  # liveshard worker --build-world-ahead
    pulse: bool = True  # liveshard worker --pulse (heartbeats from a process of their own) or --no-pulse
    checkpoint_every: int = 0
    # the job's spec.checkpoint, where the job file names it: the directory (None: WORKDIR/
    # checkpoints/periodic), the seconds between time-based saves and how many are kept
    checkpoint_dir: str | None = None
    checkpoint_interval_seconds: float | None = None
    checkpoint_keep: int | None = None
    heartbeat_timeout: float = 10.0
    collective_timeout: float = 20.0
    transition_timeout: float | None = None  # liveshard coordinator --transition-timeout (None: its default)
    workdir: str | None = None
    log: Any = None  # a file for progress lines (None: quiet)
    adaptive: AdaptivePolicy | None = None  # the coordinator's straggler policy (None: measure only)
    # > 1: every device emulated this many times slower than the CPU, by sleeping in proportion
    # to its compute (held_worker.Slowdown), so ranks stop competing for the cores (benchmarks)
    stretch: float = 1.0
    # A join whose generation aborts (a joiner taken for dead, a failed preparation, a timeout)
    # is requested again, up to this many tries in all, the first retry after join_backoff
    # seconds and each further one after twice the wait before it.
    join_attempts: int = 3
    join_backoff: float = 2.0
    # > 0: a kill at a step (``STEP:kill=R``) lands this many seconds after the step is released,
    # mid-way through the next step (the survivors are then in its collectives), not at its boundary
    kill_delay: float = 0.0

    @property
    def steps(self) -> int:
        return self.training.train_iters

    @property
    def global_batch(self) -> int:
        return self.training.global_batch

    @property
    def micro_batch(self) -> int:
        return self.training.micro_batch

    @staticmethod
    def mock(model: str, *, workers: int, parallel: str, steps: int, global_batch: int, events: list[Event],
             seq_length: int = 32, micro_batch: int = 1, lr: float = 1e-3, eval_interval: int = 0,
             precision: str | None = None, initial_loss_scale: float | None = None, **kw: Any) -> RunSpec:
        """A run on megatron's mock data with the short schedule tests and benchmarks use."""
        from liveshard.runtime.spec import load_model

        spec = load_model(model)
        training = read_training({
            "data": {"mock": True}, "trainIters": steps, "globalBatch": global_batch, "microBatch": micro_batch,
            "seqLength": seq_length, "precision": precision or spec.params_dtype,
            "optimizer": {"lr": lr, "minLr": lr / 10, "weightDecay": 0.0},
            "schedule": {"warmupIters": 2, "decayIters": 1000},
            "eval": {"interval": eval_interval, "iters": 2},
            **({"initialLossScale": initial_loss_scale} if initial_loss_scale else {})})
        return RunSpec(spec=replace(spec, params_dtype=training.precision), training=training, workers=workers,
                       parallel=parallel, events=events, **kw)


@dataclass
class Procs:
    coordinator: subprocess.Popen | None = None
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)

    def kill_all(self) -> None:
        # Each process leads its own process group: what it started (megatron's checkpoint
        # writer and its multiprocessing manager) goes with it, even after the leader exited.
        for p in [*self.workers.values(), self.coordinator]:
            if p is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in [*self.workers.values(), self.coordinator]:
            if p is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)


# Phases only the new members of a reconfiguration pass (the others never hold there).
NEW_MEMBER_PHASES = ("connect", "built", "commit-window")


def _cli() -> list[str]:
    return [sys.executable, "-m", "liveshard.runtime.cli"]


def _held_worker_cli() -> list[str]:
    """``liveshard worker`` with ``--hold-at-steps`` (dev tooling: ``held_worker.py``)."""
    return [sys.executable, "-m", "liveshard.dev.localrun.held_worker"]


def plan_local_world(run: RunSpec, current: ParallelConfig, workers: list[str]) -> ParallelPlan:
    """The world the coordinator would choose for ``workers`` (checkpoint mode uses it to make
    the same changes the restart way): the planner's ``fewest-changes`` objective."""
    gpus = [GPU(id=w, node="local", memory_bytes=80 << 30) for w in workers]
    constraints = Constraints(global_batch=run.global_batch, micro_batch=run.micro_batch, dist_opt=current.dist_opt,
                              objective=FEWEST_CHANGES)
    return plan_world(run.spec, gpus, constraints, current=current)


def check_run(run: RunSpec) -> ParallelConfig:
    """Everything about ``run`` that can be judged before a process starts (the start config and
    every event against the model, the batch and the workers there will be), by the runtime's own
    rules (``ParallelConfig.validate``, ``BatchPlan``, the planner's ``plan_world``): ConfigError
    naming the first problem. The start config."""
    cfg = ParallelConfig.parse(run.parallel)
    cfg.validate(run.spec)
    # The coordinator would refuse a first world whose batch does not split: say so now.
    BatchPlan(run.global_batch, run.micro_batch, cfg.dp, cfg.dp_split)
    if run.workers < 1:
        raise ConfigError("--workers", f"must be >= 1, got {run.workers}", "give the number of local workers")
    if cfg.world_size > run.workers:
        raise ConfigError("--parallel", f"{cfg} needs {cfg.world_size} workers, --workers is {run.workers}")
    if not run.stretch >= 1.0 or run.stretch == float("inf"):
        raise ConfigError("--stretch", f"must be a finite number >= 1, got {run.stretch!r}", "1 (off) or more, e.g. 4")
    if run.mode == "checkpoint" and any(e.kind == "kill" for e in run.events) and not run.checkpoint_every:
        raise ConfigError("--checkpoint-every", "a kill in checkpoint mode needs periodic checkpoints",
                          "set --checkpoint-every N")
    alive, frozen = run.workers, 0  # workers of the job at each event, if every event goes as asked
    world: int | None = cfg.world_size  # ranks of the world then, where no planner choice decides it
    for ev in run.events:
        if ev.kind == "slow" and max(ev.ranks) >= run.workers:
            raise ConfigError("--events", f"{ev} names device {max(ev.ranks)}, the run starts {run.workers}",
                              "name a device of the first world: 0 .. --workers - 1")
        if run.adaptive is not None and run.adaptive.enabled and ev.kind != "slow":
            # the policy switches between the driver's events; a scripted change would race it
            raise ConfigError("--events", f"{ev}: an --adaptive run takes only slow events",
                              "drop --adaptive, or script only slow=R@F events")
        ranks = world if world is not None else alive
        if ev.kind in ("leave", "kill", "sigstop") and ev.ranks and max(ev.ranks) >= ranks:
            raise ConfigError("--events", f"{ev} names rank {max(ev.ranks)}, the world has {ranks} rank(s) then",
                              f"name ranks of the world at step {ev.step}: 0 .. {ranks - 1}")
        if ev.kind in PLAN_KINDS:
            world = None  # the coordinator's planner chooses the next world
        if ev.kind == "kill" and ev.phase:
            continue  # armed for a phase of the next change: its victim is one of that change's members
        if ev.kind in ("leave", "kill", "sigstop"):
            alive -= len(ev.ranks) + len(ev.joiners)
            frozen += len(ev.ranks) if ev.kind == "sigstop" else 0
            if alive < 1 and ev.kind != "kill":
                raise ConfigError("--events", f"{ev} leaves no worker to train", "keep at least one worker")
        elif ev.kind == "sigcont":
            alive, frozen = alive + frozen, 0
        elif ev.kind == "join":
            alive += ev.count
        elif ev.kind == "parallel":
            world = _check_parallel_event(run, ev, alive)
    return cfg


def _check_parallel_event(run: RunSpec, ev: Event, workers: int) -> int:
    """A ``parallel=`` event's config, as the coordinator would plan it on ``workers`` workers;
    its world size."""
    from liveshard.runtime.coordinator.requests import PlanningInputs
    from liveshard.runtime.planner.search import NoFeasiblePlan

    assert ev.config is not None
    try:
        cfg = ParallelConfig.parse(ev.config)
        cfg.validate(run.spec)
        if cfg.world_size > workers:
            raise ConfigError("parallel", f"needs {cfg.world_size} workers, the job has {workers} at that step")
        BatchPlan(run.global_batch, run.micro_batch, cfg.dp, cfg.dp_split)
        gpus = [GPU(id=f"w{i}", node="local", memory_bytes=PlanningInputs.gpu_memory_bytes) for i in range(workers)]
        plan_world(run.spec, gpus, Constraints(global_batch=run.global_batch, micro_batch=run.micro_batch,
                                               objective=FEWEST_CHANGES), config=cfg)
    except ConfigError as e:
        raise ConfigError("--events", f"{ev}: {e.field}: {e.problem}",
                          e.fix or "give a config this model and worker count can take") from None
    except NoFeasiblePlan as e:
        raise ConfigError("--events", f"{ev}: {e}", "give a config this model and worker count can take") from None
    return cfg.world_size


def last_log_line(log: Path, limit: int = 240) -> str:
    """The last line a process logged that says something (a traceback's last line is its error)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 16384))
            lines = [x.strip() for x in f.read().decode("utf-8", "replace").splitlines() if x.strip()]
    except OSError:
        return ""
    text = lines[-1] if lines else ""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _refusals(status: dict) -> list[dict]:
    """The plan requests the coordinator refused, oldest first (its history's ``rejected`` entries)."""
    return [h for h in status.get("history", [])
            if h.get("generation") is None and str(h.get("outcome", "")).startswith("rejected")]


class LocalRun:
    def __init__(self, run: RunSpec) -> None:
        self.secret = secrets.token_hex(32).encode()
        # this run's incarnation: bound into the store's MACs and recorded in every checkpoint
        # (a later run on the same directory does not continue this one by accident)
        self.run_id = secrets.token_hex(6)
        self.run = run
        self.cfg = check_run(run)
        self.dir = Path(run.workdir or tempfile.mkdtemp(prefix="liveshard-run-"))
        # where every checkpoint of the run goes (the job's spec.checkpoint.path when it names one)
        self.checkpoint_dir = Path(run.checkpoint_dir) if run.checkpoint_dir else self.dir / "checkpoints" / "periodic"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.notices = self.dir / "notices.jsonl"  # every process of the run appends its notices here
        self.procs = Procs()
        self.started = time.time()
        self.history: dict[int, dict] = {}
        self.armed: list[str] = []  # workers to kill at a phase of the next reconfiguration
        self.armed_at: str | None = None
        self.coordinator_armed_at: str | None = None  # kill the coordinator at this phase of the next change
        self._reissue_ready: dict[int, float] = {}  # a re-issued change: when its members had connected
        self.stopped: list[str] = []  # frozen (SIGSTOP) workers
        self.restarts = 0  # restart=all events so far
        self.faults: list[dict] = []  # per phase kill: what happened, how long the recovery took
        self.signalled_at: dict[int, float] = {}  # per kill (or SIGSTOP) at a step: when it was sent
        self.final_status: dict | None = None  # the coordinator's last status (health, decisions)
        self._fault_generations: set[int] = set()  # recoveries after a phase kill (no event of their own)
        self.join_retries: dict[int, list[dict]] = {}  # per join event's step: its aborted tries
        self._retried_generations: set[int] = set()  # those tries' generations (no event of their own)
        self._released_early: set[int] = set()  # hold steps released for a retried join
        self._posted: Any = None  # the newest PlanRequest this driver posted
        self._refusals_before = 0  # refusals the coordinator had reported when it was posted

    def refuse_foreign_checkpoints(self) -> None:
        """A checkpoint directory holding an earlier run's checkpoints (a reused --workdir) is
        refused unless spec.training.resume names where this run starts from (ConfigError)."""
        from liveshard.runtime.contract.checkpoint import JobIdentity, foreign_run

        if self.run.training.resume:
            return
        field = "spec.checkpoint.volume.hostPath.path" if self.run.checkpoint_dir else "--workdir"
        env = {Env.JOB_INCARNATION: self.run_id}
        refused = foreign_run(self.checkpoint_dir, JobIdentity.from_env(env), field,
                              "give this run an empty directory (another --workdir)")
        if refused is not None:
            raise refused

    # ---- processes ---------------------------------------------------------------------------
    def _env(self) -> dict:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        env[SECRET_ENV] = self.secret.decode()  # this run's store is authenticated like a job's
        env[NOTICES_ENV] = str(self.notices)  # what the console must say (a damaged checkpoint, a resume)
        env[WARNINGS_ENV] = str(self.dir / "warnings.log")  # third-party warnings: there, once each
        env[Env.JOB_INCARNATION] = self.run_id
        # What to train, handed over as the operator hands it to a job's pods.
        env[Env.MODEL] = json.dumps(self.run.spec.to_dict(), sort_keys=True)
        env[TRAINING_ENV] = self.run.training.to_json()
        return env

    def _logfile(self, name: str):
        return open(self.dir / f"{name}.log", "ab")

    def start_coordinator(self, port: int) -> None:
        r = self.run
        base = [*_cli(), "coordinator"]
        if r.transition_timeout is not None:
            base += ["--transition-timeout", str(r.transition_timeout)]
        cmd = [*base, "--host", "127.0.0.1", "--port", str(port),
               "--heartbeat-timeout", str(r.heartbeat_timeout), "--objective", FEWEST_CHANGES,
               "--checkpoint-dir", str(self.checkpoint_dir)]
        a = r.adaptive
        if a is not None:
            cmd += ["--adaptive-threshold", str(a.threshold), "--adaptive-window", str(a.window),
                    "--adaptive-horizon", str(a.horizon), "--adaptive-min-gain", str(a.min_gain),
                    "--adaptive-probation", str(a.probation), *(["--adaptive"] if a.enabled else [])]
        # its own process group (a kill ends what it started too), and SIGKILLed by the kernel
        # if this process dies (lifeline): no coordinator outlives its run
        self.procs.coordinator = subprocess.Popen(cmd, stdout=self._logfile("coordinator"), stderr=subprocess.STDOUT,
                                                  env=self._env(), start_new_session=True, preexec_fn=preexec())

    def start_worker(self, wid: str, port: int, *, extra: list[str] | None = None,
                     holds: tuple[int, ...] = ()) -> None:
        """Start worker ``wid``; with ``holds`` it waits at those steps until released. It trains
        to trainIters and saves the final checkpoint there."""
        r = self.run
        safe = wid.replace("/", "_")
        held = bool(holds) or r.stretch > 1.0
        base = [*_held_worker_cli(), "--hold-at-steps", ",".join(map(str, holds))] if held else [*_cli(), "worker"]
        if holds and any(e.phase for e in r.events):
            base.append("--phase-holds")
        if held and (r.stretch > 1.0 or any(e.kind == "slow" for e in r.events)):
            base += ["--slowdown", "--stretch", repr(r.stretch)]
        cmd = [*base, "--id", wid, "--coordinator", f"127.0.0.1:{port}", "--collective-timeout", str(r.collective_timeout),
               "--result", str(self.dir / f"{safe}.json"), "--step-log", str(self.dir / f"{safe}.steps.jsonl"),
               "--procs", "1", *(extra or [])]
        # Safety checkpoints (every --checkpoint-every steps) and the checkpoint a stop saves.
        # Background saves complete one step after they start: a scripted run is reproducible.
        cmd += ["--checkpoint-dir", str(self.checkpoint_dir), "--checkpoint-finalize-steps", "1"]
        if r.checkpoint_every:
            cmd += ["--checkpoint-every", str(r.checkpoint_every)]
        if r.checkpoint_interval_seconds is not None:
            cmd += ["--checkpoint-interval-seconds", repr(float(r.checkpoint_interval_seconds))]
        if r.checkpoint_keep is not None:
            cmd += ["--checkpoint-keep", str(r.checkpoint_keep)]
        if r.verify:
            cmd.append("--verify")
        cmd += ["--preallocate", r.preallocate, "--build-world-ahead", r.build_world_ahead]
        if not r.pulse:
            cmd.append("--no-pulse")
        self.procs.workers[wid] = subprocess.Popen(cmd, stdout=self._logfile(safe), stderr=subprocess.STDOUT,
                                                   env=self._env(), start_new_session=True, preexec_fn=preexec())

    def connect(self, port: int, timeout: float = 120.0):
        """The job's store at ``port``, served by the coordinator process: retried while that
        process lives (a loaded machine takes a while to import torch), ``CoordinatorExited``
        at once when it has exited, ``RunFailed`` after ``timeout``."""
        from liveshard.runtime.control.store import JobStore, connect_store

        end = time.monotonic() + timeout
        while True:
            coordinator = self.procs.coordinator
            if coordinator is not None and coordinator.poll() is not None:
                raise CoordinatorExited(port, coordinator.returncode, self._log_tail("coordinator"))
            try:
                # a plain TCP probe first: c10d logs every failed try with a C++ stack trace
                socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
                return JobStore(connect_store("127.0.0.1", port, timeout=5.0), secret=self.secret,
                                incarnation=self.run_id)
            except Exception as e:
                if time.monotonic() > end:
                    raise RunFailed(f"the coordinator's store at 127.0.0.1:{port} did not answer in {timeout:.0f} s "
                                    f"({type(e).__name__}; see {self.dir / 'coordinator.log'})") from None
                time.sleep(0.2)

    def serve(self, attempts: int = 3) -> tuple[int, Any]:
        """Start a coordinator on a free port and connect to its store: ``(port, store)``. A port
        found free can be taken before the coordinator binds it (the ephemeral range is shared
        with every connection on the machine): then the next attempt takes another one."""
        for attempt in range(1, attempts + 1):
            port = free_port()
            self.start_coordinator(port)
            try:
                return port, self.connect(port)
            except CoordinatorExited as e:
                if attempt == attempts or "address already in use" not in e.log.lower():
                    raise RunFailed(str(e)) from None
                self.say(f"port {port} was taken before the coordinator bound it; another port")
        raise AssertionError("unreachable")

    def _log_tail(self, name: str, lines: int = 5) -> str:
        try:
            text = (self.dir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def say(self, text: str) -> None:
        if self.run.log is not None:
            print(f"[{time.time() - self.started:7.1f}s] {text}", file=self.run.log, flush=True)

    # ---- live mode ---------------------------------------------------------------------------
    def run_live(self) -> dict:
        from liveshard.runtime.coordinator import PlanRequest

        r = self.run
        port, store = self.serve()
        ids = [f"w{i}" for i in range(r.workers)]
        joiners = [f"w{r.workers + i}" for i in range(sum(e.count for e in r.events if e.kind == "join"))]
        # Joiners start now: imports and megatron set-up happen before they are admitted.
        holds = tuple(e.step for e in r.events)
        for wid in ids + joiners:
            self.start_worker(wid, port, holds=holds)
        # A plan names registered workers only (a worker registers once its imports and datasets
        # are ready, which on a loaded machine can take longer than the coordinator's grace).
        self.say(f"coordinator up on port {port}; waiting for {len(ids)} workers to register")
        self._wait_registered(store, ids)
        self._post(store, PlanRequest(members=tuple(ids), config=str(self.cfg), reason="start"))
        self.say(f"started {len(ids)} workers ({len(joiners)} joiners waiting), config {self.cfg}; "
                 f"checkpoints in {self.checkpoint_dir}")
        next_joiner = 0
        status = self._wait_first_world(store, "the first world")
        for ev in r.events:
            cur_members = tuple(status["members"])
            standbys = [m for m in status.get("standbys", [])]
            gen = status["generation"]
            # the next plan's generation (aborted generations of earlier faults count too)
            nxt = store.latest_generation() + 1
            if ev.kind == "coordinator":
                self.procs.coordinator.send_signal(signal.SIGKILL)
                self.procs.coordinator.wait()
                self.say(f"step {ev.step}: coordinator killed; starting a new one")
                self.start_coordinator(port)
                store = self.connect(port)
                status = self._wait_adopted(store, gen)
                store.set(Keys.release(ev.step), "1")
                continue
            if ev.kind == "stop":
                config_before = status["config"]
                self._apply(store, PlanRequest(members=(), config="", reason="stop", switch_at_step=ev.step),
                            nxt, ev.step, f"step {ev.step}: stop (checkpoint, every worker waits)", f"event {ev}")
                status = self._apply(store, PlanRequest(members=cur_members + tuple(standbys), config=config_before,
                                                        reason="resume after the stop"),
                                     nxt + 1, None, f"resume: {config_before} from the checkpoint",
                                     f"resuming after {ev}")
                continue
            if ev.kind == "kill" and ev.coordinator:
                self.coordinator_armed_at = ev.phase
                for wid in (*ids, *joiners):  # whoever of them passes the phase next holds there
                    store.set(Keys.hold_phase(wid), ev.phase)
                store.set(Keys.release(ev.step), "1")
                self.say(f"step {ev.step}: the coordinator to be killed at phase {ev.phase} of the next change")
                continue
            if ev.kind == "kill" and ev.phase:
                self.armed = [cur_members[rank] for rank in ev.ranks] + [joiners[next_joiner + k - 1] for k in ev.joiners]
                self.armed_at = ev.phase
                for wid in self.armed:
                    store.set(Keys.hold_phase(wid), ev.phase)
                store.set(Keys.release(ev.step), "1")
                self.say(f"step {ev.step}: {', '.join(self.armed)} to be killed at phase {ev.phase} of the next change")
                continue
            if ev.kind == "slow":
                # at the step exactly: a member reads its speed at every step boundary, so the
                # value is written only once it is held there (a standby reads it when it trains)
                for r in ev.ranks:
                    self._wait_held(store, f"w{r}" if f"w{r}" in cur_members else None, ev.step)
                    store.set(Keys.slowdown(f"w{r}"), repr(ev.factor))
                store.set(Keys.release(ev.step), "1")
                self.say(f"step {ev.step}: device(s) {', '.join(f'w{r}' for r in ev.ranks)} at {ev.factor:g} of their speed")
                continue
            if ev.kind == "restart":
                status = self._restart_everything(store, ev, port, cur_members, tuple(standbys), status["config"])
                store = self.connect(port)
                continue
            if ev.kind == "sigstop":
                victims = [cur_members[rank] for rank in ev.ranks]
                self.kill_at_step(store, victims, ev.step, sig=signal.SIGSTOP)
                self.stopped += victims
                self.say(f"step {ev.step}: SIGSTOP of rank(s) {list(ev.ranks)} ({', '.join(victims)})")
                status = self._wait_generation(store, nxt)
                continue
            if ev.kind == "sigcont":
                status = self._resume_stopped(store, ev, nxt, cur_members + tuple(standbys))
                continue
            if ev.kind == "kill":
                self.kill_at_step(store, [cur_members[rank] for rank in ev.ranks], ev.step, delay=self.run.kill_delay)
                self.say(f"step {ev.step}: kill -9 of rank(s) {list(ev.ranks)} "
                         f"({', '.join(cur_members[k] for k in ev.ranks)}) without notice")
                status = self._wait_generation(store, nxt)
                continue
            if ev.kind == "leave":
                gone = {cur_members[i] for i in ev.ranks}
                members = tuple(m for m in cur_members if m not in gone) + tuple(standbys)
                request = PlanRequest(members=members, reason=f"spot notice for rank(s) {list(ev.ranks)}",
                                      switch_at_step=ev.step)
            elif ev.kind == "join":
                new = joiners[next_joiner: next_joiner + ev.count]
                next_joiner += ev.count
                request = PlanRequest(members=cur_members + tuple(standbys) + tuple(new),
                                      reason=f"{ev.count} worker(s) joined", switch_at_step=ev.step)
                if not self.armed and self.coordinator_armed_at is None:
                    status = self._join(store, request, nxt, ev, tuple(new))
                    continue
            else:
                request = PlanRequest(members=cur_members + tuple(standbys), config=ev.config,
                                      reason=f"config change to {ev.config}", switch_at_step=ev.step,
                                      ordered=False)
            # A leave or a join leaves the config to the coordinator, which asks the planner
            # (world.plan_world, objective fewest-changes: the same call checkpoint mode makes).
            if self.armed:
                status = self._apply_with_kills(store, request, nxt, ev)
                continue
            if self.coordinator_armed_at is not None:
                status, store = self._apply_with_coordinator_kill(store, request, nxt, ev, port)
                continue
            status = self._apply(store, request, nxt, ev.step,
                                 f"step {ev.step}: {ev.kind} -> {request.config or 'planned'} ({request.reason})",
                                 f"event {ev}")
        status = self._wait_final_world(store)
        self._wait_workers(timeout=600, only=tuple(status.get("members") or ()))
        self.final_status = self._status(store)  # before the stop: the coordinator's store goes with it
        store.set(Keys.STOP, "1")
        try:
            self.procs.coordinator.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.procs.coordinator.kill()
        return self._report([self.history[g] for g in sorted(self.history)])

    def _wait_final_world(self, store, timeout: float = 600.0) -> dict:
        """The coordinator's status once no generation is pending and the members of the world
        it runs have exited (trained to trainIters): the straggler policy may have switched
        worlds since the last event."""
        end = time.monotonic() + timeout
        while True:
            st = self._status(store)
            members = st.get("members") or ()
            if st.get("pending") is None and (st.get("finished") or all(
                    self.procs.workers[m].poll() is not None for m in members if m in self.procs.workers)):
                return st
            if time.monotonic() > end:
                raise RunTimedOut(f"the final world did not finish in {timeout:.0f} s")
            self._check_alive(st)
            time.sleep(0.1)

    def _apply(self, store, request, gen: int, release_step: int | None, message: str, what: str) -> dict:
        """Post ``request``, release the workers held at ``release_step`` once it is published as
        generation ``gen``, and wait for that generation to commit; the coordinator's status."""

        self._post(store, request)
        self._wait_published(store, gen)
        if release_step is not None:
            store.set(Keys.release(release_step), "1")
        self.say(message)
        status = self._wait_generation(store, gen)
        if status.get("last_outcome") != "committed":
            raise RunFailed(f"{what} ended {status.get('last_outcome')}")
        return status

    def _join(self, store, request, gen: int, ev: Event, new: tuple[str, ...]) -> dict:
        """Apply a join. A generation that aborts costs the joiners a try, not the run: once every
        joiner is back (taken for dead, it rejoins as a new member) and the world trains again,
        the join is requested again, up to ``RunSpec.join_attempts`` tries with doubling back-off
        (``join_backoff``). A join that never commits fails the run, with each try's outcome."""

        r = self.run
        tries: list[dict] = []
        release: int | None = ev.step
        self._wait_registered(store, new)
        for attempt in range(1, r.join_attempts + 1):
            self._post(store, request)
            self._wait_published(store, gen)
            if release is not None:
                store.set(Keys.release(release), "1")
            self.say(f"step {ev.step}: join -> {request.config or 'planned'} ({request.reason}, "
                     f"switch at step {request.switch_at_step})")
            # A retry switches at the step after the one the world had reached when it was asked
            # (the members wait there until they have prepared it, as at an event's step), at the
            # latest at the next event's step: a hold there must not keep it from that boundary.
            status = self._wait_generation(store, gen, while_waiting=None if release is not None else (
                lambda st: self._release_next_hold(store, st, ev.step)))
            outcome = (self.history.get(gen) or {}).get("outcome") or status.get("last_outcome")
            if outcome == "committed":
                if tries:
                    self.join_retries[ev.step] = tries
                return status
            tries.append({"generation": gen, "outcome": outcome})
            self._retried_generations.add(gen)
            if attempt == r.join_attempts:
                break
            pause = r.join_backoff * 2 ** (attempt - 1)
            self.say(f"the join of {', '.join(new)} (generation {gen}) ended {outcome}; "
                     f"try {attempt + 1} of {r.join_attempts} in {pause:g} s")
            time.sleep(pause)
            status = self._wait_joinable(store, new, ev)
            # the step after the world's, or the next event's step where it is held already
            step = int((status.get("progress") or {}).get("step") or ev.step) + 1
            step = min([step, *(e.step for e in r.events if e.step > ev.step)])
            request = replace(request, members=(*status["members"], *status.get("standbys", []), *new),
                              switch_at_step=step, reason=f"{ev.count} worker(s) joined (try {attempt + 1})")
            gen = store.latest_generation() + 1
            release = None
        raise RunFailed(f"event {ev}: the join of {', '.join(new)} did not commit in {len(tries)} tries: "
                           + "; ".join(f"generation {t['generation']} {t['outcome']}" for t in tries))

    def _wait_registered(self, store, wids: list[str] | tuple[str, ...], timeout: float = 600.0) -> None:
        """Wait until every worker of ``wids`` has registered with the coordinator."""
        end = time.monotonic() + timeout
        while missing := sorted(set(wids) - set(store.members())):
            exited = [m for m in missing if self.procs.workers[m].poll() is not None]
            if exited:
                raise RunFailed(f"{self._ended(exited[0], 'before registering')} (see {self.dir})")
            if time.monotonic() > end:
                raise RunTimedOut(f"{', '.join(missing)} did not register in {timeout:.0f} s (see {self.dir})")
            self._check_alive()
            time.sleep(0.1)

    def _ended(self, wid: str, when: str = "") -> str:
        """How worker ``wid`` ended, in one line: ``w1 exited with signal SIGKILL``, ``w2 exited
        with exit code 3 before step 4: <the last line it logged>``; a worker that refused its
        input (exit 2) is named with its own error line: ``w0 refused the job: spec.training...``."""
        code = self.procs.workers[wid].poll()  # it has ended: its exit status
        line = last_log_line(self.dir / f"{wid.replace('/', '_')}.log", limit=600) if code and code > 0 else ""
        refused = re.match(r"liveshard [\w-]+: error: (.*)", line)
        if code == 2 and refused:  # EXIT_BAD_INPUT: the worker's one line says what and why
            return f"{wid} refused the job ({exit_text(code)}" + (f", {when}" if when else "") + f"): {refused[1]}"
        return f"{wid} exited with {exit_text(code)}" + (f" {when}" if when else "") + (f": {line}" if line else "")

    def _wait_joinable(self, store, new: tuple[str, ...], ev: Event, timeout: float = 180.0) -> dict:
        """After an aborted join: wait until no generation is pending, no joiner is dead (each
        found itself excluded and came back as a new member, ``WorkerAgent.rejoin``) and every
        member of the running world trains (a generation aborted after its vote leaves it broken
        until the coordinator's recovery commits); the coordinator's status."""
        end = time.monotonic() + timeout
        while True:
            st = self._status(store)
            exited = [m for m in new if self.procs.workers[m].poll() is not None]
            if exited:
                raise RunFailed(f"event {ev}: {self._ended(exited[0], 'after the join aborted')} "
                                   f"(see {self.dir})")
            if st.get("finished"):
                raise RunFailed(f"event {ev}: training finished before the join of {', '.join(new)} committed")
            telemetry = st.get("telemetry") or {}
            members = st.get("members") or []
            if (st.get("pending") is None and not set(new) & set(st.get("dead") or ())
                    and all((telemetry.get(m) or {}).get("state") == "training" for m in members)):
                return st
            if time.monotonic() > end:
                waiting = sorted(set(new) & set(st.get("dead") or ()))
                raise RunTimedOut(f"event {ev}: after the aborted join, "
                                   + (f"{', '.join(waiting)} did not come back as new members"
                                      if waiting else "the world did not train again") + f" in {timeout:.0f} s")
            self._check_alive(st)
            time.sleep(0.05)

    def _release_next_hold(self, store, st: dict, after: int) -> None:
        """Release the first hold step after ``after`` once every member of the running world is
        held there: a retried change switches at that boundary at the latest, and would wait for
        it forever. The event of that step then lands at the first boundary after it."""
        step = min((e.step for e in self.run.events if e.step > after), default=None)
        members = st.get("members") or []
        if step is None or step in self._released_early or not members:
            return
        if all(store.get(Keys.held(step, m)) is not None for m in members):
            store.set(Keys.release(step), "1")
            self._released_early.add(step)
            self.say(f"step {step} released early: the retried join waits for a step boundary")

    def _apply_with_kills(self, store, request, gen: int, ev, timeout: float = 300.0) -> dict:
        """Post ``request`` and kill each armed victim when it is held at the armed phase of
        that reconfiguration; then wait until the job trains again without them (the
        generation committed without them, or a recovery after it did)."""

        victims, phase = self.armed, self.armed_at
        self.armed, self.armed_at = [], None
        self._post(store, request)
        self._wait_published(store, gen)
        store.set(Keys.release(ev.step), "1")
        self.say(f"step {ev.step}: {ev.kind} ({request.reason}); killing {', '.join(victims)} at phase {phase}")
        end = time.monotonic() + timeout
        killed: dict[str, float] = {}
        while len(killed) < len(victims):
            for wid in victims:
                if wid not in killed and store.get(Keys.at_phase(wid)) is not None:
                    proc = self.procs.workers[wid]
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=60)
                    killed[wid] = time.time()
                    self.say(f"{wid} killed at phase {phase} of generation {gen}")
            if time.monotonic() > end:
                raise RunTimedOut(f"{', '.join(set(victims) - set(killed))} never reached phase {phase}")
            self._check_alive()
            time.sleep(0.005)
        t_kill = max(killed.values())
        while True:
            # recovered: the generation is decided, and a world without the victims trains past
            # the step (the old one, if the generation aborted before its vote; else a recovery)
            st = self._status(store)
            hist = [h for h in st.get("history", []) if h.get("generation") is not None and h["generation"] >= gen]
            if (st.get("pending") is None and hist and not set(victims) & set(st.get("members") or ())
                    and ((st.get("progress") or {}).get("step") or 0) > ev.step):
                break
            if time.monotonic() > end:
                raise RunTimedOut(f"the job did not recover from the kill at phase {phase} in {timeout:.0f} s")
            self._check_alive(st)
            time.sleep(0.05)
        recovered = time.time()
        self.faults.append({"event": f"kill={','.join(victims)}@{phase}", "step": ev.step, "phase": phase,
                            "victims": victims, "generations": [{"generation": h["generation"], "outcome": h["outcome"],
                                                                 "reason": h.get("reason")} for h in hist],
                            "recovery_seconds": recovered - t_kill})
        self._fault_generations.update(h["generation"] for h in hist[1:])
        self.say(f"recovered in {recovered - t_kill:.1f} s: generation {st['generation']} ({st['config']}); "
                 + "; ".join(f"{h['generation']}: {h['outcome']}" for h in hist))
        return st

    def _apply_with_coordinator_kill(self, store, request, gen: int, ev, port: int,
                                     timeout: float = 300.0) -> tuple[dict, Any]:
        """Post ``request``; once every process of that reconfiguration that passes the armed
        phase is held there, kill the coordinator and start a new one on the same address (as
        Kubernetes restarts its pod); then wait until the job trains in the requested world (the
        generation committed, or aborted and asked again by the new coordinator). The status, and
        a client of the new coordinator's store."""
        from liveshard.runtime.control.protocol import transition_members

        phase, self.coordinator_armed_at = self.coordinator_armed_at, None
        self._post(store, request)
        self._wait_published(store, gen)
        gen = store.latest_generation()  # ``gen`` is the least it can be (a restarted coordinator skips numbers)
        plan = store.plan(gen)
        old = store.plan(plan.previous) if plan.previous is not None else None
        # only the new members build and vote; every process of the transition passes the rest
        holders = plan.members if phase in NEW_MEMBER_PHASES or old is None else transition_members(old, plan)
        store.set(Keys.release(ev.step), "1")
        self.say(f"step {ev.step}: {ev.kind} ({request.reason}); killing the coordinator when "
                 f"{', '.join(holders)} are at phase {phase}")
        end = time.monotonic() + timeout
        while any(store.get(Keys.at_phase(w)) != f"{phase}:{gen}" for w in holders):
            if time.monotonic() > end:
                late = [w for w in holders if store.get(Keys.at_phase(w)) != f"{phase}:{gen}"]
                raise RunTimedOut(f"{', '.join(late)} never reached phase {phase} of generation {gen}")
            self._check_alive()
            for w in holders:
                if self.procs.workers[w].poll() is not None:
                    raise RunFailed(f"{self._ended(w, f'before phase {phase}')} (see {self.dir})")
            time.sleep(0.005)
        coordinator = self.procs.coordinator
        with contextlib.suppress(ProcessLookupError):
            os.killpg(coordinator.pid, signal.SIGKILL)
        coordinator.wait(timeout=60)
        t_kill = time.time()
        self.say(f"coordinator killed at phase {phase} of generation {gen}; starting a new one")
        self.start_coordinator(port)
        store = self.connect(port)
        # the steps released so far were released in the old store: a worker not past them yet
        # (the preparation runs ahead of training) reads the new one
        for e in self.run.events:
            if e.step <= ev.step:
                store.set(Keys.release(e.step), "1")
        while True:
            # recovered: the new coordinator runs the requested world, no generation is pending
            # and training went on past the event's step
            st = self._status(store)
            hist = [h for h in st.get("history", []) if h.get("generation") is not None and h["generation"] >= gen]
            if (st.get("pending") is None and st.get("config") == plan.config
                    and tuple(st.get("members") or ()) == plan.members
                    and ((st.get("progress") or {}).get("step") or 0) > ev.step):
                break
            if time.monotonic() > end:
                raise RunTimedOut(f"the job did not come back to {plan.config} on {', '.join(plan.members)} after "
                                   f"the coordinator was killed at phase {phase} in {timeout:.0f} s")
            self._check_alive(st)
            self._release_for_reissue(store, st, ev.step)
            time.sleep(0.05)
        recovered = time.time()
        applied = st["generation"]
        self.faults.append({"event": f"kill=coordinator@{phase}", "step": ev.step, "phase": phase,
                            "victims": ["coordinator"], "asked": gen, "applied": applied,
                            "generations": [{"generation": h["generation"], "outcome": h["outcome"],
                                             "reason": h.get("reason")} for h in hist],
                            "recovery_seconds": recovered - t_kill})
        # the event's change is the generation that applied it; the others were steps towards it
        self._fault_generations.update(h["generation"] for h in hist if h["generation"] != applied)
        self.say(f"back in {recovered - t_kill:.1f} s: generation {applied} ({st['config']}); "
                 + "; ".join(f"{h['generation']}: {h['outcome']}" for h in hist))
        return st, store

    def _release_for_reissue(self, store, st: dict, after: int, settle: float = 2.0) -> None:
        """A change the restarted coordinator asked for again has no switch step: it switches at
        the first step boundary where every member has prepared it. The members held at a later
        event's step are let go once every new member of that plan has connected its transition
        (``Keys.connecting``: what is left of its preparation takes well under ``settle``
        seconds), so that they switch there instead of training past the change."""
        gen = st.get("pending")
        plan = store.plan(gen) if gen is not None else None
        if plan is None or not all(store.get(Keys.connecting(gen, m)) is not None for m in plan.members):
            return
        first = self._reissue_ready.setdefault(gen, time.monotonic())
        if time.monotonic() - first >= settle:
            self._release_next_hold(store, st, after)

    def _restart_everything(self, store, ev, port: int, members: tuple[str, ...], standbys: tuple[str, ...],
                            config: str) -> dict:
        """Every process of the job gone at once (a whole spot pool, a cluster restart): kill the
        workers held at the step and the coordinator, start new ones on the same checkpoint
        directory. The new coordinator's first world continues the newest complete checkpoint."""
        from liveshard.runtime.coordinator import PlanRequest

        for wid in standbys:  # not training, so never held at a step: killed as they are
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.procs.workers[wid].pid, signal.SIGKILL)
        self.kill_at_step(store, list(members), ev.step)
        self.procs.coordinator.send_signal(signal.SIGKILL)
        self.procs.coordinator.wait()
        self.restarts += 1
        self.say(f"step {ev.step}: coordinator and every worker killed; starting new ones")
        self.start_coordinator(port)
        store = self.connect(port)
        fresh = tuple(f"{m}r{self.restarts}" for m in members)  # new processes: new ids, new result files
        holds = tuple(e.step for e in self.run.events if e.step > ev.step)
        for wid in fresh:
            self.start_worker(wid, port, holds=holds)
        self._wait_registered(store, fresh)
        self._post(store, PlanRequest(members=fresh, config=config, reason="start after a restart"))
        return self._wait_first_world(store, "the restarted job")

    def _resume_stopped(self, store, ev, gen: int, members: tuple[str, ...], timeout: float = 120.0) -> dict:
        """SIGCONT every frozen worker, wait until the coordinator counts each as a new member
        (it found itself excluded and rejoined), then admit them as a join at this step."""
        from liveshard.runtime.coordinator import PlanRequest

        back, self.stopped = self.stopped, []
        for wid in back:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.procs.workers[wid].pid, signal.SIGCONT)
        self.say(f"step {ev.step}: SIGCONT of {', '.join(back)}")
        end = time.monotonic() + timeout
        while set(back) & set(self._status(store).get("dead") or ()):
            if time.monotonic() > end:
                raise RunTimedOut(f"{', '.join(back)} did not come back as new members in {timeout:.0f} s")
            self._check_alive()
            time.sleep(0.05)
        request = PlanRequest(members=members + tuple(back), reason=f"{', '.join(back)} back after a freeze",
                              switch_at_step=ev.step)
        return self._apply(store, request, gen, ev.step, f"step {ev.step}: {', '.join(back)} rejoin", f"event {ev}")

    def _wait_held(self, store, wid: str | None, step: int, timeout: float = 600.0) -> None:
        if wid is None:
            return
        end = time.monotonic() + timeout
        while store.get(Keys.held(step, wid)) is None:
            if self.procs.workers[wid].poll() is not None:
                raise RunFailed(f"{self._ended(wid, f'before step {step}')} (see {self.dir})")
            if time.monotonic() > end:
                raise RunTimedOut(f"{wid} was not held at step {step} in {timeout:.0f} s")
            self._check_alive()
            time.sleep(0.01)

    def kill_at_step(self, store, victims: list[str], step: int, timeout: float = 600.0,
                     sig: int = signal.SIGKILL, delay: float = 0.0) -> None:
        """Kill (or freeze, ``sig``) ``victims`` without notice exactly at ``step``: wait until
        each is held there, signal its process group (a kill: wait for it to die), then release
        the step for the others. ``delay`` > 0: release the step first and signal ``delay``
        seconds later, mid-way through the next step."""
        for wid in victims:
            self._wait_held(store, wid, step, timeout)
        if delay > 0:
            store.set(Keys.release(step), "1")
            time.sleep(delay)
        for wid in victims:
            proc = self.procs.workers[wid]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            if sig == signal.SIGKILL:
                proc.wait(timeout=60)
        self.signalled_at[step] = time.time()
        if delay <= 0:
            store.set(Keys.release(step), "1")

    def _status(self, store) -> dict:
        text = store.get(Keys.COORDINATOR_STATUS)
        st = json.loads(text) if text else {}
        for h in st.get("history", []):  # kept across coordinator restarts
            if h.get("generation") is not None:
                self.history.setdefault(h["generation"], h)
        return st

    def _wait_adopted(self, store, gen: int, timeout: float = 120.0) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            st = self._status(store)
            if st.get("generation") == gen:
                self.say(f"new coordinator adopted generation {gen}")
                return st
            self._check_alive()
            time.sleep(0.05)
        raise RunTimedOut(f"the restarted coordinator did not adopt generation {gen}")

    def _wait_first_world(self, store, what: str, tries: int = 5) -> dict:
        """The status once a first world committed. One that did not start (a worker lost while
        it started) the coordinator makes again without that worker: waited for as well, up to
        ``tries`` generations (a failed job ends the wait at once: ``_check_alive``)."""
        gen = 0
        for _ in range(tries):
            status = self._wait_generation(store, gen)
            if status.get("last_outcome") == "committed":
                self._fault_generations.update(range(1, gen + 1))  # no event's change
                return status
            self.say(f"{what}: generation {gen} {status.get('last_outcome')}; the coordinator makes it again")
            gen = 1 + max([gen, *(h["generation"] for h in status.get("history", []) if h.get("generation") is not None)])
        raise RunFailed(f"{what} did not start: {status.get('last_outcome')}")

    def _wait_generation(self, store, gen: int, timeout: float = 600.0,
                         while_waiting: Callable[[dict], None] | None = None) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            st = self._status(store)
            if while_waiting is not None:
                while_waiting(st)
            hist = [h for h in st.get("history", []) if h.get("generation") is not None]
            done = [h for h in hist if h["generation"] >= gen]
            if done and st.get("pending") is None:
                st["last_outcome"] = done[-1]["outcome"]
                self.say(f"generation {done[-1]['generation']}: {done[-1]['outcome']} "
                         f"({done[-1]['config']}, {done[-1]['world_size']} ranks)")
                return st
            self._check_alive(st)
            time.sleep(0.05)
        raise RunTimedOut(f"generation {gen} was not decided in {timeout:.0f} s")

    def _wait_published(self, store, gen: int, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        polls = 0
        while store.latest_generation() < gen:
            if time.monotonic() > end:
                raise RunTimedOut(f"the coordinator published no plan {gen} (see {self.dir}/coordinator.log)")
            # its status says whether it refused the request (every 0.1 s: the plan is cheaper to poll)
            self._check_alive(self._status(store) if polls % 10 == 0 else None)
            polls += 1
            time.sleep(0.01)

    def _post(self, store, request) -> None:
        """Post a plan request; the coordinator's refusal of it ends the run at once, with its
        reason (``_check_alive``), instead of a wait for a plan that never comes."""
        from liveshard.runtime.coordinator import StorePlanSource

        self._refusals_before = len(_refusals(self._status(store)))
        self._posted = request
        StorePlanSource.post(store, request)

    def _check_alive(self, status: dict | None = None) -> None:
        """Raise if the coordinator exited, refused the request posted last, or reported that
        the run cannot go on."""
        failure = (status or {}).get("failure")
        if failure:
            hint = ""
            if failure.get("reason") == "NoSurvivingCopy" and not self.run.checkpoint_every:
                hint = (" (fix: run with --checkpoint-every N, so that a checkpoint can replace state that "
                        "only the lost workers held)")
            raise RunFailed(f"the job failed ({failure.get('reason')}): {failure.get('message')}{hint}")
        if status and self._posted is not None:
            refused = [h for h in _refusals(status)[self._refusals_before:]
                       if h.get("reason") == self._posted.reason]
            if refused:
                why = str(refused[0].get("outcome", "")).removeprefix("rejected:").strip()
                raise RunFailed(f"the coordinator refused {self._posted.reason!r}: {why}")
        workers = self.procs.workers
        if workers and all(p.poll() is not None for p in workers.values()):
            # nobody is left to train: whatever the driver waits for will not come
            failed = [w for w, p in workers.items() if p.returncode not in (0, -signal.SIGKILL)]
            why = "every worker exited"
            if failed:
                why += f"; {self._ended(failed[0])}"
            raise RunFailed(f"{why} (see {self.dir})")
        c = self.procs.coordinator
        if c is not None and c.poll() is not None:
            line = last_log_line(self.dir / "coordinator.log") if c.returncode and c.returncode > 0 else ""
            raise RunFailed(f"the coordinator exited with {exit_text(c.returncode)}" + (f": {line}" if line else "")
                            + f" (see {self.dir}/coordinator.log)")

    def _wait_workers(self, timeout: float, only: tuple[str, ...] | None = None) -> None:
        """Wait for the workers (``only``: the final world's members; standbys wait for plans
        until the stop) to finish their steps."""
        end = time.monotonic() + timeout
        for wid, p in self.procs.workers.items():
            if p.returncode == -signal.SIGKILL or (only is not None and wid not in only):
                continue
            left = max(1.0, end - time.monotonic())
            try:
                p.wait(timeout=left)
            except subprocess.TimeoutExpired:
                # standbys wait for plans until told to stop
                continue

    # ---- report ------------------------------------------------------------------------------
    def _worker_results(self) -> dict[str, dict]:
        out = {}
        # oldest first: a step recomputed after a restart takes the later record
        for f in sorted(self.dir.glob("*.json"), key=lambda f: f.stat().st_mtime):
            if f.name in ("run.json",) or f.stat().st_mtime < self.started - 1.0:
                continue  # the report, or an earlier run's result in a reused workdir
            try:
                data = json.loads(f.read_text())
            except json.JSONDecodeError:
                continue
            out[data["id"]] = data
        return out

    def _report(self, history: list[dict]) -> dict:
        results = self._worker_results()
        steps: dict[int, dict] = {}
        for res in results.values():
            for rec in res["steps"]:
                s = steps.get(rec["step"])
                if s is None or s["generation"] != rec["generation"]:
                    s = steps[rec["step"]] = {"step": rec["step"], "loss": None, "world_size": rec["world_size"],
                                              "consumed_samples": rec["consumed_samples"],
                                              "generation": rec["generation"], "time": rec["time"],
                                              "lr": rec.get("lr"), "grad_norm": rec.get("grad_norm"),
                                              "loss_scale": rec.get("loss_scale"),
                                              "skipped": rec.get("skipped", False),
                                              "samples": rec.get("samples", []), "seconds": rec.get("seconds"),
                                              "compute": {}}
                if rec["loss"] is not None:
                    s["loss"] = rec["loss"]
                s["time"] = max(s["time"], rec["time"])
                s["seconds"] = max(s["seconds"] or 0.0, rec.get("seconds") or 0.0)
                if rec.get("compute_seconds") and rec.get("work_units"):
                    # seconds per layer unit of this device at this step (its compute speed)
                    s["compute"][res["id"]] = rec["compute_seconds"] / rec["work_units"]
        configs = {h["generation"]: h["config"] for h in history if h.get("generation") is not None}
        ordered = [steps[k] for k in sorted(steps)]
        for s in ordered:
            s["config"] = configs.get(s["generation"])
        # The final world's state: the workers that finished in the newest world (a worker a
        # restart or a rollback left behind may also have exited holding older state).
        def world_of(wid: str, res: dict) -> tuple[int, int]:
            return (_segment(wid) or 0, res.get("generation") or 0)

        finished = {wid: res for wid, res in results.items()
                    if res.get("phase") in ("exited", "finished") and res.get("checksums")}
        final = max((world_of(w, r) for w, r in finished.items()), default=None)
        checksums: dict[str, int] = {}
        for wid, res in finished.items():
            if world_of(wid, res) != final:
                continue
            for k, v in res["checksums"].items():
                checksums[k] = (checksums.get(k, 0) + int(v)) % 2**64
        events = self._event_report(history, ordered)
        return {
            "mode": self.run.mode,
            "model": self.run.spec.name,
            "workers": self.run.workers,
            "global_batch": self.run.global_batch,
            "training": self.run.training.to_section(),
            "steps": ordered,
            "evals": self._evals(results),
            "final_checkpoint": next((res.get("final_checkpoint") for res in results.values()
                                      if res.get("final_checkpoint")), None),
            "events": events,
            "faults": self.faults,
            "adaptive": self._adaptive_report(history),
            "stragglers": (self.final_status.get("health") or {}) if self.final_status else {},
            "checksums": {k: f"{v:016x}" for k, v in sorted(checksums.items())},
            "workdir": str(self.dir),
            # how each worker process ended (None: still running when the run ended; -9: killed)
            "exit_codes": {wid: p.poll() for wid, p in self.procs.workers.items()},
        }

    def _adaptive_report(self, history: list[dict]) -> list[dict]:
        """Each switch the straggler policy made: its generation, config, switch step and pause,
        and the decision's numbers (predicted step time now and after, switch cost, reason)."""
        decisions = [d for d in ((self.final_status or {}).get("health") or {}).get("adaptive", {}).get("decisions", [])
                     if d.get("switch")]
        out = []
        for h in history:
            if h.get("cause") != "straggler":
                continue
            decision = decisions.pop(0) if decisions else None  # one switch decision per plan, in order
            out.append({"generation": h["generation"], "config": h.get("config"), "outcome": h.get("outcome"),
                        "switch_step": h.get("switch_step"), "downtime": h.get("downtime"),
                        "reason": h.get("reason"), "decision": decision})
        return out

    @staticmethod
    def _evals(results: dict[str, dict]) -> list[dict]:
        """Validation runs by step (the last pipeline stage's record; a recomputed step's newest)."""
        by_step: dict[int, dict] = {}
        for res in results.values():
            for ev in res.get("evals") or []:
                by_step[ev["step"]] = ev
        return [by_step[k] for k in sorted(by_step)]

    def _event_report(self, history: list[dict], steps: list[dict]) -> list[dict]:
        """Per event: the phases the members reported, and two wall-clock measures of the pause:
        ``downtime`` (end of the last step before the change to the new world being ready to
        train) and ``to_next_step`` (to the end of the first step after it)."""
        times = {s["step"]: s["time"] for s in steps}
        ready: dict[int, float] = {}
        for wid, res in self._worker_results().items():
            segment = _segment(wid)
            for r in res.get("ready", []):
                gen = segment if segment is not None else r["generation"]
                ready[gen] = max(ready.get(gen, 0.0), r["time"])
        changes = [h for h in history if h.get("generation") and "adopted" not in h.get("reason", "")
                   and h["generation"] not in self._fault_generations | self._retried_generations
                   and h.get("cause") != "straggler"]
        out = []
        for ev in self.run.events:
            if ev.kind == "slow":
                out.append({"event": str(ev), "kind": ev.kind, "step": ev.step, "outcome": "applied"})
                continue
            if ev.kind in ("coordinator", "restart"):
                out.append({"event": str(ev), "kind": ev.kind, "step": ev.step, "outcome": "restarted"})
                continue
            if ev.kind == "kill" and ev.phase:
                fault = next((f for f in self.faults if f["step"] > ev.step), None)
                out.append({"event": str(ev), "kind": ev.kind, "step": ev.step, "phase": ev.phase,
                            "outcome": "armed", **({"fault": fault} if fault else {})})
                continue
            if not changes:
                break
            h = changes.pop(0)
            gen = h.get("generation")
            resumed: dict = {}
            if ev.kind == "stop" and changes and self.run.mode == "live":
                resumed = changes.pop(0)  # the plan that restored the stopped job
                gen = resumed.get("generation")
            last = max((s for s in times if s <= ev.step), default=None)
            # the last step the old world completed (a kill may land after the event's step)
            if ev.kind in ("kill", "sigstop"):
                last = max((s["step"] for s in steps if s["generation"] < gen), default=last)
            elif ev.step in self.join_retries and (h.get("switch_step") or -1) >= ev.step:
                last = h["switch_step"]  # a retried join switched later, at the boundary it found
            t_last = times.get(last)
            t_ready = ready.get(gen)
            t_next = times.get(last + 1) if last is not None else None
            out.append({
                "event": str(ev),
                "kind": ev.kind,
                "step": ev.step,
                "generation": gen,
                "config": h.get("config"),
                "outcome": h.get("outcome"),
                "phases": h.get("phases", {}),
                "downtime": None if t_last is None or t_ready is None else max(0.0, t_ready - t_last),
                # a loss without notice: from the signal to the survivors' world ready
                **({"recovery": t_ready - self.signalled_at[ev.step]}
                   if ev.step in self.signalled_at and t_ready is not None else {}),
                "to_next_step": None if t_last is None or t_next is None else t_next - t_last,
                **({"resume": {"generation": gen, "outcome": resumed.get("outcome"),
                               "phases": resumed.get("phases", {})}} if resumed else {}),
                **({"retried": self.join_retries[ev.step]} if ev.step in self.join_retries else {}),
            })
        return out


def _segment(wid: str) -> int | None:
    """Checkpoint mode names its workers ``s<segment>w<i>``, one world per segment (restart.py)."""
    m = re.fullmatch(r"s(\d+)w\d+", wid)
    return int(m.group(1)) if m else None


def run_local(run: RunSpec) -> dict:
    from liveshard.dev.localrun.progress import StepPrinter

    job = LocalRun(run)
    job.refuse_foreign_checkpoints()
    printer = StepPrinter(job.dir, run.steps, job.say, notices=job.notices).start() if run.log is not None else None
    job.say(f"starting the coordinator and {run.workers} workers in {job.dir} (each worker loads torch and "
            "megatron-core and builds its model and data: seconds to a minute)")
    try:
        if run.mode == "live":
            return job.run_live()
        from liveshard.dev.localrun.restart import run_checkpoint_mode

        return run_checkpoint_mode(job)
    finally:
        job.procs.kill_all()
        if printer is not None:
            printer.stop()
