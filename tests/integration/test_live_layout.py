"""The pure Virtual Parameter Space layout equals megatron-core's live one, region by region.

Live models are built by ``liveshard.runtime.megatron.build`` on gloo process groups of a shared
pool of spawned processes (megatron imports cost seconds per process, so one pool rebuilds
megatron for every config). Each rank reads its regions back with
``liveshard.runtime.megatron.extract``; the test compares them with ``Layout(spec, cfg)``.

The same pool runs short training runs (1F1B schedule, Adam, distributed optimizer) and a
checkpoint save/resume, so the rest of the runtime can rely on ``build.py``.

Not covered on CPU: MoE with tensor parallelism (needs sequence parallel, i.e. Apex or
TransformerEngine norms) and context parallelism (TransformerEngine attention).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from collections import Counter
from typing import Any

import pytest

from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.presets import PRESETS
from liveshard.runtime.spec import ModelSpec
from liveshard.runtime.vps.layout import Layout
from liveshard.runtime.vps.region import EXP_AVG, PARAM

if importlib.util.find_spec("megatron.core") is None:  # checked without importing it here
    pytest.skip("needs megatron-core (the runtime extra)", allow_module_level=True)
from liveshard.dev.procpool import GlooPool

pytestmark = pytest.mark.slow

POOL_SIZE = 8


@pytest.fixture(scope="module")
def pool():
    p = GlooPool(POOL_SIZE, preload=("liveshard.runtime.megatron.build", __name__), timeout_s=180)
    yield p
    p.close()


def _spec(preset: str, dtype: str | None) -> ModelSpec:
    name, _, impl = preset.partition("+")  # "tiny-llama+te": TransformerEngine's parameter layout
    spec = PRESETS[name]
    if impl:
        spec = dataclasses.replace(spec, transformer_impl="transformer_engine")
    return spec if dtype is None else dataclasses.replace(spec, params_dtype=dtype)


# ---- jobs: run on every rank of a pool world ---------------------------------------------------
def layout_job(rank: int, world: int, spec_data: dict, cfg_text: str) -> dict[str, Any]:
    from liveshard.runtime.megatron import build, extract

    spec = ModelSpec.from_dict(spec_data)
    layer_spec = None
    if spec.transformer_impl == "transformer_engine":  # TransformerEngine's structure, on CPU
        from liveshard.dev.fused_layer_spec import fused_layer_spec

        layer_spec = fused_layer_spec(spec)
    built = build.build_model(spec, ParallelConfig.parse(cfg_text), seed=7, layer_spec=layer_spec)
    try:
        return {"regions": extract.live_regions(built, rank), "buffers": extract.grad_buffers(built)}
    finally:
        del built
        build.destroy()


def _train(built: Any, steps: int, seed: int = 11, global_batch: int = 8, micro_batch: int = 2,
           seq: int = 16) -> list[float]:
    """``steps`` optimizer steps on one fixed global batch; the global mean loss of each step."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    data = torch.randint(0, built.spec.vocab_size, (global_batch, seq + 1),
                         generator=torch.Generator().manual_seed(seed))
    per_dp = global_batch // dp
    mine = data[dp_rank * per_dp:(dp_rank + 1) * per_dp]
    microbatches = per_dp // micro_batch
    position_ids = torch.arange(seq).unsqueeze(0).expand(micro_batch, seq)
    causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)

    def batches():
        for i in range(microbatches):
            chunk = mine[i * micro_batch:(i + 1) * micro_batch]
            yield chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        output = model(tokens, position_ids, causal, labels=labels)

        def loss_func(per_token_loss):
            loss = per_token_loss.float().mean()
            return loss, {"lm loss": loss.detach().clone()}  # the schedule scales `loss` in place

        return output, loss_func

    forward_backward = get_forward_backward_func()
    reports_loss = ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
    losses = []
    for _ in range(steps):
        built.ddp.zero_grad_buffer()
        built.optimizer.zero_grad()
        out = forward_backward(forward_step_func=forward_step, data_iterator=batches(), model=built.chunks,
                               num_microbatches=microbatches, seq_length=seq, micro_batch_size=micro_batch,
                               forward_only=False)
        ok, _, _ = built.optimizer.step()
        assert ok
        loss = torch.zeros(1, dtype=torch.float64)
        if reports_loss:
            loss += torch.stack([o["lm loss"] for o in out]).double().mean() / dp
        dist.all_reduce(loss)  # mean over data-parallel replicas, known on every rank
        losses.append(float(loss))
    return losses


_NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0}


def train_job(rank: int, world: int, spec_data: dict, cfg_text: str, steps: int) -> list[float]:
    from liveshard.runtime.megatron import build

    built = build.build_model(ModelSpec.from_dict(spec_data), ParallelConfig.parse(cfg_text), seed=3,
                              lr=3e-3, **_NO_DROPOUT)
    try:
        return _train(built, steps)
    finally:
        del built
        build.destroy()


def checkpoint_job(rank: int, world: int, spec_data: dict, cfg_text: str, resume_cfgs: list[str],
                   directory: str, initialize: bool = True) -> dict[str, list[float]]:
    """Train 2 steps, save (distributed optimizer, fully_reshardable), train 2 more; then resume
    from the checkpoint in fresh models (other seeds; uninitialised unless ``initialize``, as a
    worker restoring a checkpoint builds them) under each config and train the same 2."""
    from megatron.core import dist_checkpointing

    from liveshard.runtime.megatron import build

    spec = ModelSpec.from_dict(spec_data)
    metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
    built = build.build_model(spec, ParallelConfig.parse(cfg_text), seed=3, lr=3e-3, **_NO_DROPOUT)
    _train(built, 2)
    model_sd = built.model.sharded_state_dict()
    dist_checkpointing.save({"model": model_sd,
                             "optimizer": built.optimizer.sharded_state_dict(model_sd, metadata=metadata)},
                            directory)
    out = {"uninterrupted": _train(built, 2)}
    del built, model_sd
    build.destroy()
    for i, text in enumerate(resume_cfgs):
        built = build.build_model(spec, ParallelConfig.parse(text), seed=100 + i, lr=3e-3,
                                  perform_initialization=initialize, **_NO_DROPOUT)
        model_sd = built.model.sharded_state_dict()
        optim_sd = built.optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)
        loaded = dist_checkpointing.load({"model": model_sd, "optimizer": optim_sd}, directory)
        built.model.load_state_dict(loaded["model"])
        built.optimizer.load_state_dict(loaded["optimizer"])
        out[text] = _train(built, 2)
        del built, model_sd, optim_sd, loaded
        build.destroy()
    return out


def compat_job(rank: int, world: int) -> dict[str, Any]:
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from liveshard.runtime.megatron import compat

    first = compat.install()
    applied = compat.applied()
    methods = {name: getattr(DistributedOptimizer, name) for name in
               ("__init__", "load_state_dict", "sharded_state_dict", "get_parameter_state_dp_zero")}
    second = compat.install()
    return {
        "active": (first, second),
        "applied_once": applied == compat.applied(),
        "methods_unchanged": all(getattr(DistributedOptimizer, n) is m for n, m in methods.items()),
        "single_wrap": all(not getattr(getattr(m, "__wrapped__", None), "__liveshard_compat__", False)
                           for m in methods.values()),
        "current_device": torch.cuda.current_device(),
        "type_outside_patch": torch.zeros(1).type(),
        "n_applied": len(applied),
    }


