"""The worker agent: one training rank that follows the job's world plans without restarting.

Life of a worker:

1. connect to the job's store, announce itself, start the control thread (heartbeats, plan
   watching, background preparation);
2. wait for a plan that includes it: generation 0 starts a world from scratch; a later plan
   makes it a joiner that receives its state from the old members;
3. train, one optimizer step at a time; at every step boundary the old world agrees with one
   tiny all-reduce whether everybody has prepared the newest plan (or whether that plan's
   ``switch_at_step`` is now), and if so switches:

   * **prepare** (background, training continues): compute the transition plan (pure, same on
     every member), publish its checksum, and build the transition group over old and new
     members; joiners did their imports and megatron set-up before this;
   * **transfer**: every piece of state moves to its new owner (``liveshard.runtime.transfer``),
     into fresh buffers: the old model is untouched;
   * **commit** (all members said ok): the old world is destroyed, the new one built in the same
     process, the received state loaded; leavers exit; otherwise **abort**: the old world keeps
     training and the new buffers are dropped.

A rank that dies without notice breaks the old world's collectives; the survivors stop, report
"broken" in their heartbeats and take the coordinator's recovery plan, which sources every
region from surviving replicas (or falls back to the last checkpoint).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from liveshard.runtime import telemetry
from liveshard.runtime.agent import world as worlds
from liveshard.runtime.agent.state import (
    capture_rng,
    load_state,
    logical_checksums,
    restore_rng,
    state_tensors,
)
from liveshard.runtime.agent.trainer import Trainer, TrainingSettings
from liveshard.runtime.agent.transition import execute_transition, plan_for
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.control.protocol import MemberResult, WorldPlan, transition_members
from liveshard.runtime.control.store import JobStore, connect_store
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.spec import ModelSpec

log = logging.getLogger("liveshard.worker")


@dataclass
class WorkerOptions:
    heartbeat_interval: float = 0.5
    poll_interval: float = 0.25  # how often the control thread looks for new plans
    collective_timeout: float = 20.0  # seconds before a collective with a dead peer fails
    transfer_budget: int = 64 << 20  # staging bytes per rank during a transfer
    verify: bool = False  # per-region checksums after each transfer
    # Which members allocate and touch their new tensors while the job still trains: "joiners"
    # (idle anyway), "all" (members too: the new state lives beside the old one a little
    # earlier) or "auto" (all on CPU, where first touching fresh memory is a large part of a
    # transfer; joiners on GPU, where the caching allocator serves the transfer's tensors and
    # memory taken early would be taken from the training step's activations).
    preallocate: str = "auto"
    max_steps: int | None = None
    # Checkpoints (megatron dist_checkpointing): load at start, save and exit at a step (the
    # restart path), and a periodic safety checkpoint for losses with no surviving copy.
    load_dir: str | None = None
    save_dir: str | None = None
    save_at_step: int | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # steps between safety checkpoints (0: off)
    checkpoint_interval: float = 0.0  # seconds between safety checkpoints (0: off)
    # Safety checkpoints are written in the background; this many steps after one starts, every
    # rank waits for it to be complete (0: finalize whenever it is done, checked at each step).
    checkpoint_finalize_steps: int = 0
    # Steps at which a scripted run's driver has something to do (publish a plan, arm a fault):
    # workers hold there until released, so events land on exact steps.
    hold_at_steps: tuple[int, ...] = ()


@dataclass
class Prepared:
    """A plan this worker is ready to switch to."""

    plan: WorldPlan
    old: WorldPlan | None
    transition: Any  # liveshard.runtime.vps.transition.TransitionPlan (None for generation 0)
    group: Any  # the transition ProcessGroup (None for generation 0)
    group_rank: int
    members: tuple[str, ...]  # transition group members
    seconds: float
    destinations: Any = None  # new tensors allocated and touched ahead (see WorkerOptions.preallocate)
    grad_buffer: Any = None  # and memory for its gradients when the old DDP buffer is too small


@dataclass
class StepRecord:
    step: int
    loss: float | None
    seconds: float
    generation: int
    world_size: int
    consumed_samples: int
    time: float = 0.0  # wall clock at the end of the step


@dataclass
class WorkerState:
    generation: int | None = None
    plan: WorldPlan | None = None
    rank: int | None = None
    phase: str = "starting"
    records: list[StepRecord] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    ready: list[dict] = field(default_factory=list)  # when each generation's world could train


class WorkerAgent:
    def __init__(self, worker_id: str, host: str, port: int, spec: ModelSpec,
                 settings: TrainingSettings, options: WorkerOptions | None = None,
                 job: str = "job") -> None:
        self.id = worker_id
        self.spec = spec
        self.settings = settings
        self.options = options or WorkerOptions()
        self._host, self._port, self._job = host, port, job
        # One store client per thread: a c10d store client must not be used by two threads at once
        # (a blocking rendezvous in one interleaves with the other's requests on the same socket).
        self._stores = self._connect_stores(timeout=300.0)
        self.state = WorkerState()
        self.built: Any = None
        self.trainer: Trainer | None = None
        self._prepared: dict[int, Prepared] = {}
        self._prepare_error: dict[int, str] = {}
        self._latest_seen = -1
        self._plan_cache: dict[int, WorldPlan] = {}
        self._stop = threading.Event()
        self._stop_requested = False  # set by the control thread: training never waits on the store
        self._lock = threading.Lock()
        self._last_checkpoint: dict | None = None  # newest complete checkpoint this worker saved
        self._last_save = time.monotonic()
        self._device = worlds.device()  # fixed in the main thread (CUDA's current device is per thread)
        self._saves: Any = None  # megatron AsyncCallsQueue of this world's background saves
        self._save_started_at = 0  # step at which the save in flight started
        self._thread = threading.Thread(target=self._control_loop, name=f"control-{worker_id}", daemon=True)

    def _connect_stores(self, timeout: float) -> dict[str, JobStore]:
        return {name: JobStore(connect_store(self._host, self._port, timeout=timeout), self._job)
                for name in ("main", "control")}

    @property
    def store(self) -> JobStore:
        return self._stores["control" if threading.current_thread() is self._thread else "main"]

    # ---- control thread ----------------------------------------------------------------------
    def _control_loop(self) -> None:
        next_hb = 0.0
        failures = 0
        handled = -1  # newest generation whose plan this thread has looked at
        while not self._stop.is_set():
            now = time.time()
            if now >= next_hb:
                self._heartbeat(now)
                next_hb = now + self.options.heartbeat_interval
            try:
                if self.store.has(Keys.STOP):
                    self._stop_requested = True
                latest = self.store.latest_generation()
                if latest > self._latest_seen:
                    self._latest_seen = latest
                if latest > handled:  # read a plan until it is acted on, not on every poll after
                    plan = self.store.plan(latest)
                    if plan is not None:
                        if latest in self._prepared or latest in self._prepare_error \
                                or latest <= (self.state.generation if self.state.generation is not None else -1):
                            handled = latest
                        elif self._involved(plan):
                            self._prepare(plan)
                            handled = latest
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
            time.sleep(self.options.poll_interval if failures == 0 else 0.05)

    def _reconnect(self) -> bool:
        """Connect to a restarted coordinator and announce the world this worker trains in."""
        try:
            stores = self._connect_stores(timeout=5.0)
        except Exception:
            return False
        info = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), "reconnected": True}
        if self.state.plan is not None:
            info["plan"] = self.state.plan.to_json()
        if self._last_checkpoint is not None:
            info["checkpoint"] = self._last_checkpoint
        stores["control"].register_member(self.id, info)
        # one assignment: the main thread picks its new client up at its next store call
        self._stores = stores
        self._heartbeat(time.time())
        self._latest_seen = max(self._latest_seen, self.state.generation or 0)
        log.warning("reconnected to the coordinator; announced generation %s", self.state.generation)
        return True

    def _heartbeat(self, now: float) -> None:
        t = self.trainer
        payload = {
            "time": now,
            "state": self.state.phase,
            "generation": self.state.generation,
            "rank": self.state.rank,
            "step": t.step_count if t else None,
            "step_seconds": t.last_step_seconds if t else None,
            "loss": t.last_loss if t else None,
            "pid": os.getpid(),
        }
        health = telemetry.gpu_health()
        if health:
            payload["health"] = health
        with contextlib.suppress(Exception):  # the coordinator may be restarting
            self.store.set_json(Keys.heartbeat(self.id), payload)

    def _involved(self, plan: WorldPlan) -> bool:
        if self.id in plan.members or self.id in plan.standbys:
            return True
        cur = self.state.plan
        return cur is not None and plan.previous == cur.generation and self.id in cur.members

    def _wait_heartbeating(self, key: str, timeout: float) -> str | None:
        """Wait for a store key from the control thread, heartbeating meanwhile (a member
        waiting for a slow peer must not look dead to the coordinator)."""
        end = time.monotonic() + timeout
        while True:
            value = self.store.wait_for(key, timeout=0.25)
            if value is not None or time.monotonic() > end:
                return value
            self._heartbeat(time.time())

    def _prepare(self, plan: WorldPlan) -> None:
        """Background: transition plan, checksum agreement, transition group."""
        start = time.perf_counter()
        try:
            old = self.store.plan(plan.previous) if plan.previous is not None else None
            if old is None or not plan.is_live_transition:
                # a first world, or one built through a checkpoint: nothing to plan or connect
                prepared = Prepared(plan, old, None, None, 0, plan.members, time.perf_counter() - start)
            else:
                transition = plan_for(self.spec, old, plan)
                members = transition_members(old, plan)
                checksum = transition.checksum
                self.store.set(Keys.prepared(plan.generation, self.id), checksum)
                for m in members:
                    other = self._wait_heartbeating(Keys.prepared(plan.generation, m), timeout=120.0)
                    if other is None:
                        raise RuntimeError(f"member {m} did not prepare generation {plan.generation}")
                    if other != checksum:
                        raise RuntimeError(f"transition plan checksum of {m} differs from ours")
                group_rank = members.index(self.id)
                group = worlds.build_transition_group(self.store.store, Keys.transfer_prefix(plan.generation),
                                                      group_rank, len(members), self.options.collective_timeout)
                destinations = grad_buffer = None
                joiner = self.id in plan.members and self.id not in old.members
                if joiner or (self.id in plan.members and self._preallocates_as_member()):
                    # Pay the first touch of the new memory now, not during the pause: the new
                    # tensors, and a gradient buffer when the old one (reused) is too small.
                    from liveshard.runtime.control.protocol import transition_devices
                    from liveshard.runtime.transfer.executor import allocate_destinations

                    device_id = transition_devices(old, plan).index(self.id)
                    destinations = allocate_destinations(transition, device_id, self._device)
                    params = _param_count(transition.new_layout, transition.device_to_rank[device_id])
                    held = 0 if joiner else _param_count(transition.old_layout, device_id)
                    if params > held:
                        # DDP pads its buckets: a little more than the parameters (fp32 gradients)
                        grad_buffer = torch.zeros(params + params // 64 + (1 << 16), dtype=torch.float32,
                                                  device=self._device)
                prepared = Prepared(plan, old, transition, group, group_rank, members,
                                    time.perf_counter() - start, destinations, grad_buffer)
            with self._lock:
                self._prepared[plan.generation] = prepared
        except Exception as e:
            log.error("prepare %d failed: %s", plan.generation, traceback.format_exc())
            with self._lock:
                self._prepare_error[plan.generation] = f"{type(e).__name__}: {e}"
            self._report(plan.generation, MemberResult(ok=False, error=f"prepare: {e}"))

    def _preallocates_as_member(self) -> bool:
        mode = self.options.preallocate
        return mode == "all" or (mode == "auto" and self._device.type == "cpu")

    # ---- main loop ---------------------------------------------------------------------------
    def bootstrap(self) -> float:
        """Pay the one-off costs (imports, megatron's CPU/GPU set-up) before joining the job, so a
        joiner is admitted ready and only the transfer and commit stop training."""
        t0 = time.perf_counter()
        import megatron.core.distributed
        import megatron.core.models.gpt.gpt_layer_specs
        import megatron.core.optimizer
        import megatron.core.optimizer_param_scheduler
        import megatron.core.pipeline_parallel  # noqa: F401

        from liveshard.runtime.megatron import compat

        compat.install()
        if torch.cuda.is_available():
            torch.cuda.init()
        # One-off set-up that would otherwise land in the first step after admission: the first
        # optimizer step imports torch._dynamo (about 1 s), the first backward starts autograd's
        # threads.
        p = torch.zeros(8, requires_grad=True, device=self._device)
        (p * 2.0).sum().backward()
        torch.optim.Adam([p]).step()
        # Millions of objects from the imports above would otherwise be traversed by every full
        # garbage collection, and one lands in each model build (0.2 s for a 124M model on CPU):
        # they live for the whole process, so take them out of the collector's view once.
        gc.collect()
        gc.freeze()
        return time.perf_counter() - t0

    def run(self) -> WorkerState:
        self.state.events.append({"kind": "bootstrap", "seconds": self.bootstrap(), "time": time.time()})
        self._check_checkpoint_dir()
        self._register()
        self._thread.start()
        try:
            while not self._stopping():
                if self.state.phase == "left":
                    break
                if self.trainer is None or self.state.phase == "broken":
                    if not self._wait_for_plan():
                        break
                    continue
                self._train_one()
            if self.state.phase != "left":
                self.state.phase = "exited"
        finally:
            self._heartbeat(time.time())
            self._stop.set()
        return self.state

    def _register(self, timeout: float = 300.0) -> None:
        """Announce this worker; if the coordinator restarted meanwhile (its store with it),
        connect to the new one and announce there."""
        end = time.monotonic() + timeout
        while True:
            try:
                info = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
                self.store.register_member(self.id, info)
                return
            except Exception as e:
                if time.monotonic() > end:
                    raise
                log.warning("registering with the coordinator failed (%s); reconnecting", e)
                time.sleep(0.5)
                with contextlib.suppress(Exception):
                    self._stores = self._connect_stores(timeout=5.0)

    def _stopping(self) -> bool:
        if self.options.max_steps is not None and self.trainer is not None \
                and self.trainer.step_count >= self.options.max_steps:
            return True
        return self._stop_requested

    def _wait_for_plan(self) -> bool:
        """Not training (start, joiner, standby, broken world): wait for a plan to act on."""
        if self.state.phase != "broken":
            self.state.phase = "waiting"
        while not self._stopping():
            with self._lock:
                ready = [p for g, p in self._prepared.items()
                         if self.state.generation is None or g > self.state.generation]
            if ready:
                prep = max(ready, key=lambda p: p.plan.generation)
                if prep.old is None:
                    if self.id in prep.plan.members:
                        self._start_world(prep.plan)
                    else:
                        self._adopt(prep.plan, None)  # a standby from the start
                    return True
                if not prep.plan.is_live_transition:
                    self._through_checkpoint(prep, self.trainer.step_count if self.trainer else -1)
                    return True
                if self.state.phase == "broken":
                    # The old world cannot agree on a step: the transition group, which every
                    # member has joined by now, is the synchronisation. The first old rank marks it.
                    if self.state.rank is not None and self.id == prep.members[0]:
                        self.store.set(Keys.switch(prep.plan.generation), str(self.trainer.step_count))
                    self._switch(prep, switch_step=self.trainer.step_count)
                    return True
                try:
                    step = self.store.wait_for(Keys.switch(prep.plan.generation), timeout=0.2)
                except Exception:  # the coordinator is restarting
                    time.sleep(0.2)
                    continue
                if step is not None:
                    self._switch(prep, switch_step=int(step))
                    return True
                continue
            time.sleep(0.02)
        return False

    def _start_world(self, plan: WorldPlan, load_dir: str | None = None,
                     phases: dict[str, float] | None = None) -> None:
        """Build the world of ``plan`` from scratch: initialised, or loaded from a checkpoint."""
        cfg = ParallelConfig.parse(plan.config)
        rank = plan.members.index(self.id)
        load_dir = load_dir or self.options.load_dir
        phases = dict(phases or {})
        t0 = time.perf_counter()
        worlds.init_training_world(self.store.store, Keys.world_prefix(plan.generation), rank,
                                   cfg.world_size, self.options.collective_timeout)
        self._build(cfg, initialize=load_dir is None)
        phases["build"] = time.perf_counter() - t0
        if load_dir:
            from liveshard.runtime.agent import checkpoint

            t1 = time.perf_counter()
            checkpoint.load(self.built, self.trainer, load_dir)
            phases["load"] = time.perf_counter() - t1
        self._adopt(plan, rank)
        self._report(plan.generation, MemberResult(ok=True, phases=phases, step=self.trainer.step_count))

    def _build(self, cfg: ParallelConfig, initialize: bool = True,
               spare_buffers: list[torch.Tensor] | None = None) -> None:
        from liveshard.runtime.megatron.build import build_model

        self.built = build_model(self.spec, cfg, seed=self.settings.seed, lr=self.settings.lr,
                                 clip_grad=self.settings.clip_grad, hidden_dropout=0.0, attention_dropout=0.0,
                                 perform_initialization=initialize, spare_buffers=spare_buffers)
        self.trainer = Trainer(self.built, self.settings)

    def _adopt(self, plan: WorldPlan, rank: int | None) -> None:
        with self._lock:  # what was prepared for this or older generations (groups, buffers) goes
            for g in [g for g in self._prepared if g <= plan.generation]:
                del self._prepared[g]
        if rank is not None:
            self.state.ready.append({"generation": plan.generation, "time": time.time()})
        self.state.generation = plan.generation
        self.state.plan = plan
        self.state.rank = rank
        self.state.phase = "training" if rank is not None else "standby"

    def _train_one(self) -> None:
        t = self.trainer
        assert t is not None
        before = t.step_count
        try:
            loss = t.step()
            self._record_step(loss)
            self._after_step()
        except Exception as e:  # a collective failed: a peer is gone
            if not _is_comm_failure(e):
                raise
            if t.step_count > before and (not self.state.records or self.state.records[-1].step < t.step_count):
                # the update was applied and only reporting the loss failed: the step is done
                self._record_step(None)
            log.error("world of generation %s broke at step %d: %s", self.state.generation, t.step_count, e)
            self.state.phase = "broken"
            self.state.events.append({"kind": "broken", "step": t.step_count, "error": str(e)[:200],
                                      "time": time.time()})

    def _record_step(self, loss: float | None) -> None:
        t = self.trainer
        self.state.records.append(StepRecord(t.step_count, loss, t.last_step_seconds, self.state.generation,
                                             self.built.cfg.world_size, t.consumed_samples, time.time()))

    def _after_step(self) -> None:
        t = self.trainer
        o = self.options
        if o.save_at_step is not None and t.step_count == o.save_at_step and o.save_dir:
            from liveshard.runtime.agent import checkpoint

            checkpoint.save(self.built, t, o.save_dir)
            self.state.phase = "left"  # the restart path: every process exits after saving
            return
        self._step_boundary()

    def _check_checkpoint_dir(self) -> None:
        d = self.options.checkpoint_dir
        if not d:
            return
        try:
            os.makedirs(d, exist_ok=True)
            if not os.access(d, os.W_OK):
                raise PermissionError(f"{d} is not writable")
        except OSError as e:
            log.error("checkpoint directory %s is unusable (%s): no safety checkpoints, and a stop will be "
                      "refused; mount a shared writable volume there (spec.checkpoint)", d, e)
            self.options.checkpoint_dir = None

    def _checkpoint_due(self) -> bool:
        o = self.options
        if not o.checkpoint_dir:
            return False
        if o.checkpoint_every and self.trainer.step_count % o.checkpoint_every == 0:
            return True
        return bool(o.checkpoint_interval) and time.monotonic() - self._last_save >= o.checkpoint_interval

    def _save_checkpoint(self, background: bool = False) -> None:
        """Save the training world's state (collective) as ``<checkpoint_dir>/step<N>``. Once it
        is complete, rank 0 publishes it as the newest checkpoint: the one a recovery with no
        surviving copy loads. ``background``: written while training goes on (a safety
        checkpoint); otherwise complete on return (a stop)."""
        from liveshard.runtime.agent import checkpoint

        t = self.trainer
        if not self.options.checkpoint_dir:
            raise RuntimeError("no checkpoint directory (--checkpoint-dir or LIVESHARD_CHECKPOINT_DIR)")
        if background and self._saves is not None and self._saves.get_num_unfinalized_calls():
            return  # the previous one is still being written (every rank knows the same)
        if not background:
            self._finalize_saves(wait=True)
        path = os.path.join(self.options.checkpoint_dir, f"step{t.step_count:08d}")
        info = {"path": path, "step": t.step_count, "config": str(self.built.cfg)}
        t0 = time.perf_counter()
        self._last_save = time.monotonic()

        def complete() -> None:
            self._last_checkpoint = {**info, "time": time.time()}
            if self.state.rank == 0:
                self.store.set_json(Keys.CHECKPOINT, self._last_checkpoint)
            self.state.events.append({"kind": "checkpoint", "step": info["step"], "path": path,
                                      "seconds": time.perf_counter() - t0, "time": time.time()})

        if checkpoint.is_complete(path, t.step_count):
            complete()
            return
        if background:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            if self._saves is None:
                self._saves = AsyncCallsQueue()
            self._save_started_at = t.step_count
            checkpoint.save(self.built, t, path, queue=self._saves, on_complete=complete)
        else:
            checkpoint.save(self.built, t, path, on_complete=complete)

    def _finalize_saves(self, wait: bool = False) -> None:
        """Complete the background saves that are done (all ranks call this at the same step:
        it is collective); ``wait`` for the one in flight, as at a switch or a stop, or when
        ``checkpoint_finalize_steps`` have passed since it started."""
        if self._saves is None or not self._saves.get_num_unfinalized_calls():
            return
        steps = self.options.checkpoint_finalize_steps
        due = bool(steps) and self.trainer is not None and self.trainer.step_count - self._save_started_at >= steps
        self._saves.maybe_finalize_async_calls(blocking=wait or due)

    def _abandon_saves(self) -> None:
        """A broken world cannot agree that a save is complete: it never becomes the newest."""
        if self._saves is not None:
            with contextlib.suppress(Exception):
                self._saves.close(abort=True)
        self._saves = None

    def _step_boundary(self) -> None:
        """Agree over the old world whether to switch to the newest plan now.

        One all-reduce of three integers: the newest generation any rank has seen, the lowest
        generation every rank has prepared, and whether a safety checkpoint is due. All ranks see
        the same result, so they decide alike.
        """
        t = self.trainer
        self._finalize_saves()
        if t.step_count in self.options.hold_at_steps:
            self._hold(t.step_count)
        with self._lock:
            prepared = [g for g, p in self._prepared.items() if p.old is not None
                        and p.old.generation == self.state.generation]
        flags = torch.tensor([self._latest_seen, -max(prepared, default=-1), int(self._checkpoint_due())],
                             dtype=torch.int64, device=worlds.device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        latest, all_prepared = int(flags[0]), -int(flags[1])
        if int(flags[2]):  # some rank's safety checkpoint is due: all save, at the same step
            try:
                self._save_checkpoint(background=True)
            except Exception as e:
                if _is_comm_failure(e):
                    raise
                log.error("safety checkpoint at step %d failed (training goes on): %s", t.step_count, e)
                self._last_save = time.monotonic()
        if latest <= self.state.generation:
            return
        plan = self._plan_cache.get(latest) or self.store.plan(latest)
        if plan is None or plan.previous != self.state.generation:
            return
        self._plan_cache[latest] = plan
        if plan.switch_at_step is not None:
            if t.step_count < plan.switch_at_step:
                return
            ok = self._wait_prepared(latest) is not None  # every rank waits at the same step
        elif all_prepared == latest:
            ok = True
        else:
            return
        vote = torch.tensor([1 if ok else 0], dtype=torch.int64, device=worlds.device())
        dist.all_reduce(vote, op=dist.ReduceOp.MIN)
        if not int(vote):
            return  # some rank failed to prepare: the coordinator aborts this generation
        if self.state.rank == 0:
            self.store.set(Keys.switch(latest), str(t.step_count))
        self._switch(self._prepared[latest], switch_step=t.step_count)

    def _hold(self, step: int, timeout: float = 300.0) -> None:
        """A scripted run's gate: wait at ``step`` until the driver releases it (it has published
        the plan due here, or armed a fault), so events land on exact steps however fast steps are."""
        end = time.monotonic() + timeout
        while True:
            try:  # the store may be restarting with its coordinator: the control thread reconnects
                if self.store.wait_for(f"release/{step}", timeout=0.5) is not None:
                    break
            except Exception:
                time.sleep(0.2)
            if time.monotonic() > end:
                log.warning("step %d was not released in %.0f s; training on", step, timeout)
                break
        self._latest_seen = max(self._latest_seen, self.store.latest_generation())
        kill_at = self.store.get(f"inject/kill/{self.id}")
        if kill_at is not None and int(kill_at) == step:
            log.warning("fault injection: SIGKILL at step %d", step)
            os.kill(os.getpid(), signal.SIGKILL)

    def _wait_prepared(self, gen: int, timeout: float = 300.0) -> Prepared | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                if gen in self._prepared:
                    return self._prepared[gen]
                if gen in self._prepare_error:
                    return None
            time.sleep(0.005)
        return None

    # ---- switching ---------------------------------------------------------------------------
    def _switch(self, prep: Prepared, switch_step: int) -> None:
        plan, old = prep.plan, prep.old
        assert old is not None
        if self._saves is not None:  # the old world settles its background save first
            if self.state.phase == "broken":
                self._abandon_saves()
            else:
                self._finalize_saves(wait=True)
            self._saves = None  # the next world numbers its saves afresh, joiners included
        if not plan.is_live_transition:
            self._through_checkpoint(prep, switch_step)
            return
        phases: dict[str, float] = {"prepare": prep.seconds}
        t_stop = time.perf_counter()
        holds_state = self.trainer is not None and self.id in old.members
        sources = state_tensors(self.built) if holds_state else {}
        objects = self._objects() if holds_state else None
        ok, error, result = True, "", None
        try:
            result = execute_transition(prep, self.id, sources, objects, budget=self.options.transfer_budget,
                                        verify=self.options.verify)
        except Exception as e:
            ok, error = False, f"transfer: {type(e).__name__}: {e}"
            log.error("transfer for generation %d failed: %s", plan.generation, traceback.format_exc())
        phases["transfer"] = time.perf_counter() - t_stop
        sources = None  # the old tensors live on only where the new state aliases them
        try:
            ok = worlds.group_all_ok(prep.group, ok)
        except Exception as e:
            ok, error = False, error or f"commit vote: {e}"
        if not ok:
            phases["downtime"] = time.perf_counter() - t_stop
            self._report(plan.generation, MemberResult(ok=False, error=error or "another member failed",
                                                       phases=phases, step=switch_step))
            with self._lock:
                self._prepared.pop(plan.generation, None)
                self._prepare_error[plan.generation] = error or "aborted"
            return  # the old world (if any) keeps training on its untouched state
        # Commit: tear down the old world, build the new one here, load what we received.
        t_commit = time.perf_counter()
        spare: list[torch.Tensor] = [prep.grad_buffer] if prep.grad_buffer is not None else []
        if self.trainer is not None:
            from liveshard.runtime.megatron.build import gradient_buffers

            spare += gradient_buffers(self.built)  # the new model's gradients reuse this memory
        self._teardown()
        stats = result.stats
        if self.id not in plan.members:
            phases["commit"] = time.perf_counter() - t_commit
            self._report(plan.generation, MemberResult(ok=True, phases=phases, step=switch_step,
                                                       bytes_sent=stats.bytes_sent))
            self._adopt(plan, None)
            if self.id not in plan.standbys:
                self.state.phase = "left"
            return
        cfg = ParallelConfig.parse(plan.config)
        rank = plan.members.index(self.id)
        t0 = time.perf_counter()
        worlds.init_training_world(self.store.store, Keys.world_prefix(plan.generation), rank,
                                   cfg.world_size, self.options.collective_timeout)
        t1 = time.perf_counter()
        self._build(cfg, initialize=False, spare_buffers=spare)
        spare = []
        t2 = time.perf_counter()
        objs = result.objects
        load_state(self.built, result.tensors, step=int(objs["step"]))
        log.info("commit %d: teardown %.3fs, world %.3fs, build %.3fs, load %.3fs", plan.generation,
                 t0 - t_commit, t1 - t0, t2 - t1, time.perf_counter() - t2)
        self.trainer.restore_progress({"step": objs["step"], "consumed_samples": objs["data_cursor"],
                                       "scheduler": objs["scheduler"]})
        restore_rng(objs["rng"])
        self._adopt(plan, rank)
        phases["commit"] = time.perf_counter() - t_commit
        phases["downtime"] = time.perf_counter() - t_stop
        self._report(plan.generation, MemberResult(ok=True, phases=phases, step=switch_step,
                                                   bytes_received=stats.bytes_received,
                                                   bytes_sent=stats.bytes_sent))
        self.state.events.append({"kind": "switch", "generation": plan.generation, "step": switch_step,
                                  "phases": phases, "time": time.time()})

    def _through_checkpoint(self, prep: Prepared, switch_step: int) -> None:
        """Switch to a plan that carries no live state: a stop saves a checkpoint and leaves
        every worker waiting; a restore builds the new world from the checkpoint it names."""
        plan = prep.plan
        phases: dict[str, float] = {"prepare": prep.seconds}
        t0 = time.perf_counter()
        if plan.is_stop and self.trainer is not None and self.state.phase != "broken":
            ok, error = True, ""
            try:
                self._save_checkpoint()
            except Exception as e:
                ok, error = False, f"checkpoint: {type(e).__name__}: {e}"
                log.error("saving before the stop failed: %s", traceback.format_exc())
            vote = torch.tensor([1 if ok else 0], dtype=torch.int64, device=worlds.device())
            try:
                dist.all_reduce(vote, op=dist.ReduceOp.MIN)
                ok = ok and bool(int(vote))
            except Exception as e:
                ok, error = False, error or f"checkpoint vote: {e}"
            if not ok:  # training goes on; the coordinator aborts the stop
                self._report(plan.generation, MemberResult(ok=False, error=error or "another member failed to save",
                                                           step=switch_step))
                with self._lock:
                    self._prepared.pop(plan.generation, None)
                    self._prepare_error[plan.generation] = error or "aborted"
                return
            phases["save"] = time.perf_counter() - t0
        self._teardown()
        if plan.restore_from is not None and self.id in plan.members:
            self._start_world(plan, load_dir=plan.restore_from, phases=phases)
            self.state.events.append({"kind": "restore", "generation": plan.generation, "from": plan.restore_from,
                                      "phases": phases, "time": time.time()})
            return
        self._report(plan.generation, MemberResult(ok=True, phases=phases, step=switch_step))
        self._adopt(plan, None)
        if self.id not in plan.members and self.id not in plan.standbys:
            self.state.phase = "left"

    def _teardown(self) -> None:
        """Drop the model and the training world (a broken world's communicators included)."""
        self._abandon_saves()  # finalized before any orderly switch; only a broken world has one left
        if self.trainer is None:
            return
        from liveshard.runtime.megatron.build import destroy

        self.trainer = None
        self.built = None
        destroy()
        worlds.destroy_training_world()

    def _objects(self) -> dict:
        p = self.trainer.progress()
        return {"step": p["step"], "data_cursor": p["consumed_samples"], "scheduler": p["scheduler"],
                "rng": capture_rng()}

    def _report(self, gen: int, result: MemberResult) -> None:
        self.store.set(Keys.result(gen, self.id), result.to_json())

    # ---- results -----------------------------------------------------------------------------
    def final_checksums(self) -> dict[str, int]:
        from liveshard.runtime.vps.layout import Layout

        layout = Layout(self.spec, self.built.cfg)
        return logical_checksums(layout, self.state.rank, state_tensors(self.built))


def _is_comm_failure(e: BaseException) -> bool:
    """A collective failed because a peer is gone (gloo/NCCL errors, timeouts), not a bug."""
    if isinstance(e, (dist.DistError, TimeoutError, ConnectionError)):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(s in text for s in (
        "Connection closed by peer", "Connection reset", "Timed out", "timed out", "NCCL", "gloo",
        "Broken pipe", "ProcessGroup", "Socket"))


def _param_count(layout: Any, rank: int) -> int:
    """Model parameters (elements) a rank holds in a layout."""
    return sum(p.numel for p in layout.local_params(rank))
