"""One rank's megatron-core training loop: a fixed global batch per step, whatever the layout.

``Trainer.step()`` runs one optimizer step with megatron's pipeline schedule
(``get_forward_backward_func``) on this DP rank's share of the next global batch of the job's
train dataset (``liveshard.runtime.data.datasets``): samples ``[cursor, cursor + global_batch)``
in megatron's shuffled order, split over DP ranks and micro-batches by ``BatchPlan``. The
learning rate follows megatron's ``OptimizerParamScheduler``; with fp16 a step whose gradients
overflow is skipped (no update, the loss scale backs off) and still counts, as in Megatron-LM.
``evaluate()`` runs the validation split forward only.

What a reconfiguration must carry besides the tensors is ``progress()``: the step, the data
cursor, the scheduler and fp16's loss-scaler state.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from liveshard.runtime.agent.compute_clock import ComputeClock, ComputeGate
from liveshard.runtime.contract.training import TrainingSpec
from liveshard.runtime.data.batches import BatchPlan
from liveshard.runtime.planner.adapt import output_units, work_units


@dataclass
class StepStats:
    """What the last step did besides its loss (``StepRecord`` copies it)."""

    lr: float | None = None
    grad_norm: float | None = None
    loss_scale: float | None = None
    skipped: bool = False
    samples: range = field(default_factory=lambda: range(0))
    tokens: int = 0
    compute_seconds: float | None = None  # this rank's forward and backward, without waits
    work_units: float | None = None  # the layer units they computed (planner.adapt.work_units)


def optimizer_options(training: TrainingSpec) -> dict[str, Any]:
    """megatron ``OptimizerConfig`` fields of the job's optimizer (``build_model(optimizer=...)``)."""
    o = training.optimizer
    return {"lr": o.lr, "min_lr": o.min_lr, "weight_decay": o.weight_decay, "adam_beta1": o.adam_beta1,
            "adam_beta2": o.adam_beta2, "adam_eps": o.adam_eps, "clip_grad": o.clip_grad,
            "initial_loss_scale": training.initial_loss_scale}


