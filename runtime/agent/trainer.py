"""One rank's megatron-core training loop: a fixed global batch per step, whatever the layout.

``Trainer.step()`` runs one optimizer step with megatron's pipeline schedule
(``get_forward_backward_func``), reading this DP rank's share of the global batch from the
deterministic token source at the current sample cursor. The number of micro-batches per DP
rank follows the config, so a reconfiguration keeps the global batch (and the data order)
unchanged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from liveshard.runtime.data import BatchPlan, SyntheticTokens


@dataclass(frozen=True)
class TrainingSettings:
    global_batch: int = 8
    micro_batch: int = 1
    seq_length: int = 32
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 2
    decay_steps: int = 1000
    seed: int = 1234
    data_seed: int = 1234
    clip_grad: float = 1.0


class Trainer:
    """Trains a ``BuiltModel`` (``liveshard.runtime.megatron.build``) one step at a time."""

    def __init__(self, built: Any, settings: TrainingSettings) -> None:
        from megatron.core import parallel_state
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.built = built
        self.settings = settings
        cfg = built.cfg
        self.batches = BatchPlan(settings.global_batch, settings.micro_batch, cfg.dp * cfg.cp)
        self.data = SyntheticTokens(built.spec.vocab_size, settings.seq_length, settings.data_seed)
        self.dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
        self.is_last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        self.dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        for group in built.optimizer.param_groups:
            # megatron's scheduler reads per-group bounds; the optimizer leaves min_lr unset.
            group["max_lr"] = settings.lr
            group["min_lr"] = settings.min_lr
        self.scheduler = OptimizerParamScheduler(
            built.optimizer,
            init_lr=0.0,
            max_lr=settings.lr,
            min_lr=settings.min_lr,
            lr_warmup_steps=settings.warmup_steps,
            lr_decay_steps=settings.decay_steps,
            lr_decay_style="cosine",
            start_wd=0.0,
            end_wd=0.0,
            wd_incr_steps=settings.decay_steps,
            wd_incr_style="constant",
        )
        self.step_count = 0  # optimizer steps taken (global)
        self.consumed_samples = 0  # the data cursor
        self.last_loss: float | None = None
        self.last_step_seconds = 0.0

    # ---- state that travels with a reconfiguration -------------------------------------------
    def progress(self) -> dict:
        return {"step": self.step_count, "consumed_samples": self.consumed_samples,
                "scheduler": self.scheduler.state_dict()}

    def restore_progress(self, progress: dict) -> None:
        self.step_count = int(progress["step"])
        self.consumed_samples = int(progress["consumed_samples"])
        self.scheduler.load_state_dict(progress["scheduler"])

    # ---- one step ----------------------------------------------------------------------------
    def _microbatches(self) -> list[dict]:
        s = self.settings
        samples = self.batches.rank_samples(self.consumed_samples, self.dp_rank)
        tokens = torch.from_numpy(self.data.batch(samples.start, len(samples)))
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        position_ids = torch.arange(s.seq_length, device=device).unsqueeze(0).expand(s.micro_batch, -1)
        # megatron's convention: True marks a masked-out (future) position.
        causal = torch.triu(torch.ones(1, 1, s.seq_length, s.seq_length, dtype=torch.bool, device=device),
                            diagonal=1)
        out = []
        for i in range(0, len(samples), s.micro_batch):
            chunk = tokens[i: i + s.micro_batch].to(device)
            out.append({"tokens": chunk[:, :-1].contiguous(), "labels": chunk[:, 1:].contiguous(),
                        "position_ids": position_ids, "attention_mask": causal})
        return out

    def step(self) -> float | None:
        """One optimizer step on the next global batch. Returns the batch loss on the rank that
        computes it (last pipeline stage), averaged over DP; None elsewhere."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        start = time.perf_counter()
        built, s = self.built, self.settings
        micro = self._microbatches()

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                           labels=batch["labels"])

            def loss_func(output_tensor):
                loss = output_tensor.float().mean()
                return loss, {"lm loss": loss.detach().clone()}  # megatron divides loss in place

            return output, loss_func

        built.ddp.zero_grad_buffer()
        built.optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro),
            model=built.chunks,
            num_microbatches=len(micro),
            seq_length=s.seq_length,
            micro_batch_size=s.micro_batch,
            forward_only=False,
        )
        ok, _, _ = built.optimizer.step()
        if not ok:
            raise RuntimeError(f"optimizer step {self.step_count} failed (non-finite gradients)")
        self.scheduler.step(increment=1)
        self.step_count += 1
        self.consumed_samples += s.global_batch
        self.last_step_seconds = time.perf_counter() - start  # the update is applied: the step is done
        loss = None
        if self.is_last_stage:
            value = torch.stack([x["lm loss"] for x in losses]).mean()
            if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
                dist.all_reduce(value, group=self.dp_group)
                value /= dist.get_world_size(self.dp_group)
            loss = float(value)
        self.last_loss = loss
        self.last_step_seconds = time.perf_counter() - start
        return loss
