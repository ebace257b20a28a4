"""Training reporting: megatron's FLOPs formula, the log line, TensorBoard events read back."""

from __future__ import annotations

import ast
import logging
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from liveshard.runtime.agent.reporting import StepLike, StepReporter, flops_per_step, format_step_line
from liveshard.runtime.presets import COUNTED_ONLY, PRESETS
from liveshard.runtime.spec import ModelSpec

DENSE = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=250,
                  max_sequence_length=64)
MOE = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                gated_linear_unit=True, num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
                moe_shared_expert_intermediate_size=32, vocab_size=250, max_sequence_length=64)


# ---- FLOPs -----------------------------------------------------------------------------------
def test_dense_gpt_flops_by_hand():
    # Per token, per layer (x6: 2 FLOPs per multiply-add, 3 GEMMs per forward GEMM):
    #   QKV 6*64*192 = 73728, QK^T and (QK^T)V under the causal mask 6*64*32 = 12288,
    #   out projection 6*64*64 = 24576, MLP (two 64x256 GEMMs) 6*64*256*2 = 196608
    # two layers: 2 * 307200 = 614400; logits 6*64*256 (vocab 250 padded to 256) = 98304
    per_token = 614400 + 98304
    assert flops_per_step(DENSE, seq_length=32, global_batch=8) == 8 * 32 * per_token == 182452224
    # The same from the closed form of Narayanan et al. (2021) with megatron's causal halving:
    # 72 B s L h^2 (1 + s/(12h) + V/(12 L h)).
    b, s, n_layers, h, v = 8, 32, 2, 64, 256
    closed = 72 * b * s * n_layers * h**2 * (1 + s / (12 * h) + v / (12 * n_layers * h))
    assert flops_per_step(DENSE, 32, 8) == pytest.approx(closed, rel=1e-12)


def test_moe_flops_by_hand():
    # GQA: q 4*16 = 64 rows, k and v 2 groups * 16 = 32 rows each.
    #   attention per layer: 6 * (64*(64+64) + 64*16 + 64*64) = 6 * 13312 = 79872
    # SwiGLU MoE, top-2 of 4 experts (ffn 32) and a shared expert (ffn 32), 3 GEMMs each:
    #   6 * 64 * (32*2*3 + 32*3) per layer = 110592
    # logits: 6 * 64 * 256 = 98304
    per_token = 2 * 79872 + 2 * 110592 + 98304
    assert per_token == 479232
    assert flops_per_step(MOE, seq_length=16, global_batch=4) == 4 * 16 * per_token == 30670848


def test_moe_counts_only_routed_and_shared_experts():
    more_experts = ModelSpec(**{**MOE.to_dict(), "num_moe_experts": 64})
    assert flops_per_step(more_experts, 16, 4) == flops_per_step(MOE, 16, 4)
    top3 = ModelSpec(**{**MOE.to_dict(), "moe_router_topk": 3})
    # one more expert: 6 * 64 * 32 * 3 FLOPs per token per layer
    assert flops_per_step(top3, 16, 4) - flops_per_step(MOE, 16, 4) == 4 * 16 * 2 * 6 * 64 * 32 * 3


def _norms_and_routers(spec: ModelSpec) -> int:
    """Parameters megatron's formula does not count as GEMMs: hidden norms, qk norms, routers."""
    norm = spec.hidden_size * (2 if spec.normalization == "LayerNorm" else 1)
    n = (2 * spec.num_layers + 1) * norm
    if spec.qk_layernorm:
        n += spec.num_layers * 2 * spec.kv_channels * (2 if spec.normalization == "LayerNorm" else 1)
    if spec.is_moe:
        n += (spec.num_layers - spec.moe_first_dense_layers) * spec.num_moe_experts * spec.hidden_size
    return n


@pytest.mark.parametrize("name", ["llama3-8b", "qwen3-30b-a3b", "deepseek-v2-lite"])
def test_flops_are_six_per_active_weight_per_token_plus_causal_attention(name):
    """An independent derivation from the spec's own parameter count: every GEMM weight a token
    uses costs 6 FLOPs (the input embedding is a lookup), plus core attention at half the
    sequence. Exact for bias-free models, MLA (with its LoRA norms) and first-k-dense MoE included."""
    spec = {**PRESETS, **COUNTED_ONLY}[name]
    s = 4096
    weights = (spec.num_parameters(active_only=True, padded_vocab=True)
               - spec.padded_vocab_size * spec.hidden_size - _norms_and_routers(spec))
    if spec.multi_latent_attention:
        core = spec.num_attention_heads * (spec.qk_head_dim + spec.qk_pos_emb_head_dim + spec.v_head_dim) * s / 2
    else:
        core = spec.kv_channels * spec.num_attention_heads * s
    per_token = 6 * weights + 6 * spec.num_layers * core
    assert flops_per_step(spec, s, 1) == pytest.approx(s * per_token, rel=1e-12)