# ---- the pure layout equals the live one -------------------------------------------------------
# (preset, parallel config, params dtype or None for the preset's), world sizes grouped so the
# pool re-forms its process group rarely.
LAYOUT_CASES = [
    # tied embeddings with the last-stage copy, learned positions, TP
    ("tiny-gpt", "tp=2,pp=2", None),
    ("tiny-gpt", "pp=2,dp=2,dist_opt", None),
    ("tiny-gpt", "tp=2,dp=2,dist_opt,bucket=2000", None),
    ("tiny-gpt", "dp=4,dist_opt", "bf16"),
    # SwiGLU, GQA, rope, untied, RMSNorm, no biases
    ("tiny-llama", "tp=2,dp=2", None),
    ("tiny-llama", "tp=2,dp=2,dist_opt", "bf16"),
    ("tiny-llama", "pp=2,dp=2,layers=1+3,dist_opt", None),
    ("tiny-llama", "tp=2,pp=2,dist_opt,bucket=3000", "bf16"),
    # MoE: expert-parallel buffers (tp=1 only on CPU)
    ("tiny-moe", "ep=2,dp=2", None),
    ("tiny-moe", "ep=4,dp=4,dist_opt,bucket=1000", None),
    ("tiny-qwen-moe", "ep=2,dp=2,dist_opt", "bf16"),
    ("tiny-qwen-moe", "pp=2,ep=2,dp=2,dist_opt", None),
    # TransformerEngine's structure (norms fused into the next linear layer), on CPU
    ("tiny-gpt+te", "tp=2,dp=2,dist_opt,bucket=2000", None),
    ("tiny-llama+te", "tp=2,pp=2,dist_opt", "bf16"),
    ("tiny-qwen-moe+te", "ep=2,dp=2,dist_opt", None),
    # eight ranks
    ("tiny-gpt", "tp=2,pp=2,dp=2,dist_opt,bucket=4000", "bf16"),
    ("tiny-gpt", "tp=2,pp=4", None),
    ("tiny-gpt", "tp=4,dp=2,dist_opt", None),
    ("tiny-llama", "pp=2,dp=4,layers=3+1,dist_opt", None),
    ("tiny-llama", "tp=2,dp=4,dist_opt,bucket=1500", "bf16"),
    ("tiny-moe", "pp=2,ep=4,dp=4,dist_opt", "bf16"),
    ("tiny-qwen-moe", "ep=8,dp=8,dist_opt", None),
]


def _case_id(case: tuple) -> str:
    preset, cfg, dtype = case
    return f"{preset}-{cfg}" + (f"-{dtype}" if dtype else "")


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=_case_id)
def test_pure_layout_equals_live_megatron(pool: GlooPool, case: tuple) -> None:
    preset, cfg_text, dtype = case
    spec, cfg = _spec(preset, dtype), ParallelConfig.parse(cfg_text)
    live = pool.run(layout_job, spec.to_dict(), cfg_text, world=cfg.world_size)
    layout = Layout(spec, cfg)

    for rank, got in enumerate(live):
        live_regions, pure_regions = sorted(got["regions"]), sorted(layout.regions(rank))
        assert live_regions, f"rank {rank}: no live regions"
        if live_regions != pure_regions:
            only_live = sorted(set(live_regions) - set(pure_regions))
            only_pure = sorted(set(pure_regions) - set(live_regions))
            lines = [f"rank {rank} ({cfg.coord(rank)}): {len(only_live)} live-only, {len(only_pure)} pure-only"]
            lines += [f"  live {tuple(r)}" for r in only_live[:8]]
            lines += [f"  pure {tuple(r)}" for r in only_pure[:8]]
            pytest.fail("\n".join(lines))

        # The grad buffers (bucket boundaries, parameter offsets) agree as well.
        pure_buffers = [
            (bool(b.params and b.params[0].param.expert), b.dp_size, tuple(b.buckets),
             tuple(sorted(((bp.param.name, bp.start, bp.bucket) for bp in b.params), key=lambda t: t[1])))
            for b in layout.buffers(rank)
        ]
        live_buffers = [(b.expert, b.dp_size, b.buckets, b.params) for b in got["buffers"]]
        assert live_buffers == pure_buffers, f"rank {rank}: grad buffers differ"

    # Independent of the pure side: megatron's primary copies hold every weight exactly once.
    all_live = [r for got in live for r in got["regions"]]
    primary_param = sum(r.numel for r in all_live if r.state == PARAM and r.primary)
    assert primary_param == spec.num_parameters(padded_vocab=True)
    if cfg.bucket_size is not None and cfg.dist_opt:
        assert any(len(b.buckets) > 1 for got in live for b in got["buffers"]), "bucket_size made no buckets"
    if cfg.dist_opt and not spec.is_moe:
        # Adam state is sharded over DP, not replicated: each element once per DP group.
        held = Counter()
        for r in all_live:
            held[r.state] += r.numel
        assert held[EXP_AVG] * cfg.dp == held[PARAM]


