"""The parallelism planner: feasibility, placement, stragglers, constraints, errors, the CLI."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from liveshard.runtime.cli import main
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.planner.cost_model import Hardware, ModelCosts
from liveshard.runtime.planner.layer_split import balance_layers
from liveshard.runtime.planner.search import GPU, Constraints, NoFeasiblePlan, plan_parallelism
from liveshard.runtime.presets import PRESETS
from liveshard.runtime.vps.layout import Layout

GiB = 2**30
USABLE = Hardware().memory_usable_fraction


def fleet(n: int, per_node: int = 8, memory: int = 80 * GiB, speeds: dict[int, float] | None = None) -> list[GPU]:
    speeds = speeds or {}
    return [GPU(f"n{i // per_node}/{i % per_node}", f"n{i // per_node}", memory, speeds.get(i, 1.0))
            for i in range(n)]


def stage_nodes(plan) -> list[set[str]]:
    per_stage = plan.config.world_size // plan.config.pp
    return [{g.node for g in plan.gpus[s * per_stage:(s + 1) * per_stage]} for s in range(plan.config.pp)]


def check_plan(plan, gpus, c: Constraints) -> None:
    """What every plan must satisfy, whatever the cost model prefers."""
    cfg = plan.config
    assert len(plan.gpus) == cfg.world_size
    assert set(plan.gpus) | set(plan.standby) == set(gpus)
    assert not set(plan.gpus) & set(plan.standby)
    assert cfg.world_size % c.granularity == 0
    assert c.global_batch % (cfg.dp * c.micro_batch) == 0  # whole micro-batches per DP rank
    per_stage = cfg.world_size // cfg.pp
    for s, need in enumerate(plan.stage_memory_bytes):
        assert need <= USABLE * min(g.memory_bytes for g in plan.gpus[s * per_stage:(s + 1) * per_stage])
    assert plan.memory_bytes_per_gpu == max(plan.stage_memory_bytes)
    assert sum(s for _, s in plan.costs) == pytest.approx(plan.step_seconds)


# ---- the layer split (Malleus) ---------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(st.integers(1, 9), st.lists(st.tuples(st.floats(0.1, 5), st.floats(0, 5), st.integers(1, 9)),
                                   min_size=1, max_size=4))
def test_layer_split_is_optimal(num_layers, stages):
    slope, intercept, cap = map(list, zip(*stages))
    got = balance_layers(num_layers, slope, intercept, cap)
    best = None
    for n in itertools.product(*(range(1, c + 1) for c in cap)):
        if sum(n) == num_layers:
            value = max(a * k + b for a, k, b in zip(slope, n, intercept))
            best = value if best is None else min(best, value)
    if best is None:
        assert got is None
    else:
        assert sum(got) == num_layers and all(1 <= k <= c for k, c in zip(got, cap))
        assert max(a * k + b for a, k, b in zip(slope, got, intercept)) == pytest.approx(best)


def test_slower_stage_gets_fewer_layers():
    assert balance_layers(80, [2.0, 1.0, 1.0, 1.0], [0, 0, 0, 0]) == (11, 23, 23, 23)  # max(2 * 11, 23) = 23
    assert balance_layers(80, [1.0] * 4, [0, 0, 0, 0]) == (20, 20, 20, 20)
    assert balance_layers(10, [1.0, 1.0], [0, 0], [3, 20]) == (3, 7)  # memory cap binds
    assert balance_layers(10, [1.0, 1.0], [0, 0], [3, 6]) is None


# ---- the closed forms agree with the VPS layout ----------------------------------------------

@pytest.mark.parametrize(("model", "text"), [
    ("tiny-gpt", "tp=2,pp=2,dp=1"), ("tiny-gpt", "tp=1,pp=1,dp=2"),
    ("tiny-llama", "tp=2,pp=2,dp=1"), ("tiny-llama", "tp=2,pp=4,dp=1"),
    ("tiny-moe", "tp=2,pp=2,dp=2,ep=2,etp=1"), ("tiny-moe", "tp=2,pp=2,dp=2,ep=2"),
    ("tiny-qwen-moe", "tp=2,pp=1,dp=4,ep=4,etp=1"), ("tiny-qwen-moe", "tp=2,pp=2,dp=2,ep=4,etp=1"),
    ("llama3-8b", "tp=4,pp=2,dp=1"),
])
def test_parameters_per_rank_match_layout(model, text):
    spec = PRESETS[model]
    cfg = ParallelConfig.parse(text)
    layout = Layout(spec, cfg)
    k = ModelCosts.of(spec, spec.max_sequence_length, 1, Hardware())
    layers = cfg.stage_layers(spec.num_layers)
    for rank in range(cfg.world_size):
        c = cfg.coord(rank)
        expected = layers[c.pp] * (k.layer_dense_params(cfg.tp) + k.layer_expert_params(cfg.ep, cfg.expert_tp))
        if c.pp == 0:
            expected += k.first_stage_params(cfg.tp)
        if c.pp == cfg.pp - 1:
            expected += k.last_stage_params(cfg.tp, cfg.pp)
        assert sum(p.numel for p in layout.local_params(rank)) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("model", "text"), [
    ("llama3-8b", "tp=4,pp=2,dp=2,dist_opt"), ("llama3-8b", "tp=2,pp=2,dp=2"),
    ("qwen3-30b-a3b", "tp=2,pp=2,dp=4,ep=4,etp=1,dist_opt"), ("tiny-moe", "tp=2,pp=2,dp=2,ep=2,etp=1,dist_opt"),
])
def test_weights_and_optimizer_bytes_match_layout(model, text):
    """Weights + fp32 main copy + Adam moments per rank, as the VPS layout (with its padding) has them."""
    spec = PRESETS[model]
    cfg = ParallelConfig.parse(text)
    layout = Layout(spec, cfg)
    k = ModelCosts.of(spec, 4096, 1, Hardware())
    layers = cfg.stage_layers(spec.num_layers)
    for rank in (0, cfg.world_size - 1):
        c = cfg.coord(rank)
        dense = layers[c.pp] * k.layer_dense_params(cfg.tp)
        dense += (k.first_stage_params(cfg.tp) if c.pp == 0 else 0)
        dense += (k.last_stage_params(cfg.tp, cfg.pp) if c.pp == cfg.pp - 1 else 0)
        expert = layers[c.pp] * k.layer_expert_params(cfg.ep, cfg.expert_tp)
        shards = (cfg.dp, cfg.expert_dp) if cfg.dist_opt else (1, 1)
        closed = ((dense + expert) * spec.bytes_per_param
                  + (dense / shards[0] + expert / shards[1]) * k.optimizer_bytes_per_param())
        assert layout.rank_bytes(rank) == pytest.approx(closed, rel=2e-3)


# ---- memory ------------------------------------------------------------------------------------

def test_llama3_70b_does_not_fit_8_gpus_of_80gib():
    spec = PRESETS["llama3-70b"]
    # bf16 weights (2) + fp32 grads (4) + fp32 main weights and Adam moments (12) = 18 bytes per
    # parameter however it is split: 1.27 TB, but 8 GPUs of 80 GiB hold 0.69 TB.
    assert 18 * spec.num_parameters() > 8 * 80 * GiB
    with pytest.raises(NoFeasiblePlan) as e:
        plan_parallelism(spec, fleet(8), Constraints(seq_length=4096))
    assert e.value.short == "memory"
    assert "needs >= " in str(e.value) and "GPUs of 80 GiB" in str(e.value) and "(has 8)" in str(e.value)
    # The GPU count it names is the smallest that works: it plans there, and one group less fails.
    needed = int(str(e.value).split("needs >= ")[1].split()[0])
    assert needed * 80 * GiB >= 18 * spec.num_parameters()
    plan_parallelism(spec, fleet(needed), Constraints(seq_length=4096))
    with pytest.raises(NoFeasiblePlan):
        plan_parallelism(spec, fleet(needed - 1), Constraints(seq_length=4096))


def test_llama3_70b_fits_64_gpus_of_80gib_and_every_gpu_stays_within_memory():
    spec = PRESETS["llama3-70b"]
    c = Constraints(seq_length=4096)
    gpus = fleet(64)
    # 18 bytes/param over 64 GPUs is 19.8 GB each, a quarter of the memory: it must fit.
    assert 18 * spec.num_parameters() / 64 < 0.3 * 80 * GiB
    plan = plan_parallelism(spec, gpus, c)
    check_plan(plan, gpus, c)
    assert plan.config.world_size == 64


def test_smaller_gpus_force_more_model_parallelism():
    spec = PRESETS["llama3-8b"]
    c = Constraints(seq_length=4096)
    big = plan_parallelism(spec, fleet(16, memory=80 * GiB), c)
    small = plan_parallelism(spec, fleet(16, memory=24 * GiB), c)
    check_plan(small, fleet(16, memory=24 * GiB), c)
    assert small.config.tp * small.config.pp >= big.config.tp * big.config.pp
    # 18 bytes x 8.03B = 144 GB of state: 24 GiB GPUs need at least 7 ways of model parallelism
    # without the distributed optimizer's help, and the weights + grads alone (6 bytes) need 2.
    assert small.config.tp * small.config.pp >= 2


def test_a_stage_on_smaller_gpus_gets_fewer_layers():
    spec = PRESETS["llama3-8b"]
    c = Constraints(seq_length=8192, tp=(4,), pp=(2,), global_batch=8)
    roomy = plan_parallelism(spec, fleet(8, per_node=4), c)
    gpus = [GPU(f"n{i // 4}/{i % 4}", f"n{i // 4}", (24 if i < 4 else 80) * GiB) for i in range(8)]
    plan = plan_parallelism(spec, gpus, c)
    check_plan(plan, gpus, c)
    small = next(s for s in range(2) if plan.gpus[4 * s].memory_bytes == 24 * GiB)
    # With room everywhere, stage 0 is the one that would hold more than 24 GiB allows.
    assert roomy.stage_memory_bytes[small] > USABLE * 24 * GiB
    assert plan.config.stage_layers(32)[small] < roomy.config.stage_layers(32)[small]


# ---- the bounded search ------------------------------------------------------------------------

@pytest.mark.parametrize(("model", "n", "speeds"), [
    ("llama3-70b", 64, {}), ("llama3-70b", 96, {3: 0.6, 40: 0.8}),
    ("qwen3-30b-a3b", 64, {}), ("qwen3-30b-a3b", 64, {9: 0.5}), ("llama3-8b", 24, {0: 0.3}),
])
def test_bounded_search_finds_the_exhaustive_optimum(model, n, speeds):
    gpus = fleet(n, speeds=speeds)
    c = Constraints(seq_length=4096, global_batch=512)
    bounded = plan_parallelism(PRESETS[model], gpus, c)
    exhaustive = plan_parallelism(PRESETS[model], gpus, c, exhaustive=True)
    assert bounded.explanation[:-1] == exhaustive.explanation[:-1]  # plan and runner-up alike
    assert (bounded.config, bounded.gpus, bounded.step_seconds) == (
        exhaustive.config, exhaustive.gpus, exhaustive.step_seconds)


# ---- determinism -------------------------------------------------------------------------------

def test_same_input_same_plan():
    spec = PRESETS["qwen3-30b-a3b"]
    gpus = fleet(128, speeds={5: 0.7, 77: 0.5})
    c = Constraints(seq_length=4096, global_batch=512)
    first = plan_parallelism(spec, gpus, c)
    assert plan_parallelism(spec, gpus, c) == first
    assert plan_parallelism(spec, list(gpus), c) == first


def test_order_of_identical_gpus_does_not_change_the_config():
    spec = PRESETS["llama3-8b"]
    gpus = fleet(64)
    shuffled = gpus[:]
    random.Random(3).shuffle(shuffled)
    a = plan_parallelism(spec, gpus, Constraints(seq_length=4096))
    b = plan_parallelism(spec, shuffled, Constraints(seq_length=4096))
    assert a.config == b.config and a.step_seconds == b.step_seconds


# ---- stragglers --------------------------------------------------------------------------------

def test_straggler_node_gets_one_stage_with_fewer_layers():
    spec = PRESETS["llama3-70b"]
    c = Constraints(seq_length=4096, tp=(8,), pp=(4,))
    gpus = fleet(32, speeds={i: 0.5 for i in range(8, 16)})  # node n1 runs at half speed
    even = plan_parallelism(spec, fleet(32), c)
    plan = plan_parallelism(spec, gpus, c)
    check_plan(plan, gpus, c)
    nodes = stage_nodes(plan)
    slow = [s for s, n in enumerate(nodes) if "n1" in n]
    assert len(slow) == 1 and nodes[slow[0]] == {"n1"}
    layers = plan.config.stage_layers(spec.num_layers)
    assert layers[slow[0]] < min(n for s, n in enumerate(layers) if s != slow[0])
    assert layers[slow[0]] < spec.num_layers / 4
    # Half of one node's speed is 1/8 of the compute: an ideal split runs the compute about 8/7
    # as long; an even split would run the whole pipeline at the slow stage's pace (about 2x).
    ratio = plan.step_seconds / even.step_seconds
    assert 1.05 < ratio < 1.25
    assert any("stragglers grouped into stage" in line for line in plan.explanation)


def test_stragglers_on_two_nodes_share_a_stage():
    spec = PRESETS["llama3-70b"]
    c = Constraints(seq_length=4096, tp=(8,), pp=(2,), global_batch=64)
    gpus = fleet(32, speeds={3: 0.6, 21: 0.6})  # one slow GPU on n0, one on n2
    plan = plan_parallelism(spec, gpus, c)
    check_plan(plan, gpus, c)
    assert plan.config.dp == 2
    nodes = stage_nodes(plan)
    assert {"n0", "n2"} in nodes  # both slow nodes in one stage, the fast ones in the other
    slow = nodes.index({"n0", "n2"})
    layers = plan.config.stage_layers(spec.num_layers)
    assert layers[slow] < layers[1 - slow]


def test_a_very_slow_node_is_left_as_standby():
    spec = PRESETS["llama3-8b"]
    c = Constraints(seq_length=4096)
    gpus = fleet(16, speeds={i: 0.01 for i in range(8, 16)})
    plan = plan_parallelism(spec, gpus, c)
    check_plan(plan, gpus, c)
    # A plan that used n1 holds at least one layer at 1% speed in some stage: >= 100 layer-times
    # per micro-batch on its TP group, while the 8 fast GPUs alone need about 32 layer-times per
    # micro-batch spread over 8 GPUs. Standing n1 by is faster.
    assert {g.node for g in plan.standby} == {"n1"} and len(plan.standby) == 8


# ---- placement ----------------------------------------------------------------------------------

def tp_groups_local(plan) -> bool:
    tp = plan.config.tp
    return all(len({g.node for g in plan.gpus[i:i + tp]}) == 1 for i in range(0, len(plan.gpus), tp))


@pytest.mark.parametrize("model", ["llama3-8b", "llama3-70b", "qwen3-30b-a3b"])
def test_tp_stays_within_nodes(model):
    plan = plan_parallelism(PRESETS[model], fleet(64), Constraints(seq_length=4096))
    assert tp_groups_local(plan)
    assert plan.config.tp <= 8


def test_tp_groups_avoid_a_node_that_lost_gpus():
    # 7 full nodes and one with 5 GPUs left: TP=8 groups fit only the full nodes.
    gpus = fleet(56) + [GPU(f"n7/{i}", "n7", 80 * GiB) for i in range(5)]
    c = Constraints(seq_length=4096, tp=(8,))
    plan = plan_parallelism(PRESETS["llama3-70b"], gpus, c)
    check_plan(plan, gpus, c)
    assert tp_groups_local(plan)
    assert {g.node for g in plan.standby} == {"n7"}


def test_small_nodes_keep_tp_within_a_node():
    plan = plan_parallelism(PRESETS["llama3-70b"], fleet(64, per_node=4), Constraints(seq_length=4096))
    assert plan.config.tp <= 4 and tp_groups_local(plan)


def test_tp_across_nodes_is_reported():
    plan = plan_parallelism(PRESETS["llama3-8b"], fleet(16, per_node=2),
                            Constraints(seq_length=4096, tp=(4,)))
    assert not tp_groups_local(plan)
    assert any("cross nodes" in line for line in plan.explanation)


# ---- scale and the global batch ------------------------------------------------------------------

def test_fewer_gpus_smaller_dp():
    spec = PRESETS["llama3-8b"]
    c = Constraints(seq_length=4096)
    plans = {n: plan_parallelism(spec, fleet(n), c) for n in (128, 64, 32, 16)}
    dps = [plans[n].config.dp for n in (128, 64, 32, 16)]
    assert dps == sorted(dps, reverse=True) and dps[0] > dps[-1]
    for n, plan in plans.items():
        check_plan(plan, fleet(n), c)
        assert plan.config.world_size <= n
    # Fixed global batch: fewer DP ranks, more micro-batches each, same tokens per step.
    steps = [plans[n].step_seconds for n in (128, 64, 32, 16)]
    assert steps == sorted(steps)


def test_global_batch_must_split_into_whole_micro_batches():
    spec = PRESETS["llama3-8b"]
    c = Constraints(seq_length=2048, global_batch=96, micro_batch=2)  # 48 micro-batches: dp | 48
    plan = plan_parallelism(spec, fleet(64), c)
    check_plan(plan, fleet(64), c)
    assert 48 % plan.config.dp == 0
    with pytest.raises(ConfigError, match="global_batch"):
        plan_parallelism(spec, fleet(8), Constraints(global_batch=7, micro_batch=2))


def test_gpus_left_over_for_divisibility_are_standbys():
    # pp=1 and a power-of-two global batch: tp*dp is a power of two, so 12 GPUs plan on 8.
    c = Constraints(seq_length=4096, pp=(1,), global_batch=256)
    plan = plan_parallelism(PRESETS["llama3-8b"], fleet(12, per_node=4), c)
    assert plan.config.world_size == 8 and len(plan.standby) == 4


def test_granularity_selects_whole_pods():
    spec = PRESETS["llama3-8b"]
    gpus = fleet(40, per_node=8)
    c = Constraints(seq_length=4096, granularity=4, pp=(1,), global_batch=256)
    plan = plan_parallelism(spec, gpus, c)
    check_plan(plan, gpus, c)
    pods = [frozenset(gpus[i:i + 4]) for i in range(0, 40, 4)]
    used = set(plan.gpus)
    assert all(pod <= used or not pod & used for pod in pods)
    # A straggler inside a pod takes its whole pod along to standby.
    slow = fleet(40, speeds={13: 0.05})
    plan = plan_parallelism(spec, slow, c)
    check_plan(plan, slow, c)
    assert slow[13] in plan.standby and set(slow[12:16]) <= set(plan.standby)
    with pytest.raises(ConfigError, match="granularity"):
        plan_parallelism(spec, fleet(10), Constraints(granularity=4))


@pytest.mark.parametrize("seed", range(40))
def test_every_pods_gpus_are_consecutive_ranks(seed):
    """A worker pod's GPUs are one aligned block of ranks, whatever the stragglers and degrees."""
    r = random.Random(seed)
    g = r.choice([2, 4, 8])
    n = g * r.randint(2, 24)
    gpus = [GPU(f"pod{i // g}/{i % g}", f"n{i // 8}", 80 * GiB, r.choice([1.0, 1.0, 0.6, 0.8])) for i in range(n)]
    c = Constraints(seq_length=2048, global_batch=r.choice([48, 96, 384]), granularity=g)
    try:
        plan = plan_parallelism(PRESETS["llama3-8b"], gpus, c)
    except NoFeasiblePlan:
        return
    check_plan(plan, gpus, c)
    for start in range(0, len(plan.gpus), g):
        assert len({x.id.split("/")[0] for x in plan.gpus[start:start + g]}) == 1
    assert len({x.id.split("/")[0] for x in plan.standby}) == len(plan.standby) // g