def test_flops_scale_linearly_in_global_batch():
    for spec in (DENSE, MOE, COUNTED_ONLY["deepseek-v2-lite"]):
        one = flops_per_step(spec, 128, 1)
        assert flops_per_step(spec, 128, 7) == 7 * one
        assert flops_per_step(spec, 128, 1024) == 1024 * one
    # ... and not in sequence length (attention grows with it)
    assert flops_per_step(DENSE, 64, 1) > 2 * flops_per_step(DENSE, 32, 1)


def test_llama3_8b_order_of_magnitude():
    # The usual 6 * params * tokens estimate, to within the attention term (~10% at 8k tokens).
    f = flops_per_step(PRESETS["llama3-8b"], 8192, 1024)
    assert 6 * 8.03e9 * 8192 * 1024 < f < 1.25 * 6 * 8.03e9 * 8192 * 1024


# ---- the log line ----------------------------------------------------------------------------
@dataclass
class StepRecord:
    """The worker's StepRecord, field for field (``test_step_record_has_what_the_reporter_reads``
    holds the two together by reading worker.py's source: importing the worker needs the whole
    training stack)."""

    step: int
    loss: float | None
    seconds: float
    generation: int
    world_size: int
    consumed_samples: int
    time: float = 0.0
    lr: float | None = None
    grad_norm: float | None = None
    loss_scale: float | None = None
    skipped: bool = False
    samples: list[int] = field(default_factory=list)
    tokens: int = 0