class Trainer:
    """Trains a ``BuiltModel`` (``liveshard.runtime.megatron.build``) one step at a time."""

    def __init__(self, built: Any, training: TrainingSpec, data: Any, compute_gate: ComputeGate | None = None) -> None:
        from megatron.core import parallel_state
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.utils import get_model_config

        self.built = built
        self.training = training
        self.data = data  # a JobData
        cfg = built.cfg
        self.batches = BatchPlan(training.global_batch, training.micro_batch, cfg.dp * cfg.cp, cfg.dp_split)
        self.dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
        self.is_last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        self.dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        # An uneven split: megatron's schedule divides each micro-batch loss by this replica's
        # count m_r and DDP averages gradients over the dp replicas, so the back-propagated loss
        # is weighted m_r * dp / M (M: micro-batches of the step) to give every micro-batch of
        # the global batch 1/M, the even plan's update. None (no multiply) when even. MoE
        # auxiliary losses keep megatron's 1/m_r per micro-batch (a known approximation: their
        # scale is set inside the schedule; the runtime builds models with aux-loss coefficient 0).
        self._loss_weight = (None if self.batches.split is None else
                             self.batches.micro_batches(self.dp_rank) * self.batches.dp
                             / self.batches.total_micro_batches)
        o, s = training.optimizer, training.schedule
        for group in built.optimizer.param_groups:
            # megatron's scheduler reads per-group bounds; the optimizer leaves min_lr unset.
            group["max_lr"] = o.lr
            group["min_lr"] = o.min_lr
        self.scheduler = OptimizerParamScheduler(
            built.optimizer,
            init_lr=0.0,
            max_lr=o.lr,
            min_lr=o.min_lr,
            lr_warmup_steps=s.warmup_iters,
            lr_decay_steps=training.decay_iters,
            lr_decay_style=s.decay_style,
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=training.train_iters,
            wd_incr_style="constant",
            wsd_decay_steps=s.wsd_decay_iters or None,
            lr_wsd_decay_style=s.wsd_decay_style,
        )
        self.step_count = 0  # optimizer steps taken (global; skipped fp16 steps included)
        self.consumed_samples = 0  # the data cursor
        self.skipped_steps = 0
        self.last_loss: float | None = None
        self.last_step_seconds = 0.0
        self.last_stats = StepStats()
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        # megatron's convention: True marks a masked-out (future) position; one mask for all samples.
        self._causal = torch.triu(torch.ones(1, 1, training.seq_length, training.seq_length, dtype=torch.bool,
                                             device=device), diagonal=1)
        self._device = device
        # Compute time apart from waits: megatron's schedules start and stop these timers
        # around each micro-batch's forward and backward (``compute_clock``).
        self.clock = ComputeClock(gate=compute_gate)
        get_model_config(built.chunks[0]).timers = self.clock
        rank = built.rank
        self._work_per_microbatch = work_units(cfg, rank, built.spec.num_layers,
                                               output_units(built.spec, training.seq_length), 1) \
            if rank < cfg.world_size else 0.0
        self.compute_log: deque[tuple[int, float, float]] = deque(maxlen=8)  # (step, seconds, units)
        self._steps_in_world = 0

    # ---- state that travels with a reconfiguration -------------------------------------------
    def progress(self) -> dict:
        return {"step": self.step_count, "consumed_samples": self.consumed_samples,
                "skipped_steps": self.skipped_steps, "scheduler": self.scheduler.state_dict(),
                "grad_scalers": [g.state_dict() for g in self._grad_scalers()]}

    def fast_forward(self, step: int) -> None:
        """Continue a run whose progress was not saved with it (a Megatron-LM checkpoint): the
        step of its iteration, the samples of that many global batches, the LR schedule there."""
        self.step_count = step
        self.consumed_samples = step * self.training.global_batch
        if step:
            self.scheduler.step(increment=step)

    def restore_progress(self, progress: dict) -> None:
        self.step_count = int(progress["step"])
        self.consumed_samples = int(progress["consumed_samples"])
        self.skipped_steps = int(progress.get("skipped_steps", 0))
        # The step count only: the schedule's shape (warm-up, decay, bounds) is this job's
        # spec.training, also when it continues another run's checkpoint with other settings.
        sched = progress["scheduler"]
        self.scheduler.num_steps = 0
        self.scheduler.step(increment=int(sched.get("num_steps", sched.get("num_iters", 0))))
        scalers = self._grad_scalers()
        saved = progress.get("grad_scalers") or []
        if scalers and saved:
            # Every optimizer of a chain (dense, expert) scales alike: one state fits each.
            for i, scaler in enumerate(scalers):
                self._load_scaler(scaler, saved[min(i, len(saved) - 1)])

    def _load_scaler(self, scaler: Any, state: dict) -> None:
        """megatron's ``DynamicGradScaler.load_state_dict`` with the scale on this rank's device
        (megatron's moves it with ``.cuda()``, which a CPU run has not got)."""
        scale = state["scale"]
        scale = scale if torch.is_tensor(scale) else torch.tensor([float(scale)])
        scaler._scale = scale.to(device=self._device, dtype=torch.float).reshape(1)
        scaler._growth_tracker = int(state.get("growth_tracker", 0))
        scaler._hysteresis_tracker = int(state.get("hysteresis_tracker", getattr(scaler, "hysteresis", 1)))

    def _grad_scalers(self) -> list[Any]:
        chain = getattr(self.built.optimizer, "chained_optimizers", [self.built.optimizer])
        return [opt.grad_scaler for opt in chain if getattr(opt, "grad_scaler", None) is not None]

    # ---- one step ----------------------------------------------------------------------------
    def _microbatches(self, samples: range, split: str = "train") -> list[dict]:
        mb = self.training.micro_batch
        batch = self.data.batch(samples, split)
        out = []
        for i in range(0, len(samples), mb):
            part = {k: v[i: i + mb].to(self._device) for k, v in batch.items()}
            part["attention_mask"] = self._causal
            out.append(part)
        return out

    def _forward_step(self, data_iterator: Any, model: Any) -> tuple[Any, Any]:
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        mask = batch["loss_mask"].float()

        def loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict]:
            # The mean over the micro-batch's loss tokens (megatron's per-sequence-averaged loss).
            loss = (output_tensor.float() * mask).sum() / mask.sum().clamp(min=1.0)
            if self._loss_weight is not None:
                return loss * self._loss_weight, {"lm loss": loss.detach().clone()}
            return loss, {"lm loss": loss.detach().clone()}  # megatron divides loss in place

        return output, loss_func

    def _schedule(self, micro: list[dict], forward_only: bool) -> list[dict]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(
            forward_step_func=self._forward_step,
            data_iterator=iter(micro),
            model=self.built.chunks,
            num_microbatches=len(micro),
            seq_length=self.training.seq_length,
            micro_batch_size=self.training.micro_batch,
            forward_only=forward_only,
        )

    def _mean_over_dp(self, losses: list[dict]) -> float | None:
        """The mean of the micro-batch losses over DP, on the last pipeline stage; None elsewhere.
        With an uneven split every micro-batch counts alike (the replicas' sums over M)."""
        if not self.is_last_stage:
            return None
        if self.batches.split is not None:
            value = torch.stack([x["lm loss"] for x in losses]).sum()
            if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
                dist.all_reduce(value, group=self.dp_group)
            return float(value / self.batches.total_micro_batches)
        value = torch.stack([x["lm loss"] for x in losses]).mean()
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(value, group=self.dp_group)
            value /= dist.get_world_size(self.dp_group)
        return float(value)

    def step(self) -> float | None:
        """One optimizer step on the next global batch. Returns the batch loss on the rank that
        computes it (last pipeline stage), averaged over DP; None elsewhere."""
        start = time.perf_counter()
        built, t = self.built, self.training
        samples = range(self.consumed_samples, self.consumed_samples + t.global_batch)
        micro = self._microbatches(self.batches.rank_samples(self.consumed_samples, self.dp_rank))
        lr = self.built.optimizer.param_groups[0]["lr"]
        built.ddp.zero_grad_buffer()
        built.optimizer.zero_grad()
        self.clock.begin_step()
        losses = self._schedule(micro, forward_only=False)
        ok, grad_norm, _ = built.optimizer.step()
        compute = self.clock.end_step()  # after the optimizer step: on a GPU its events are done by then
        units = self._work_per_microbatch * len(micro)
        if ok:
            self.scheduler.step(increment=1)
        else:  # fp16 overflow: no update, the scaler backs off; the batch is consumed all the same
            self.skipped_steps += 1
        self.step_count += 1
        self.consumed_samples += t.global_batch
        scale = built.optimizer.get_loss_scale() if self._grad_scalers() else None
        self.last_stats = StepStats(
            lr=float(lr), grad_norm=float(grad_norm) if ok and grad_norm is not None else None,
            loss_scale=float(scale) if scale is not None else None, skipped=not ok, samples=samples,
            tokens=t.global_batch * t.seq_length, compute_seconds=compute, work_units=units)
        self._steps_in_world += 1
        if self._steps_in_world > 1 and units > 0:  # the first step in a world pays one-off costs
            self.compute_log.append((self.step_count, compute, units))
        self.last_step_seconds = time.perf_counter() - start  # the update is applied: the step is done
        loss = self._mean_over_dp(losses)
        self.last_loss = loss
        self.last_step_seconds = time.perf_counter() - start
        return loss

    # ---- evaluation --------------------------------------------------------------------------
    def eval_due(self) -> bool:
        e = self.training.eval
        return bool(e.interval) and self.step_count % e.interval == 0 and self.data.valid is not None

    def evaluate(self) -> tuple[float, float] | None:
        """Validation loss and perplexity over ``eval.iters`` global batches: the first samples
        of the validation split, the same every time and in every layout. Collective over the
        world; the result on the last pipeline stage, None elsewhere."""
        t = self.training
        total, count = 0.0, 0
        for ddp in self.built.chunks:
            ddp.eval()
        try:
            with torch.no_grad():
                for k in range(t.eval.iters):
                    cursor = k * t.global_batch
                    losses = self._schedule(self._microbatches(self.batches.rank_samples(cursor, self.dp_rank),
                                                               "valid"), forward_only=True)
                    value = self._mean_over_dp(losses)
                    if value is not None:
                        total, count = total + value, count + 1
        finally:
            for ddp in self.built.chunks:
                ddp.train()
        if not count:
            return None
        loss = total / count
        return loss, math.exp(min(loss, 80.0))