# ---- constraints -----------------------------------------------------------------------------------

def test_constraints_are_respected():
    spec = PRESETS["llama3-70b"]
    c = Constraints(seq_length=4096, tp=(4,), pp=(5, 10), global_batch=128, max_gpus=48, dist_opt=False)
    plan = plan_parallelism(spec, fleet(64), c)
    check_plan(plan, fleet(64), c)
    cfg = plan.config
    assert cfg.tp == 4 and cfg.pp in (5, 10) and cfg.world_size <= 48 and not cfg.dist_opt
    c = Constraints(seq_length=4096, tp=(2,), pp=(2, 4), global_batch=128, max_gpus=48, dist_opt=False)
    plan = plan_parallelism(PRESETS["llama3-8b"], fleet(64), c)
    check_plan(plan, fleet(64), c)
    cfg = plan.config
    assert cfg.tp == 2 and cfg.pp in (2, 4) and cfg.world_size <= 48 and cfg.dp > 1
    assert any("all-reduce" in line for line in plan.explanation)


def test_moe_ep_choices():
    spec = PRESETS["qwen3-235b-a22b"]
    c = Constraints(seq_length=4096, tp=(1,), pp=(4,), global_batch=512)
    plan = plan_parallelism(spec, fleet(256), c)
    check_plan(plan, fleet(256), c)
    cfg = plan.config
    assert spec.num_moe_experts % cfg.ep == 0 and (cfg.tp * cfg.dp) % (cfg.ep * cfg.expert_tp) == 0
    # With tp=1 the experts are split only by EP and PP. Their weights and gradients alone
    # (6 bytes per parameter) must fit: ep * pp >= expert bytes / usable memory.
    expert_params = spec.num_layers * spec.num_moe_experts * spec._mlp_params(spec.moe_ffn_hidden_size)
    assert cfg.ep * cfg.pp >= 6 * expert_params / (USABLE * 80 * GiB)
    assert cfg.ep > 1

    fixed = plan_parallelism(spec, fleet(256), Constraints(seq_length=4096, pp=(4,), ep=(32,), global_batch=512))
    assert fixed.config.ep == 32
    assert any("EP=32" in line for line in fixed.explanation)
    with pytest.raises(NoFeasiblePlan) as e:
        plan_parallelism(spec, fleet(256), Constraints(ep=(3,)))
    assert e.value.short == "constraints" and e.value.field == "ep" and "128 experts" in str(e.value)
    with pytest.raises(NoFeasiblePlan, match="dense model"):
        plan_parallelism(PRESETS["llama3-8b"], fleet(8), Constraints(ep=(2,)))