# ---- build.py: training and checkpoint resume --------------------------------------------------
# Configs within a group build the same initial weights (CPU initialisation slices one full
# master weight, so TP and DP do not change it; PP and EP do), see the same global batch and
# must follow the same loss curve.
TRAIN_GROUPS = [
    ("tiny-gpt", None, ["tp=2,pp=2", "pp=2,dp=2", "pp=2,dp=2,dist_opt"]),
    ("tiny-llama", None, ["tp=2,dp=2", "tp=2,dp=2,dist_opt", "dp=4,dist_opt,bucket=2000"]),
    ("tiny-llama", "bf16", ["tp=2,dp=2,dist_opt"]),
    ("tiny-llama", None, ["pp=2,dp=2,layers=1+3,dist_opt"]),
    ("tiny-moe", None, ["ep=2,dp=2,dist_opt", "ep=2,dp=2"]),
]


@pytest.mark.parametrize("group", TRAIN_GROUPS, ids=lambda g: f"{g[0]}-{g[1] or 'default'}-{'|'.join(g[2])}")
def test_training_steps_reduce_loss_and_agree_across_configs(pool: GlooPool, group: tuple) -> None:
    preset, dtype, cfgs = group
    spec = _spec(preset, dtype)
    curves = {}
    for text in cfgs:
        per_rank = pool.run(train_job, spec.to_dict(), text, 3, world=ParallelConfig.parse(text).world_size)
        assert all(r == per_rank[0] for r in per_rank), f"{text}: ranks disagree on the loss {per_rank}"
        curve = curves[text] = per_rank[0]
        assert all(math.isfinite(x) for x in curve), f"{text}: {curve}"
        assert curve[0] > curve[1] > curve[2], f"{text}: loss does not decrease: {curve}"
        assert abs(curve[0] - math.log(spec.padded_vocab_size)) < 0.5, f"{text}: odd initial loss {curve}"
    reference = curves[cfgs[0]]
    tolerance = 2e-2 if spec.params_dtype != "fp32" else 1e-5
    for text, curve in curves.items():
        assert curve == pytest.approx(reference, rel=tolerance), f"{text} vs {cfgs[0]}: {curve} != {reference}"


@pytest.mark.long  # a restore bit for bit in the default run: test_checkpoint_trust, test_run_local
def test_checkpoint_resume_with_distributed_optimizer(pool: GlooPool, tmp_path) -> None:
    """Resume is exact at the saved config and within float tolerance at another DP/TP split
    (this exercises compat's fixes to the plain-Adam checkpoint path: without any one of them
    loading raises or the second resumed step diverges)."""
    spec = _spec("tiny-llama", "bf16")
    directory = tmp_path / "ckpt"
    directory.mkdir()  # megatron's checkpoint writer expects it
    out = pool.run(checkpoint_job, spec.to_dict(), "tp=2,dp=2,dist_opt", ["tp=2,dp=2,dist_opt", "dp=4,dist_opt"],
                   str(directory), world=4)
    result = out[0]
    assert all(o == result for o in out)
    assert result["tp=2,dp=2,dist_opt"] == result["uninterrupted"]
    assert result["dp=4,dist_opt"] == pytest.approx(result["uninterrupted"], rel=1e-3)


def rebuild_job(rank: int, world: int, rebuilds: int) -> list[int]:
    """Open file descriptors after each build/destroy cycle (each gloo group holds sockets)."""
    import gc

    from liveshard.runtime.megatron import build

    counts = []
    for i in range(rebuilds):
        cfg = ParallelConfig.parse(("tp=2", "dp=2,dist_opt", "pp=2")[i % 3])
        built = build.build_model(PRESETS["tiny-llama"], cfg, seed=i)
        del built
        build.destroy()
        gc.collect()
        counts.append(len(os.listdir("/proc/self/fd")))
    return counts


