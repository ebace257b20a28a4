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
   * **vote** (one all-reduce): a no leaves the old world training on its untouched state;
   * **commit**: the new world is built in the same process and loaded while the old state is
     kept; the generation's decision in the store (written once) commits it (the old state
     goes, leavers exit) or aborts it (every survivor holds the old state again, as a broken
     world the coordinator recovers) — see ``live_switch.py``.

A rank that dies without notice breaks the old world's collectives; the survivors stop, report
"broken" in their heartbeats and take the coordinator's recovery plan, which sources every
region from surviving replicas (or falls back to the last checkpoint). So too during the final
checkpoint at trainIters: the recovered world saves it again.

This module holds the agent's state and composes the phases, each in its own module:

| module | what it does |
|---|---|
| ``connection.py`` | store clients (one per thread), registration, heartbeats, results |
| ``pulse.py`` | the pulse: a process that writes the heartbeats while this one is busy |
| ``control.py`` | the control thread: heartbeats, watching plans, triggering preparation |
| ``cutoff.py`` | cutting the world off when the coordinator declares a peer dead (control thread) |
| ``prepare.py`` | preparing a plan in the background (``Prepared``, ``Preparations``) |
| ``training.py`` | one step and its record; the step-boundary agreement (``StepBoundary``) |
| ``step_log.py`` | the step log: each step's record appended and flushed as it is made (``--step-log``) |
| ``checkpoint_schedule.py`` | when safety checkpoints are saved, finalized or abandoned |
| ``final_save.py`` | the final checkpoint: retried, in a fallback directory, waiting for space |
| ``switch.py`` | waiting for a plan, starting a world, switching (live, or through a checkpoint) |
| ``live_switch.py`` | a live transition, ``Transition``: transfer, vote, build, decide, commit or abort |
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from liveshard.runtime.agent import switch as switching
from liveshard.runtime.agent import training
from liveshard.runtime.agent.checkpoint_schedule import SafetyCheckpoints
from liveshard.runtime.agent.compute_clock import ComputeGate
from liveshard.runtime.agent.connection import (
    StoreClients,
    beat,
    heartbeat_payload,
    new_incarnation,
    register,
    report_result,
    send_heartbeat,
)
from liveshard.runtime.agent.control import ControlThread
from liveshard.runtime.agent.prepare import Preparations, Prepared, Preparer
from liveshard.runtime.agent.pulse import Pulse
from liveshard.runtime.agent.reporting import StepReporter
from liveshard.runtime.agent.state import logical_checksums, state_tensors
from liveshard.runtime.agent.trainer import Trainer, optimizer_options
from liveshard.runtime.agent.training import PhaseGate, StepBoundary, StepGate
from liveshard.runtime.comms import release
from liveshard.runtime.comms import world as worlds
from liveshard.runtime.contract.env import Defaults
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.contract.training import TrainingSpec
from liveshard.runtime.control.protocol import MemberResult, WorldPlan
from liveshard.runtime.control.store import JobStore
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.spec import ModelSpec

log = logging.getLogger("liveshard.worker")

__all__ = ["Prepared", "StepGate", "StepRecord", "WorkerAgent", "WorkerOptions", "WorkerState"]


@dataclass
class WorkerOptions:
    heartbeat_interval: float = 0.5
    # Heartbeats from a process of their own (``pulse.py``), which the work in this one (a data
    # build, a compile holding the GIL) cannot starve; off: from the control thread only.
    pulse: bool = True
    pulse_stale_after: float = 300.0  # seconds without a new payload before the pulse falls silent
    poll_interval: float = 0.25  # how often the control thread looks for new plans
    collective_timeout: float = Defaults.COLLECTIVE_TIMEOUT  # seconds before a collective with a dead peer fails
    transfer_budget: int = Defaults.STAGING_BUDGET  # staging bytes per rank during a transfer
    verify: bool = False  # per-region checksums after each transfer
    # Which members allocate and touch their new tensors while the job still trains: "joiners"
    # (idle anyway), "all" (members too: the new state lives beside the old one a little
    # earlier) or "auto" (all on CPU, where first touching fresh memory is a large part of a
    # transfer; joiners on GPU, where the caching allocator serves the transfer's tensors and
    # memory taken early would be taken from the training step's activations).
    preallocate: str = "auto"
    # Whether a new member connects the next training world's communicators during prepare, so
    # the commit hands them over ("on"), or makes the world at the commit ("off"). "auto" is
    # "on" with gloo and NCCL alike; either way, when megatron's groups cannot be probed (a
    # megatron-core the probe does not know) the world is made at the commit.
    build_world_ahead: str = "auto"
    max_steps: int | None = None  # stop here instead of at trainIters (no final checkpoint)
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
    checkpoint_keep: int = 3  # complete checkpoints kept in checkpoint_dir (0: all)
    # Seconds a member waits at the commit point for the others to build the new world (a death
    # is decided sooner, by the coordinator).
    commit_timeout: float = 120.0
    # The final checkpoint (``final_save.py``): where it goes when checkpoint_dir fails (a volume
    # every worker sees; None: none), and how many seconds in all its retries wait for space
    # before the job fails.
    final_fallback_dir: str | None = None
    final_save_patience: float = Defaults.FINAL_SAVE_PATIENCE
    # Every step's record appended and flushed to this file as it is made (``step_log.py``),
    # so that a process killed later leaves the steps it trained; None: off.
    step_log: str | None = None