def test_dense_models_use_ep_1():
    plan = plan_parallelism(PRESETS["llama3-8b"], fleet(64), Constraints(seq_length=4096))
    assert plan.config.ep == 1 and plan.config.etp is None


# ---- errors --------------------------------------------------------------------------------------

def test_too_few_gpus_for_the_allowed_degrees():
    with pytest.raises(NoFeasiblePlan) as e:
        plan_parallelism(PRESETS["llama3-8b"], fleet(4), Constraints(tp=(8,)))
    assert e.value.short == "gpus" and "needs >= 8 GPUs" in str(e.value)
    with pytest.raises(NoFeasiblePlan) as e:
        plan_parallelism(PRESETS["llama3-8b"], [], Constraints())
    assert e.value.short == "gpus"


def test_tp_that_does_not_fit_the_model():
    with pytest.raises(NoFeasiblePlan) as e:
        plan_parallelism(PRESETS["llama3-70b"], fleet(64), Constraints(tp=(3, 16)))
    assert e.value.field == "tp"
    assert "tp=3: 64 attention heads" in str(e.value) and "tp=16: 8 query groups" in str(e.value)


@pytest.mark.parametrize(("gpus", "field"), [
    ([GPU("a", "n", 80 * GiB), GPU("a", "n", 80 * GiB)], "gpus"),
    ([GPU("a", "n", 0)], "gpus"),
    ([GPU("a", "n", 80 * GiB, speed=0.0)], "gpus"),
])
def test_malformed_gpus(gpus, field):
    with pytest.raises(ConfigError) as e:
        plan_parallelism(PRESETS["tiny-gpt"], gpus)
    assert e.value.field == field