def _annotations_in_source(path: Path, cls: str) -> dict[str, str]:
    tree = ast.parse(path.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    return {s.target.id: ast.unparse(s.annotation) for s in node.body if isinstance(s, ast.AnnAssign)}


def test_step_record_has_what_the_reporter_reads():
    worker = Path(__file__).resolve().parents[2] / "runtime" / "agent" / "worker.py"
    real = _annotations_in_source(worker, "StepRecord")
    read = {name: str(t).replace("typing.", "") for name, t in StepLike.__annotations__.items()}
    assert read.items() <= real.items(), set(read.items()) - set(real.items())
    copy = {name: str(t) for name, t in StepRecord.__annotations__.items()}
    assert copy.items() <= real.items(), set(copy.items()) - set(real.items())


def record(step: int = 120, **kw) -> StepRecord:
    base = dict(step=step, loss=4.12344, seconds=2.0, generation=3, world_size=8, consumed_samples=32 * step,
                lr=2.95e-4, grad_norm=1.2344, loss_scale=65536.0, tokens=24600)
    return StepRecord(**{**base, **kw})


def test_step_line_like_megatron():
    line = format_step_line(record(), train_iters=1000, flops_per_step=729.6e12, gpus=8, skipped=1)
    assert line == ("step 120/1000 | samples 3840 | loss 4.1234 | lr 2.95e-04 | grad norm 1.234 | "
                    "loss scale 65536 | 12.3k tokens/s | 45.6 TFLOP/s/GPU | world 8 | gen 3 | skipped 1")


def test_step_line_leaves_out_what_the_step_lacks():
    line = format_step_line(record(loss=None, loss_scale=None, grad_norm=None, tokens=3_000_000, seconds=1.5),
                            train_iters=10, flops_per_step=3e15, gpus=4)
    assert line == ("step 120/10 | samples 3840 | lr 2.95e-04 | 2.0M tokens/s | 500.0 TFLOP/s/GPU | "
                    "world 8 | gen 3 | skipped 0")
    assert "loss" not in line and "grad norm" not in line


# ---- the reporter ----------------------------------------------------------------------------
def reporter(tmp_path: Path | None, *, is_logger: bool = True, log_interval: int = 5, **kw) -> StepReporter:
    return StepReporter(DENSE, seq_length=32, global_batch=8, train_iters=100, log_interval=log_interval,
                        tensorboard_dir=str(tmp_path / "tb") if tmp_path else None, is_logger=is_logger,
                        logger=logging.getLogger("test.reporting"), **kw)


def scalars(log_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_scalars_read_back(tmp_path):
    r = reporter(tmp_path)
    for step in range(1, 13):
        r.step(record(step, loss=10.0 - step / 2, skipped=step in (3, 7), loss_scale=None,
                      grad_norm=None if step in (3, 7) else 0.5 + step, generation=0 if step < 6 else 1,
                      world_size=4 if step < 6 else 8))
    r.eval(10, loss=4.5, perplexity=90.0)
    r.reconfiguration(5, generation=1, downtime_seconds=1.25, before="dp4", after="dp4.tp2")
    r.close()

    acc = scalars(tmp_path / "tb")
    tags = set(acc.Tags()["scalars"])
    assert tags == {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_second", "train/tflops_per_gpu",
                    "train/world_size", "train/generation", "train/skipped_steps", "train/consumed_samples",
                    "eval/loss", "eval/perplexity", "reconfiguration/downtime_seconds"}  # no loss scale: bf16
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 13))
    assert [e.value for e in loss] == pytest.approx([10.0 - s / 2 for s in range(1, 13)])
    assert [e.step for e in acc.Scalars("train/grad_norm")] == [s for s in range(1, 13) if s not in (3, 7)]
    skipped = {e.step: e.value for e in acc.Scalars("train/skipped_steps")}
    assert skipped[2] == 0 and skipped[3] == 1 and skipped[6] == 1 and skipped[12] == 2
    assert {e.step: e.value for e in acc.Scalars("train/world_size")}[6] == 8
    assert acc.Scalars("train/consumed_samples")[-1].value == 32 * 12
    assert acc.Scalars("train/tokens_per_second")[0].value == pytest.approx(24600 / 2.0)
    tflops = flops_per_step(DENSE, 32, 8) / 2.0 / 4 / 1e12  # world of 4 at step 1
    assert acc.Scalars("train/tflops_per_gpu")[0].value == pytest.approx(tflops)
    assert [(e.step, e.value) for e in acc.Scalars("eval/perplexity")] == [(10, 90.0)]
    assert [(e.step, e.value) for e in acc.Scalars("reconfiguration/downtime_seconds")] == [(5, 1.25)]
    (text,) = acc.Tensors("reconfiguration/text_summary")
    assert text.step == 5
    assert text.tensor_proto.string_val[0].decode() == "generation 1: dp4 -> dp4.tp2, 1.25 s without training"


def test_loss_scale_is_written_under_fp16(tmp_path):
    r = reporter(tmp_path)
    r.step(record(1, loss_scale=65536.0))
    r.step(record(2, loss_scale=32768.0, skipped=True))
    r.close()
    assert [e.value for e in scalars(tmp_path / "tb").Scalars("train/loss_scale")] == [65536.0, 32768.0]


def test_log_lines_every_interval_and_the_first(caplog):
    r = reporter(None, log_interval=5)
    with caplog.at_level(logging.INFO, logger="test.reporting"):
        for step in range(3, 23):
            r.step(record(step))
    lines = [rec.getMessage() for rec in caplog.records]
    assert [line.split(" |")[0] for line in lines] == ["step 3/100", "step 5/100", "step 10/100",
                                                       "step 15/100", "step 20/100"]
    assert "TFLOP/s/GPU" in lines[0] and "world 8" in lines[0]


def test_eval_and_reconfiguration_lines(caplog):
    r = reporter(None)
    with caplog.at_level(logging.INFO, logger="test.reporting"):
        r.eval(40, loss=3.25, perplexity=25.79)
        r.reconfiguration(41, generation=2, downtime_seconds=0.5, before="dp8", after="dp4.pp2")
    assert [rec.getMessage() for rec in caplog.records] == [
        "validation at step 40 | loss 3.2500 | perplexity 25.790",
        "reconfiguration at step 41: generation 2: dp8 -> dp4.pp2, 0.50 s without training",
    ]


def test_non_logger_rank_writes_nothing(tmp_path, caplog):
    r = reporter(tmp_path, is_logger=False, log_interval=1)
    with caplog.at_level(logging.DEBUG, logger="test.reporting"):
        for step in range(1, 4):
            r.step(record(step, skipped=True))
        r.eval(3, 1.0, 2.7)
        r.reconfiguration(3, 1, 0.1, "a", "b")
        r.close()
    assert caplog.records == []
    assert not (tmp_path / "tb").exists()  # the writer is created lazily, on the logger only
    assert r.skipped_steps == 3  # counted anyway, for when this rank becomes the logger


