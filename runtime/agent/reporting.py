"""What a person training a model watches: a log line per ``log_interval`` steps, TensorBoard
scalars every step, and optionally Weights & Biases.

Only one rank reports (the caller passes ``is_logger``: the first rank of the last pipeline
stage, which knows the loss). Reporting never stops training: a TensorBoard or W&B failure (a
full disk, a network error) is logged once and that sink is switched off.

``flops_per_step`` is megatron's model-FLOPs count, so the TFLOP/s/GPU shown here compares
directly with the number Megatron-LM prints for the same model and batch.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Protocol

from liveshard.runtime.spec import ModelSpec

__all__ = ["StepReporter", "flops_per_step", "format_step_line"]

_log = logging.getLogger("liveshard.training")


class StepLike(Protocol):
    """The fields of ``liveshard.runtime.agent.worker.StepRecord`` the reporter reads."""

    step: int
    loss: float | None
    seconds: float
    generation: int
    world_size: int
    consumed_samples: int
    lr: float | None
    grad_norm: float | None
    loss_scale: float | None
    skipped: bool
    tokens: int


# ---- FLOPs -----------------------------------------------------------------------------------
def flops_per_step(spec: ModelSpec, seq_length: int, global_batch: int) -> float:
    """Training FLOPs of one optimizer step (forward and backward over ``global_batch`` sequences).

    A port of ``num_floating_point_operations(args, batch_size)`` (its ``transformer_flops``
    branch) in Megatron-LM's ``megatron/training/training.py`` at tag ``core_v0.16.1``
    (commit 55ac7082517c3878ae653c07c09c534b8aed49f6), the megatron-core release liveshard runs:

    * every GEMM counts 2 FLOPs per multiply-add and is done 3 times (forward, weight gradient,
      data gradient); norms, biases, softmax and the MoE router are not counted;
    * core attention is halved for the causal mask (QK^T and (QK^T)V each ``s/2`` per query);
    * a gated linear unit (SwiGLU) stacks three ``h x ffn`` GEMMs instead of two;
    * an MoE layer counts its ``moe_router_topk`` routed experts plus the shared expert;
      ``moe_first_dense_layers`` is megatron's ``moe_layer_freq`` pattern with leading dense layers;
    * multi-latent attention counts its low-rank projections (their norms included, as megatron does);
    * the logits GEMM uses the padded vocabulary. The spec has no multi-token prediction,
      attention output gate or linear-attention layers, so those terms are zero.
    """
    if seq_length <= 0 or global_batch <= 0:
        raise ValueError(f"seq_length and global_batch must be positive, got {seq_length}, {global_batch}")
    fwd_bwd = 3  # forward, backward wgrad, backward dgrad
    fma = 2  # a multiply-add is two floating-point operations
    ffn_gemms = 3 if spec.gated_linear_unit else 2
    h, s, heads = spec.hidden_size, seq_length, spec.num_attention_heads

    if spec.is_moe:
        num_dense_layers = spec.moe_first_dense_layers
        num_moe_layers = spec.num_layers - num_dense_layers
        experts_routed_to = spec.moe_router_topk
        moe_ffn = spec.moe_ffn_hidden_size or spec.ffn_hidden_size
    else:
        num_dense_layers, num_moe_layers, experts_routed_to, moe_ffn = spec.num_layers, 0, 0, 0
    shared_ffn = spec.moe_shared_expert_intermediate_size or 0

    if spec.multi_latent_attention:
        q_head = spec.qk_head_dim + spec.qk_pos_emb_head_dim
        if spec.q_lora_rank:  # the spec, like its parameter count, treats 0 as "no q LoRA"
            q_term = spec.q_lora_rank * (h + heads * q_head + 1)
        else:
            q_term = h * heads * q_head
        attention = fwd_bwd * fma * (
            q_term
            + spec.kv_lora_rank * (h + heads * (spec.qk_head_dim + spec.v_head_dim) + 1)
            + h * spec.qk_pos_emb_head_dim
            + heads * spec.v_head_dim * h  # output projection
            + s * heads * q_head / 2  # QK^T under the causal mask
            + s * heads * spec.v_head_dim / 2  # (QK^T)V under the causal mask
        )
    else:
        query = spec.kv_channels * heads
        key_value = 2 * spec.kv_channels * spec.num_query_groups  # grouped-query attention
        attention = fwd_bwd * fma * (
            h * (query + key_value)  # QKV projection
            + query * s / 2 * 2  # QK^T and (QK^T)V, half of each under the causal mask
            + query * h  # output projection
        )

    mlp = fwd_bwd * fma * h * (
        spec.ffn_hidden_size * ffn_gemms * num_dense_layers
        + moe_ffn * experts_routed_to * ffn_gemms * num_moe_layers
        + shared_ffn * ffn_gemms * num_moe_layers
    )
    logits = fwd_bwd * fma * h * spec.padded_vocab_size
    return float(global_batch * s * (mlp + attention * spec.num_layers + logits))


# ---- the log line ----------------------------------------------------------------------------
def _si(x: float) -> str:
    for suffix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{suffix}"
    return f"{x:.1f}"


def _loss_scale(scale: float) -> str:
    # Dynamic loss scales are powers of two: whole numbers above 1, fractions after many backoffs.
    return f"{scale:.0f}" if scale >= 1 else f"{scale:g}"


def format_step_line(record: StepLike, *, train_iters: int, flops_per_step: float, gpus: int,
                     skipped: int = 0) -> str:
    """One step as Megatron-LM prints it, e.g.
    ``step 120/1000 | samples 3840 | loss 4.1234 | lr 2.95e-04 | grad norm 1.234 | loss scale 65536 |
    12.3k tokens/s | 45.6 TFLOP/s/GPU | world 8 | gen 3 | skipped 1``.

    Fields the step does not have (loss on a rank that does not know it, grad norm on a skipped
    step, loss scale outside fp16) are left out. ``skipped``: skipped steps so far.
    """
    r = record
    parts = [f"step {r.step}/{train_iters}", f"samples {r.consumed_samples}"]
    if r.loss is not None:
        parts.append(f"loss {r.loss:.4f}")
    if r.lr is not None:
        parts.append(f"lr {r.lr:.2e}")
    if r.grad_norm is not None:
        parts.append(f"grad norm {r.grad_norm:.3f}")
    if r.loss_scale is not None:
        parts.append(f"loss scale {_loss_scale(r.loss_scale)}")
    if r.seconds > 0:
        parts.append(f"{_si(r.tokens / r.seconds)} tokens/s")
        if gpus > 0:
            parts.append(f"{flops_per_step / r.seconds / gpus / 1e12:.1f} TFLOP/s/GPU")
    parts += [f"world {r.world_size}", f"gen {r.generation}", f"skipped {skipped}"]
    return " | ".join(parts)


# ---- the reporter ----------------------------------------------------------------------------
class StepReporter:
    """Log lines, TensorBoard scalars and (optionally) W&B for one training job, from one rank.

    ``is_logger`` says whether this rank reports; it can change after a reconfiguration
    (``set_logger``). The TensorBoard writer and the W&B run are created on first use, so
    ranks that never report never touch the TensorBoard directory or W&B.

    W&B is used when ``wandb_project`` is set, the ``wandb`` package is importable, and
    ``WANDB_API_KEY`` or ``WANDB_MODE`` is set; the run's id, resumption and entity come from
    wandb's own environment variables (``WANDB_RUN_ID``, ``WANDB_RESUME``, ``WANDB_ENTITY``).
    """

    def __init__(self, spec: ModelSpec, *, seq_length: int, global_batch: int, train_iters: int,
                 log_interval: int, tensorboard_dir: str | None, is_logger: bool,
                 logger: logging.Logger | None = None, wandb_project: str | None = None,
                 tensorboard_flush_seconds: int = 30) -> None:
        if log_interval <= 0:
            raise ValueError(f"log_interval must be positive, got {log_interval}")
        self.spec = spec
        self.seq_length = seq_length
        self.global_batch = global_batch
        self.train_iters = train_iters
        self.log_interval = log_interval
        self.tensorboard_dir = tensorboard_dir
        self.is_logger = is_logger
        self.log = logger or _log
        self.wandb_project = wandb_project
        self.flush_seconds = tensorboard_flush_seconds
        self.flops_per_step = flops_per_step(spec, seq_length, global_batch)
        self.skipped_steps = 0
        self._logged_once = False
        self._writer: Any = None
        self._tb_failed = False
        self._wandb: Any = None  # the wandb module once a run is started
        self._wandb_run: Any = None
        self._wandb_decided = False
        if is_logger:
            self._decide_wandb()

    def set_logger(self, is_logger: bool) -> None:
        """After a reconfiguration another rank may be the logger: a rank that stops being it
        closes its writers so everything it wrote is on disk."""
        if self.is_logger and not is_logger:
            self.close()
        self.is_logger = is_logger
        if is_logger:
            self._decide_wandb()

    # ---- events ------------------------------------------------------------------------------
    def step(self, record: StepLike) -> None:
        if record.skipped:
            # Counted on every rank, so a rank that becomes the logger later knows the steps it
            # took part in (a rank that joined mid-run starts from 0).
            self.skipped_steps += 1
        if not self.is_logger:
            return
        # Megatron also prints the first step it sees: it shows the job is alive (and, after a
        # restart or reconfiguration, how the first step went).
        if record.step % self.log_interval == 0 or not self._logged_once:
            self._logged_once = True
            self.log.info("%s", format_step_line(record, train_iters=self.train_iters,
                                                 flops_per_step=self.flops_per_step, gpus=record.world_size,
                                                 skipped=self.skipped_steps))
        scalars: dict[str, float] = {
            "train/world_size": record.world_size,
            "train/generation": record.generation,
            "train/skipped_steps": self.skipped_steps,
            "train/consumed_samples": record.consumed_samples,
        }
        for name, value in (("train/loss", record.loss), ("train/lr", record.lr),
                            ("train/grad_norm", record.grad_norm), ("train/loss_scale", record.loss_scale)):
            if value is not None:
                scalars[name] = value
        if record.seconds > 0:
            scalars["train/tokens_per_second"] = record.tokens / record.seconds
            if record.world_size > 0:
                scalars["train/tflops_per_gpu"] = (self.flops_per_step / record.seconds
                                                   / record.world_size / 1e12)
        self._scalars(scalars, record.step)

    def eval(self, step: int, loss: float, perplexity: float) -> None:
        if not self.is_logger:
            return
        self.log.info("validation at step %d | loss %.4f | perplexity %.3f", step, loss, perplexity)
        self._scalars({"eval/loss": loss, "eval/perplexity": perplexity}, step)

    def reconfiguration(self, step: int, generation: int, downtime_seconds: float, before: str,
                        after: str) -> None:
        if not self.is_logger:
            return
        summary = f"generation {generation}: {before} -> {after}, {downtime_seconds:.2f} s without training"
        self.log.info("reconfiguration at step %d: %s", step, summary)
        self._scalars({"reconfiguration/downtime_seconds": downtime_seconds}, step)
        writer = self._tensorboard()
        if writer is not None:
            self._guard_tb(lambda: writer.add_text("reconfiguration", summary, global_step=step))
        if self._wandb_run is not None:
            self._guard_wandb(lambda: self._wandb_run.log({"reconfiguration/summary": summary}, step=step))

    def close(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            self._guard_tb(writer.close)
        if self._wandb_run is not None:
            run, self._wandb_run = self._wandb_run, None
            self._guard_wandb(run.finish)

    # ---- sinks -------------------------------------------------------------------------------
    def _scalars(self, scalars: dict[str, float], step: int) -> None:
        writer = self._tensorboard()
        if writer is not None:
            def write() -> None:
                for name, value in scalars.items():
                    writer.add_scalar(name, value, global_step=step)
            self._guard_tb(write)
        run = self._wandb_start()
        if run is not None:
            self._guard_wandb(lambda: run.log(dict(scalars), step=step))

    def _tensorboard(self) -> Any:
        if self._writer is not None or self._tb_failed or not self.tensorboard_dir or not self.is_logger:
            return self._writer
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.tensorboard_dir, flush_secs=self.flush_seconds)
        except Exception as e:  # an unwritable or missing mount, tensorboard not installed
            self._disable_tb(e)
        return self._writer

    def _guard_tb(self, write: Any) -> None:
        try:
            write()
        except Exception as e:  # a full disk or a vanished mount: training goes on without TensorBoard
            self._disable_tb(e)

    def _disable_tb(self, error: Exception) -> None:
        if not self._tb_failed:
            self.log.warning("TensorBoard is off for the rest of the run: cannot write to %s: %s: %s",
                             self.tensorboard_dir, type(error).__name__, error)
        self._tb_failed = True
        writer, self._writer = self._writer, None
        if writer is not None:
            with contextlib.suppress(Exception):  # the same failure again on flush; already reported
                writer.close()

    def _decide_wandb(self) -> None:
        """Whether W&B is used, decided once (on the logger rank) and said in one line if not."""
        if self._wandb_decided or not self.wandb_project:
            return
        self._wandb_decided = True
        try:
            import wandb
        except ImportError:
            self.log.info("Weights & Biases is off: the wandb package is not installed")
            return
        if not (os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE")):
            self.log.info("Weights & Biases is off: set WANDB_API_KEY (or WANDB_MODE=offline) to use "
                          "project %r", self.wandb_project)
            return
        self._wandb = wandb

    def _wandb_start(self) -> Any:
        if self._wandb_run is not None or self._wandb is None or not self.is_logger:
            return self._wandb_run
        config = {"model": self.spec.to_dict(), "seq_length": self.seq_length,
                  "global_batch": self.global_batch, "train_iters": self.train_iters,
                  "flops_per_step": self.flops_per_step}
        wandb, self._wandb = self._wandb, None  # one attempt: a failed init is not retried every step
        try:
            self._wandb_run = wandb.init(project=self.wandb_project, config=config)
            self._wandb = wandb
        except Exception as e:
            self.log.warning("Weights & Biases is off for the rest of the run: init failed: %s: %s",
                             type(e).__name__, e)
        return self._wandb_run

    def _guard_wandb(self, call: Any) -> None:
        try:
            call()
        except Exception as e:
            self.log.warning("Weights & Biases is off for the rest of the run: %s: %s", type(e).__name__, e)
            self._wandb_run, self._wandb = None, None