@dataclass
class StepRecord:
    """One optimizer step as the worker saw it (``run.json``'s ``steps``; the log line, TensorBoard)."""

    step: int
    loss: float | None  # mean over the global batch's loss tokens; None where this rank does not know it
    seconds: float
    generation: int
    world_size: int
    consumed_samples: int  # the data cursor after this step
    time: float = 0.0  # wall clock at the end of the step
    lr: float | None = None  # the learning rate the step was taken with
    grad_norm: float | None = None  # before clipping; None on a skipped step
    loss_scale: float | None = None  # fp16's dynamic loss scale, None otherwise
    compute_seconds: float | None = None  # this rank's forward and backward, without waits
    work_units: float | None = None  # the layer units it computed (planner.adapt.work_units)
    skipped: bool = False  # fp16 found inf/nan gradients: no update, the scale backs off
    samples: list[int] = field(default_factory=list)  # global dataset sample indices of the step, in order
    tokens: int = 0  # tokens in the global batch (global_batch * seq_length)


@dataclass
class Retired:
    """An old world's state between the commit vote and the commit point: its model and
    optimizer (their process groups are gone) and the RNG states of this process."""

    built: Any
    trainer: Trainer
    rng: dict


@dataclass
class WorkerState:
    generation: int | None = None
    plan: WorldPlan | None = None
    rank: int | None = None
    phase: str = "starting"
    records: list[StepRecord] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    ready: list[dict] = field(default_factory=list)  # when each generation's world could train
    evals: list[dict] = field(default_factory=list)  # validation runs: step, loss, perplexity
    final_checkpoint: str | None = None  # saved at trainIters
    failure: str | None = None  # why this worker gave up (phase "failed"): one line
    incarnation: str = field(default_factory=new_incarnation)  # this process's life as a member
    # the commit point of the newest live switch (``agent.commit_point.CommitPoint``): reported
    # to a restarted coordinator while its generation is open (``ControlThread._in_flight``)
    commit_point: Any = None
    # the append-only step log (``agent.step_log.StepLog``, ``WorkerOptions.step_log``): every
    # record also goes there as it is made; None: records are kept in memory only
    step_log: Any = None

    def record_step(self, trainer: Any, world_size: int, loss: float | None) -> None:
        """Record the step ``trainer`` has just done (its loss: None where unknown)."""
        t = trainer
        s = t.last_stats
        self.records.append(StepRecord(t.step_count, loss, t.last_step_seconds, self.generation,
                                       world_size, t.consumed_samples, time.time(), lr=s.lr,
                                       grad_norm=s.grad_norm, loss_scale=s.loss_scale, skipped=s.skipped,
                                       samples=list(s.samples), tokens=s.tokens,
                                       compute_seconds=s.compute_seconds, work_units=s.work_units))
        if self.step_log is not None:
            try:
                self.step_log.append(self.records[-1])
            except (OSError, ValueError) as e:  # a full disk never stops training: the log stops
                log.error("step log %s: %s; no more steps are written there", self.step_log.path, e)
                self.step_log = None