def test_logger_handover_closes_the_writer(tmp_path):
    r = reporter(tmp_path)
    r.step(record(1))
    r.set_logger(False)  # flushed and closed: the new logger's events go beside these
    r.step(record(2))
    acc = scalars(tmp_path / "tb")
    assert [e.step for e in acc.Scalars("train/loss")] == [1]


def test_unwritable_tensorboard_dir_does_not_raise(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")  # a directory under a file fails even for root
    r = StepReporter(DENSE, seq_length=32, global_batch=8, train_iters=100, log_interval=1,
                     tensorboard_dir=str(blocker / "tb"), is_logger=True, logger=logging.getLogger("test.reporting"))
    with caplog.at_level(logging.INFO, logger="test.reporting"):
        for step in range(1, 4):
            r.step(record(step))
        r.eval(3, 1.0, 2.7)
        r.reconfiguration(3, 1, 0.1, "a", "b")
        r.close()
    warnings = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warnings) == 1 and "TensorBoard is off" in warnings[0].getMessage()
    assert sum(rec.getMessage().startswith("step ") for rec in caplog.records) == 3  # logging goes on


def test_a_failing_write_disables_tensorboard_once(tmp_path, caplog):
    r = reporter(tmp_path)
    r.step(record(1))
    writer = r._tensorboard()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    writer.add_scalar = full_disk
    with caplog.at_level(logging.WARNING, logger="test.reporting"):
        for step in range(2, 6):
            r.step(record(step))
    assert [rec.getMessage() for rec in caplog.records if "TensorBoard" in rec.getMessage()] == [
        f"TensorBoard is off for the rest of the run: cannot write to {tmp_path / 'tb'}: "
        "OSError: [Errno 28] No space left on device"]
    assert r._tensorboard() is None
    r.close()


# ---- Weights & Biases ------------------------------------------------------------------------
def test_wandb_off_says_why_once(monkeypatch, caplog):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))
    with caplog.at_level(logging.INFO, logger="test.reporting"):
        r = reporter(None, wandb_project="proj")
        r.step(record(1))
        r.step(record(2))
    off = [rec.getMessage() for rec in caplog.records if "Weights & Biases" in rec.getMessage()]
    assert off == ["Weights & Biases is off: set WANDB_API_KEY (or WANDB_MODE=offline) to use project 'proj'"]


def test_wandb_missing_package(monkeypatch, caplog):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setitem(sys.modules, "wandb", None)  # import raises ImportError
    with caplog.at_level(logging.INFO, logger="test.reporting"):
        reporter(None, wandb_project="proj").step(record(1))
    assert [rec.getMessage() for rec in caplog.records if "Weights & Biases" in rec.getMessage()] == [
        "Weights & Biases is off: the wandb package is not installed"]


class FakeRun:
    def __init__(self) -> None:
        self.logged: list[tuple[dict, int]] = []
        self.finished = False

    def log(self, data: dict, step: int) -> None:
        self.logged.append((data, step))

    def finish(self) -> None:
        self.finished = True


def test_wandb_logs_the_same_scalars(monkeypatch):
    run = FakeRun()
    inits: list[dict] = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: inits.append(kw) or run
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    r = reporter(None, wandb_project="proj")
    r.step(record(1))
    r.eval(1, 2.0, 7.4)
    r.close()
    assert len(inits) == 1 and inits[0]["project"] == "proj"
    assert inits[0]["config"]["global_batch"] == 8 and inits[0]["config"]["model"]["hidden_size"] == 64
    assert run.logged[0][1] == 1 and run.logged[0][0]["train/loss"] == pytest.approx(4.12344)
    assert run.logged[1] == ({"eval/loss": 2.0, "eval/perplexity": 7.4}, 1)
    assert run.finished


def test_wandb_failure_does_not_stop_training(monkeypatch, caplog):
    fake = types.ModuleType("wandb")

    def init(**kw):
        raise RuntimeError("network unreachable")

    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    with caplog.at_level(logging.WARNING, logger="test.reporting"):
        r = reporter(None, wandb_project="proj")
        for step in range(1, 4):
            r.step(record(step))
    assert len(caplog.records) == 1 and "init failed" in caplog.records[0].getMessage()