def test_rebuilding_in_process_frees_process_groups(pool: GlooPool) -> None:
    """The runtime switches configs in-process: rebuilds must not pile up communicators
    (megatron's destroy_model_parallel alone leaves ~75 sockets per rebuild here)."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc to count file descriptors")
    for counts in pool.run(rebuild_job, 6, world=2):
        assert max(counts[3:]) - min(counts[:3]) <= 8, counts


def uninitialised_build_job(rank: int, world: int, spec_data: dict, cfg_text: str) -> dict[str, Any]:
    """Train 2 steps from a model's state, then again in a model built uninitialised (no tied-
    embedding all-reduce at build) that was given the same state, as a commit does."""
    from liveshard.runtime.agent.state import load_state, state_tensors
    from liveshard.runtime.megatron import build

    spec, cfg = ModelSpec.from_dict(spec_data), ParallelConfig.parse(cfg_text)
    built = build.build_model(spec, cfg, seed=3, lr=3e-3, **_NO_DROPOUT)
    state = {k: t.clone() for k, t in state_tensors(built).items()}
    try:
        reference = _train(built, 2)
    finally:
        del built
        build.destroy()
    built = build.build_model(spec, cfg, seed=99, lr=3e-3, perform_initialization=False, **_NO_DROPOUT)
    try:
        load_state(built, state, step=0)
        return {"reference": reference, "rebuilt": _train(built, 2)}
    finally:
        del built
        build.destroy()


def test_a_model_built_uninitialised_trains_like_the_state_it_was_given(pool: GlooPool, tmp_path) -> None:
    """Tied embeddings over 2 stages: both copies come with the state (a transfer's, or a
    checkpoint's), not from the build."""
    spec = PRESETS["tiny-gpt"]
    assert spec.share_embeddings_and_output_weights
    for out in pool.run(uninitialised_build_job, spec.to_dict(), "pp=2", world=2):
        assert out["rebuilt"] == out["reference"]
    directory = tmp_path / "ckpt"
    directory.mkdir()
    for out in pool.run(checkpoint_job, spec.to_dict(), "pp=2", ["pp=2"], str(directory), False, world=2):
        assert out["pp=2"] == out["uninterrupted"]


def rng_job(rank: int, world: int) -> tuple[list[float], list[float]]:
    import torch
    from megatron.core import tensor_parallel

    from liveshard.runtime.megatron import build, compat

    compat.install()
    build.init_parallel(ParallelConfig.parse("tp=2,dp=2"))
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(5, force_reset_rng=True)
        with tensor_parallel.get_cuda_rng_tracker().fork():  # what TP-region dropout uses
            inside = torch.rand(4).tolist()
        return inside, torch.rand(4).tolist()
    finally:
        build.destroy()


def test_rng_tracker_differs_across_tp_ranks_only_inside_fork(pool: GlooPool) -> None:
    """megatron's RNG semantics on the CPU generator: TP ranks draw different dropout masks
    inside the tracker's fork, DP replicas the same ones, and outside the fork all agree."""
    (in0, out0), (in1, out1), (in2, out2), (in3, out3) = pool.run(rng_job, world=4)
    assert in0 != in1 and in0 == in2 and in1 == in3
    assert out0 == out1 == out2 == out3


def test_compat_install_is_idempotent(pool: GlooPool) -> None:
    (result,) = pool.run(compat_job, world=1)
    assert result["active"] == (True, True)  # CPU-only torch here: the patches are active
    assert result["applied_once"] and result["methods_unchanged"] and result["single_wrap"]
    assert result["current_device"] == "cpu"
    assert result["type_outside_patch"] == "torch.FloatTensor"  # Tensor.type() is patched only inside megatron calls
    assert result["n_applied"] >= 10


def test_build_rejects_configs_megatron_cannot_run_on_cpu() -> None:
    pytest.importorskip("torch")
    import torch

    from liveshard.runtime.errors import ConfigError
    from liveshard.runtime.megatron.build import transformer_config

    if torch.cuda.is_available():
        pytest.skip("the CPU-only limits do not apply")
    with pytest.raises(ConfigError, match=r"^tp: MoE") as e:
        transformer_config(PRESETS["tiny-moe"], ParallelConfig.parse("tp=2,dp=2"))
    assert "fix:" in str(e.value)
    with pytest.raises(ConfigError, match=r"^cp:"):
        transformer_config(PRESETS["tiny-llama"], ParallelConfig.parse("cp=2"))
