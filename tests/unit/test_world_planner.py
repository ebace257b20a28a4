"""The one planner's rank order and objectives (``planner.world``): pure, no processes."""

from __future__ import annotations

import pytest

from liveshard.runtime.errors import ConfigError
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.planner import (
    FEWEST_CHANGES,
    GPU,
    Constraints,
    NoFeasiblePlan,
    continuity_order,
    plan_world,
)
from liveshard.runtime.presets import PRESETS

TINY = PRESETS["tiny-gpt"]
DP_ONLY = Constraints(tp=(1,), pp=(1,), global_batch=240, micro_batch=4, dist_opt=False)


def _gpus(*ids: str, node: str | None = None, speeds: dict[str, float] | None = None) -> list[GPU]:
    return [GPU(i, node or f"node-{i}", 80 << 30, (speeds or {}).get(i, 1.0)) for i in ids]


def test_continuity_order_puts_the_running_world_first_in_its_rank_order():
    gpus = _gpus("a", "b", "c", "d", "e")
    order = [g.id for g in continuity_order(gpus, ("d", "b", "gone"))]
    assert order == ["d", "b", "a", "c", "e"]


def test_survivors_keep_their_rank_order_and_joiners_follow():
    current = ("p3", "p1", "p0", "p2")
    plan = plan_world(TINY, _gpus("p0", "p1", "p2", "p3"), DP_ONLY, current_members=current)
    assert [g.id for g in plan.gpus] == list(current)
    left = plan_world(TINY, _gpus("p0", "p2", "p3"), DP_ONLY, current_members=current)
    assert [g.id for g in left.gpus] == ["p3", "p0", "p2"]
    joined = plan_world(TINY, _gpus("p0", "p1", "p2", "p3", "p4"), DP_ONLY, current_members=current)
    assert [g.id for g in joined.gpus][:4] == list(current)


def test_a_straggler_is_placed_by_the_cost_model_not_by_continuity():
    # the slow GPU's pipeline stage gets fewer layers only if it is where the planner priced it
    gpus = _gpus("a", "b", "c", "d", node="n0", speeds={"b": 0.25})
    plan = plan_world(PRESETS["gpt-125m"], gpus, Constraints(tp=(1,), pp=(2,), global_batch=64, micro_batch=1),
                      current_members=("a", "b", "c", "d"))
    order = [g.id for g in plan.gpus]
    cfg = plan.config
    stage_of_b = order.index("b") // (cfg.tp * cfg.dp)
    assert cfg.layers is not None and cfg.layers[stage_of_b] < max(cfg.layers), (cfg, order)


def test_a_given_config_is_placed_in_the_order_given_and_checked():
    plan = plan_world(TINY, _gpus("x", "y", "z"), DP_ONLY, config=ParallelConfig.parse("tp=1,pp=2,dp=1"))
    assert [g.id for g in plan.gpus] == ["x", "y"] and [g.id for g in plan.standby] == ["z"]
    with pytest.raises(ConfigError, match="global batch 240 does not split over dp=7"):
        plan_world(TINY, _gpus(*"abcdefg"), DP_ONLY, config=ParallelConfig.parse("dp=7"))
    with pytest.raises(ConfigError, match="needs 4 workers, 3 given"):
        plan_world(TINY, _gpus("x", "y", "z"), DP_ONLY, config=ParallelConfig.parse("tp=2,pp=2"))
    with pytest.raises(ConfigError, match="whole pods of 2"):
        plan_world(TINY, _gpus("a/0", "a/1", "b/0", "b/1"),
                   Constraints(global_batch=4, granularity=2), config=ParallelConfig.parse("tp=1,pp=1,dp=1"))


def test_fewest_changes_keeps_the_degrees_and_uses_as_many_workers_as_the_batch_allows():
    c = Constraints(global_batch=4, micro_batch=1, objective=FEWEST_CHANGES)
    current = ParallelConfig.parse("tp=2,pp=1,dp=2,dist_opt")
    plan = plan_world(TINY, _gpus("w0", "w1", "w3"), c, current=current, current_members=("w0", "w1", "w2", "w3"))
    assert (plan.config.tp, plan.config.pp, plan.config.dp, plan.config.dist_opt) == (2, 1, 1, True)
    assert [g.id for g in plan.gpus] == ["w0", "w1"] and [g.id for g in plan.standby] == ["w3"]
    # one worker left: TP must go
    alone = plan_world(TINY, _gpus("w0"), c, current=current, current_members=("w0", "w1"))
    assert (alone.config.tp, alone.config.dp) == (1, 1)
    with pytest.raises(NoFeasiblePlan):
        plan_world(TINY, _gpus("w0"), Constraints(tp=(2,), global_batch=4, objective=FEWEST_CHANGES), current=current)


def test_the_same_inputs_give_the_same_world():
    gpus = _gpus(*(f"g{i}" for i in range(16)), speeds={"g5": 0.6})
    c = Constraints(global_batch=256, micro_batch=1)
    a = plan_world(PRESETS["llama3-8b"], gpus, c, current_members=tuple(f"g{i}" for i in range(16)))
    b = plan_world(PRESETS["llama3-8b"], list(gpus), c, current_members=tuple(f"g{i}" for i in range(16)))
    assert a.config == b.config and [g.id for g in a.gpus] == [g.id for g in b.gpus]