class WorkerAgent:
    """One training rank: its current world (``built``, ``trainer``, ``state``) and the
    collaborators that move it between worlds. ``step_gate`` and ``phase_gate``: called at
    every step boundary before the agreement and at every phase of a reconfiguration
    (``training.StepGate``, ``training.PhaseGate``; None in production, dev tooling holds
    workers there); ``compute_gate``: after every forward and backward
    (``compute_clock.ComputeGate``; None in production, dev tooling slows a device there)."""

    def __init__(self, worker_id: str, host: str, port: int, spec: ModelSpec,
                 training: TrainingSpec, options: WorkerOptions | None = None,
                 job: str = "job", step_gate: StepGate | None = None,
                 phase_gate: PhaseGate | None = None, compute_gate: ComputeGate | None = None) -> None:
        self.id = worker_id
        self.spec = spec
        self.training = training
        self.data: Any = None  # the job's datasets (JobData), built once before joining
        self.options = options or WorkerOptions()
        # One store client per thread: a c10d store client must not be used by two threads at once.
        self.clients = StoreClients(host, port, job, timeout=300.0)
        self.pulse = (Pulse(worker_id, host, port, job, interval=self.options.heartbeat_interval,
                            stale_after=self.options.pulse_stale_after) if self.options.pulse else None)
        self.state = WorkerState()
        if self.options.step_log:
            from liveshard.runtime.agent.step_log import StepLog

            self.state.step_log = StepLog(self.options.step_log, worker_id)
        self.built: Any = None
        self.trainer: Trainer | None = None
        self.preparations = Preparations()
        self.phase_gate = phase_gate
        self.compute_gate = compute_gate
        self.checkpoints = SafetyCheckpoints(self.options, self.state, self.clients)
        self._device = worlds.device()  # fixed in the main thread (CUDA's current device is per thread)
        preparer = Preparer(worker_id, spec, self.options, self._device, self.clients, self.preparations,
                            self.heartbeat, self.at_phase)
        self.control = ControlThread(worker_id, self.options, self.clients, self.state, self.preparations,
                                     self.checkpoints, preparer.prepare, self.heartbeat)
        self.clients.control_thread = self.control.thread
        self.reporter = StepReporter(spec, seq_length=training.seq_length, global_batch=training.global_batch,
                                     train_iters=training.train_iters, log_interval=training.logging.interval,
                                     tensorboard_dir=self._tensorboard_dir(), is_logger=False,
                                     wandb_project=training.logging.wandb_project)
        self.step_boundary = StepBoundary(self.clients, self.state, self.control, self.preparations,
                                          self.checkpoints, lambda prep, step: switching.switch(self, prep, step),
                                          step_gate)

    @property
    def store(self) -> JobStore:
        """The calling thread's store client."""
        return self.clients.store

    # ---- the main loop -----------------------------------------------------------------------
    def bootstrap(self) -> float:
        """Pay the one-off costs before joining the job (``training.warm_up``) and open its
        datasets (building megatron's index cache if no process has yet); seconds."""
        seconds = training.warm_up(self._device)
        from liveshard.runtime.agent.checkpoint import check_start_weights
        from liveshard.runtime.data.datasets import build_datasets, load_job_tokenizer

        t = self.training
        check_start_weights(self.spec, t)
        tokenizer = load_job_tokenizer(t, self.spec.vocab_size, self.spec.padded_vocab_size)
        cache = t.data.cache_dir or (os.path.join(self.options.checkpoint_dir, "data-cache")
                                     if self.options.checkpoint_dir else None)
        self.data = build_datasets(t, tokenizer, cache)
        return seconds + self.data.seconds

    def _tensorboard_dir(self) -> str | None:
        lg = self.training.logging
        if lg.tensorboard_dir:
            return lg.tensorboard_dir
        return os.path.join(self.options.checkpoint_dir, "tensorboard") if self.options.checkpoint_dir else None

    @property
    def last_step(self) -> int:
        """The step training ends at: ``max_steps`` if set, else the job's trainIters."""
        o = self.options
        return o.max_steps if o.max_steps is not None else self.training.train_iters

    def run(self) -> WorkerState:
        self.checkpoints.check_dir()  # first: the dataset cache lives under it when it is usable
        if self.pulse is not None and not self.pulse.start():
            self.pulse = None
        self.state.events.append({"kind": "bootstrap", "seconds": self.bootstrap(), "time": time.time()})
        register(self.clients, self.id, self.state.incarnation)
        self.control.start()
        try:
            while True:
                if self.state.phase == "left":
                    break
                if self.control.excluded is not None:
                    self.rejoin()
                    continue
                if self.control.stop_requested and (self.trainer is None or self.state.phase == "broken"):
                    break  # the job asked every worker to finish: nothing is recovered for it
                if self.trainer is None or self.state.phase == "broken":
                    if not switching.wait_for_plan(self):
                        break
                    continue
                if self.stopping():
                    if self._done() and self.options.max_steps is None:
                        self._finish()  # a world broken meanwhile is recovered (above), then saves again
                        if self.state.phase == "broken":
                            continue
                    break
                release.start()  # what the last switch retired is freed while this step computes
                training.train_one(self.state, self.trainer, self.built.cfg.world_size, self._after_step)
            if self.state.phase not in ("left", "finished", "failed"):
                self.state.phase = "exited"
        finally:
            self.control.stop()
            if self.pulse is not None:
                self.pulse.stop()  # so that the heartbeat below, this process's last state, is the last one
            send_heartbeat(self.store, self.id, heartbeat_payload(time.time(), self.state, self.trainer))
            self.reporter.close()
        return self.state

    def _done(self) -> bool:
        return self.trainer is not None and self.trainer.step_count >= self.last_step

    def stopping(self) -> bool:
        if self._done() and self.state.phase != "broken":  # a broken world is recovered first
            return True
        return self.control.stop_requested  # set by the control thread: training never waits on the store

    def _finish(self) -> None:
        """trainIters reached: save the final checkpoint (``final_save``: retried, in the
        fallback directory, after waiting for space), then tell the coordinator the job is done
        (rank 0) and leave as ``finished``; or, with every attempt spent, say why it cannot be
        saved (the coordinator fails the job) and leave as ``failed``. A peer lost meanwhile
        breaks the world as in a training step: the run loop takes the recovery, then saves again."""
        from liveshard.runtime.agent import final_save

        t = self.trainer
        path, error = None, None
        if self.checkpoints.configured_dir or self.options.final_fallback_dir:
            try:
                outcome = final_save.save(self)
            except Exception as e:
                if not training.is_comm_failure(e):
                    raise
                training.broke(self.state, t.step_count, e, "during the final checkpoint")
                return
            if isinstance(outcome, final_save.Saved):
                path = outcome.path
            else:
                error = outcome.reason
        else:
            log.warning("no checkpoint directory: the trained weights of step %d are not saved", t.step_count)
        self.state.final_checkpoint = path
        if self.state.rank == 0:
            self._report_finished(final_save.finished_record(t.step_count, t.consumed_samples, path,
                                                             self.state.generation, time.time(), error))
        if error:
            self.state.phase, self.state.failure = "failed", error
            self.state.events.append({"kind": "final-checkpoint-failed", "step": t.step_count, "error": error,
                                      "time": time.time()})
            log.error("%s", error)
            return
        self.state.phase = "finished"
        self.state.events.append({"kind": "finished", "step": t.step_count, "checkpoint": path, "time": time.time()})
        log.info("training finished at step %d; final checkpoint: %s", t.step_count, path or "none")

    def _report_finished(self, record: dict) -> None:
        """Rank 0's last word, ``Keys.FINISHED``: the coordinator learns the job's end from it
        alone. A coordinator restarted during the final save has a new store: the control thread
        reconnects to it meanwhile, so the write is tried again for ``FINISHED_REPORT_PATIENCE``
        seconds; then the error stands (the process exits non-zero and its pod is made again)."""
        from liveshard.runtime.agent.final_save import FINISHED_REPORT_PATIENCE

        deadline = time.monotonic() + FINISHED_REPORT_PATIENCE
        while True:
            try:
                self.store.set_json(Keys.FINISHED, record)
                return
            except Exception as e:
                if time.monotonic() >= deadline:
                    raise
                log.warning("telling the coordinator that training finished: %s; trying again", e)
                time.sleep(0.5)

    def _after_step(self) -> None:
        t = self.trainer
        o = self.options
        if o.save_at_step is not None and t.step_count == o.save_at_step and o.save_dir:
            from liveshard.runtime.agent import checkpoint

            checkpoint.save(self.built, t, o.save_dir)
            self.state.phase = "left"  # the restart path: every process exits after saving
            return
        record = self.state.records[-1]
        # the count travels with the training state (a joiner that becomes the logger knows it)
        self.reporter.skipped_steps = t.skipped_steps - int(record.skipped)
        self.reporter.step(record)
        if t.eval_due():
            self._evaluate()
        if t.step_count >= self.last_step:
            return  # the last step: nothing to switch to, the run loop finishes
        self.step_boundary(t, self.built)

    def _evaluate(self) -> None:
        """A validation run (collective, like a step: a peer lost here breaks the world)."""
        t0 = time.perf_counter()
        result = self.trainer.evaluate()
        if result is not None:
            loss, ppl = result
            self.state.evals.append({"step": self.trainer.step_count, "loss": loss, "perplexity": ppl,
                                     "generation": self.state.generation, "seconds": time.perf_counter() - t0})
            self.reporter.eval(self.trainer.step_count, loss, ppl)

    # ---- the current world -------------------------------------------------------------------
    def heartbeat(self, now: float) -> None:
        preparing = self.control.preparing
        beat(self.clients, self.id, heartbeat_payload(now, self.state, self.trainer,
                                                      preparing.generation if preparing else None), self.pulse)

    def report(self, gen: int, result: MemberResult) -> None:
        report_result(self.store, self.id, gen, result, self.clients.kept)

    def build(self, cfg: ParallelConfig, initialize: bool = True,
              spare_buffers: list[torch.Tensor] | None = None, groups_ready: bool = False) -> None:
        """Build the model of ``cfg`` in the current training world, and its trainer
        (``groups_ready``: megatron's groups are made already, ``megatron.build.init_parallel``)."""
        from liveshard.runtime.megatron.build import build_model

        self.built = build_model(self.spec, cfg, seed=self.training.seed,
                                 optimizer_options=optimizer_options(self.training), hidden_dropout=0.0,
                                 attention_dropout=0.0, perform_initialization=initialize,
                                 spare_buffers=spare_buffers, init_parallel_state=not groups_ready,
                                 group_timeout=self.options.collective_timeout)
        self.trainer = Trainer(self.built, self.training, self.data, compute_gate=self.compute_gate)
        from megatron.core import parallel_state

        # The log line and TensorBoard come from the first rank of the last pipeline stage.
        self.reporter.set_logger(parallel_state.is_pipeline_last_stage(ignore_virtual=True)
                                 and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
                                 and parallel_state.get_tensor_model_parallel_rank() == 0)

    def adopt(self, plan: WorldPlan, rank: int | None) -> None:
        """This worker now follows ``plan``: as rank ``rank``, or as a standby (None)."""
        self.preparations.drop_through(plan.generation)
        if rank is not None:
            self.state.ready.append({"generation": plan.generation, "time": time.time()})
        self.state.generation = plan.generation
        self.state.plan = plan
        self.state.rank = rank
        self.state.phase = "training" if rank is not None else "standby"

    def rejoin(self) -> None:
        """The job went on without this process (a plan declared it dead): drop its stale
        world and come back as a new member, which the next plan can admit as a joiner."""
        gen = self.control.excluded
        self.teardown()
        self.preparations.drop_after(None)
        self.step_boundary.forget_plans()
        self.state.generation, self.state.plan, self.state.rank = None, None, None
        self.state.incarnation = new_incarnation()
        self.state.phase = "waiting"
        self.state.events.append({"kind": "rejoined", "excluded_by": gen, "time": time.time()})
        log.warning("generation %s went on without this worker: rejoining as a new member (%s)",
                    gen, self.state.incarnation)
        register(self.clients, self.id, self.state.incarnation)
        self.control.excluded = None
        self.heartbeat(time.time())

    def at_phase(self, phase: str, generation: int) -> None:
        if self.phase_gate is not None:
            self.phase_gate(phase, generation)

    def teardown(self) -> None:
        """Drop the model and the training world (a broken world's communicators included)."""
        self.retire()

    def retire(self, defer_free: bool = False, keep_world: bool = False) -> Retired | None:
        """Tear the training world down (megatron's groups, the default group) and hand its
        state over to the caller instead of freeing it (None: no world). ``defer_free`` (a
        switch's pause): the groups' objects are freed once the next step starts (``release``).
        ``keep_world``: the default group stays (a survivor shrinks it, ``world_change.Shrink``)."""
        self.checkpoints.abandon()  # finalized before any orderly switch; only a broken world has one left
        kept = None
        if self.trainer is not None:
            from liveshard.runtime.agent.state import capture_rng

            kept = Retired(self.built, self.trainer, capture_rng())
        self.trainer = None
        self.built = None
        # also without a model: a build that failed half-way leaves its groups behind
        worlds.shutdown_current(defer_free, groups_only=keep_world)
        return kept

    def reinstate(self, kept: Retired | None) -> None:
        """A generation did not commit: drop what was built of it and hold ``kept`` again, as a
        broken world (its groups are gone) whose state the coordinator's recovery moves. With
        nothing kept (a joiner, a standby), wait for the next plan."""
        try:
            self.teardown()
        finally:  # whatever tearing the new world down raised, the old state is held again
            if kept is None:
                self.state.phase = "waiting"
            else:
                from liveshard.runtime.agent.state import restore_rng

                self.built, self.trainer = kept.built, kept.trainer
                restore_rng(kept.rng)
                self.state.phase = "broken"

    # ---- results -----------------------------------------------------------------------------
    def final_checksums(self) -> dict[str, int]:
        from liveshard.runtime.vps.layout import Layout

        layout = Layout(self.spec, self.built.cfg)
        return logical_checksums(layout, self.state.rank, state_tensors(self.built))
