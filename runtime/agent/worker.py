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

This module holds the agent's state and composes the phases, each in its own module:

| module | what it does |
|---|---|
| ``connection.py`` | store clients (one per thread), registration, heartbeats, results |
| ``control.py`` | the control thread: heartbeats, watching plans, triggering preparation |
| ``prepare.py`` | preparing a plan in the background (``Prepared``, ``Preparations``) |
| ``training.py`` | one step and its record; the step-boundary agreement (``StepBoundary``) |
| ``checkpoint_schedule.py`` | when safety checkpoints are saved, finalized or abandoned |
| ``switch.py`` | switching: transfer, commit vote, commit, abort, through a checkpoint |
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from liveshard.runtime.agent import switch as switching
from liveshard.runtime.agent import training
from liveshard.runtime.agent import world as worlds
from liveshard.runtime.agent.checkpoint_schedule import SafetyCheckpoints
from liveshard.runtime.agent.connection import (
    StoreClients,
    heartbeat_payload,
    register,
    report_result,
    send_heartbeat,
)
from liveshard.runtime.agent.control import ControlThread
from liveshard.runtime.agent.prepare import Preparations, Prepared, Preparer
from liveshard.runtime.agent.state import logical_checksums, state_tensors
from liveshard.runtime.agent.trainer import Trainer, TrainingSettings
from liveshard.runtime.agent.training import StepBoundary, StepGate
from liveshard.runtime.control.protocol import MemberResult, WorldPlan
from liveshard.runtime.control.store import JobStore
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.spec import ModelSpec

__all__ = ["Prepared", "StepGate", "StepRecord", "WorkerAgent", "WorkerOptions", "WorkerState"]


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

    def record_step(self, trainer: Any, world_size: int, loss: float | None) -> None:
        """Record the step ``trainer`` has just done (its loss: None where unknown)."""
        t = trainer
        self.records.append(StepRecord(t.step_count, loss, t.last_step_seconds, self.generation,
                                       world_size, t.consumed_samples, time.time()))


class WorkerAgent:
    """One training rank: its current world (``built``, ``trainer``, ``state``) and the
    collaborators that move it between worlds. ``step_gate``: called at every step boundary
    before the agreement (``training.StepGate``; None in production, dev tooling holds
    workers there)."""

    def __init__(self, worker_id: str, host: str, port: int, spec: ModelSpec,
                 settings: TrainingSettings, options: WorkerOptions | None = None,
                 job: str = "job", step_gate: StepGate | None = None) -> None:
        self.id = worker_id
        self.spec = spec
        self.settings = settings
        self.options = options or WorkerOptions()
        # One store client per thread: a c10d store client must not be used by two threads at once.
        self.clients = StoreClients(host, port, job, timeout=300.0)
        self.state = WorkerState()
        self.built: Any = None
        self.trainer: Trainer | None = None
        self.preparations = Preparations()
        self.checkpoints = SafetyCheckpoints(self.options, self.state, self.clients)
        self._device = worlds.device()  # fixed in the main thread (CUDA's current device is per thread)
        preparer = Preparer(worker_id, spec, self.options, self._device, self.clients, self.preparations,
                            self.heartbeat)
        self.control = ControlThread(worker_id, self.options, self.clients, self.state, self.preparations,
                                     self.checkpoints, preparer.prepare, self.heartbeat)
        self.clients.control_thread = self.control.thread
        self.step_boundary = StepBoundary(self.clients, self.state, self.control, self.preparations,
                                          self.checkpoints, lambda prep, step: switching.switch(self, prep, step),
                                          step_gate)

    @property
    def store(self) -> JobStore:
        """The calling thread's store client."""
        return self.clients.store

    # ---- the main loop -----------------------------------------------------------------------
    def bootstrap(self) -> float:
        """Pay the one-off costs before joining the job (``training.warm_up``); seconds."""
        return training.warm_up(self._device)

    def run(self) -> WorkerState:
        self.state.events.append({"kind": "bootstrap", "seconds": self.bootstrap(), "time": time.time()})
        self.checkpoints.check_dir()
        register(self.clients, self.id)
        self.control.start()
        try:
            while not self.stopping():
                if self.state.phase == "left":
                    break
                if self.trainer is None or self.state.phase == "broken":
                    if not switching.wait_for_plan(self):
                        break
                    continue
                training.train_one(self.state, self.trainer, self.built.cfg.world_size, self._after_step)
            if self.state.phase != "left":
                self.state.phase = "exited"
        finally:
            self.heartbeat(time.time())
            self.control.stop()
        return self.state

    def stopping(self) -> bool:
        if self.options.max_steps is not None and self.trainer is not None \
                and self.trainer.step_count >= self.options.max_steps:
            return True
        return self.control.stop_requested  # set by the control thread: training never waits on the store

    def _after_step(self) -> None:
        t = self.trainer
        o = self.options
        if o.save_at_step is not None and t.step_count == o.save_at_step and o.save_dir:
            from liveshard.runtime.agent import checkpoint

            checkpoint.save(self.built, t, o.save_dir)
            self.state.phase = "left"  # the restart path: every process exits after saving
            return
        self.step_boundary(t, self.built)

    # ---- the current world -------------------------------------------------------------------
    def heartbeat(self, now: float) -> None:
        send_heartbeat(self.store, self.id, heartbeat_payload(now, self.state, self.trainer))

    def report(self, gen: int, result: MemberResult) -> None:
        report_result(self.store, self.id, gen, result)

    def build(self, cfg: ParallelConfig, initialize: bool = True,
              spare_buffers: list[torch.Tensor] | None = None) -> None:
        """Build the model of ``cfg`` in the current training world, and its trainer."""
        from liveshard.runtime.megatron.build import build_model

        self.built = build_model(self.spec, cfg, seed=self.settings.seed, lr=self.settings.lr,
                                 clip_grad=self.settings.clip_grad, hidden_dropout=0.0, attention_dropout=0.0,
                                 perform_initialization=initialize, spare_buffers=spare_buffers)
        self.trainer = Trainer(self.built, self.settings)

    def adopt(self, plan: WorldPlan, rank: int | None) -> None:
        """This worker now follows ``plan``: as rank ``rank``, or as a standby (None)."""
        self.preparations.drop_through(plan.generation)
        if rank is not None:
            self.state.ready.append({"generation": plan.generation, "time": time.time()})
        self.state.generation = plan.generation
        self.state.plan = plan
        self.state.rank = rank
        self.state.phase = "training" if rank is not None else "standby"

    def teardown(self) -> None:
        """Drop the model and the training world (a broken world's communicators included)."""
        self.checkpoints.abandon()  # finalized before any orderly switch; only a broken world has one left
        if self.trainer is None:
            return
        from liveshard.runtime.megatron.build import destroy

        self.trainer = None
        self.built = None
        destroy()
        worlds.destroy_training_world()

    # ---- results -----------------------------------------------------------------------------
    def final_checksums(self) -> dict[str, int]:
        from liveshard.runtime.vps.layout import Layout

        layout = Layout(self.spec, self.built.cfg)
        return logical_checksums(layout, self.state.rank, state_tensors(self.built))