def test_sequence_longer_than_learned_positions():
    with pytest.raises(ConfigError) as e:
        plan_parallelism(PRESETS["gpt-125m"], fleet(8), Constraints(seq_length=4096))
    assert e.value.field == "constraints.seq_length" and "1024" in str(e.value)


def test_explanation_names_terms_and_runner_up():
    plan = plan_parallelism(PRESETS["llama3-70b"], fleet(64), Constraints(seq_length=4096))
    text = "\n".join(plan.explanation)
    assert str(plan.config) in plan.explanation[0]
    for word in ("compute", "PP bubble", "runner-up", "memory: fullest GPU"):
        assert word in text
    runner = next(line for line in plan.explanation if line.startswith("runner-up"))
    assert str(plan.config) not in runner


# ---- the CLI -------------------------------------------------------------------------------------

def test_cli_json(capsys):
    assert main(["plan", "--model", "llama3-70b", "--gpus", "64", "--seq-length", "4096", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = ParallelConfig.parse(out["config"])
    assert out["world_size"] == cfg.world_size == len(out["ranks"])
    assert [r["rank"] for r in out["ranks"]] == list(range(cfg.world_size))
    assert out["tokens_per_second"] == pytest.approx(256 * 4096 / out["step_seconds"])
    assert out["memory_bytes_per_gpu"] <= USABLE * 80 * GiB
    assert out["plan_seconds"] > 0 and out["explanation"]


def test_cli_speeds_file(capsys, tmp_path):
    speeds = tmp_path / "speeds.json"
    speeds.write_text(json.dumps({"node-1": 0.5, "3": 0.9}))
    assert main(["plan", "--model", "llama3-70b", "--gpus", "32", "--seq-length", "4096", "--tp", "8",
                 "--pp", "4", "--speeds", str(speeds), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "layers=" in out["config"]  # the slow stage got fewer layers
    assert any("stragglers" in line for line in out["explanation"])


@pytest.mark.parametrize(("argv", "words"), [
    (["--model", "llama3-70b", "--gpus", "8", "--gpu-memory", "80XB"], "--gpu-memory: '80XB' is not a size in bytes"),
    (["--model", "llama3-70b", "--gpus", "8"], "--gpus: llama3-70b needs >= "),
    (["--model", "llama3-70b", "--gpus", "64", "--tp", "3"], "--tp: no allowed tp fits"),
    (["--model", "llama3-70b", "--gpus", "64", "--tp", "a,b"], "--tp: 'a,b' is not"),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch", "7", "--micro-batch", "2"], "--global-batch:"),
    (["--model", "llama3-8b", "--gpus", "0"], "--gpus: must be at least 1"),
    (["--model", "nope", "--gpus", "8"], "model: 'nope' is neither a preset nor a file"),
])
def test_cli_bad_input_is_one_line_and_exit_2(capsys, argv, words):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err


def test_cli_speeds_file_errors(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("node-99: 0.5\n")
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--speeds", str(bad)]) == 2
    assert "--speeds: 'node-99' is no GPU or node" in capsys.readouterr().err


def test_cli_human_output(capsys):
    assert main(["plan", "--model", "llama3-8b", "--gpus", "16", "--seq-length", "4096"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan for llama3-8b on 16 GPUs") and "why:" in out and "stage 0" in out


def test_plan_command_imports_neither_torch_nor_kopf():
    code = ("import sys; import liveshard.runtime.commands.plan; "
            "bad = [m for m in ('torch', 'kopf', 'kubernetes') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
