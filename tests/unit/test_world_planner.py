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


def test_a_layout_change_puts_ranks_where_their_state_already_is():
    from liveshard.runtime.vps.devices import DeviceMap
    from liveshard.runtime.vps.transition import plan_transition

    spec, old, new = PRESETS["llama3-8b"], ParallelConfig.parse("tp=8,pp=1,dp=4,dist_opt"), \
        ParallelConfig.parse("tp=4,pp=2,dp=4,dist_opt")
    ids = tuple(f"g{i}" for i in range(32))
    gpus = [GPU(g, f"n{i // 8}", 80 << 30) for i, g in enumerate(ids)]
    plan = plan_world(spec, gpus, Constraints(global_batch=256), current=old, current_members=ids, config=new)
    order = tuple(int(g.id[1:]) for g in plan.gpus)
    moved = plan_transition(spec, old, new, DeviceMap(32), order).bytes_moved
    continuity = plan_transition(spec, old, new, DeviceMap(32), tuple(range(32))).bytes_moved
    assert moved < 0.6 * continuity
    assert all(len({g.node for g in plan.gpus[i:i + 4]}) == 1 for i in range(0, 32, 4))  # TP groups on a node
    # a straggler was placed by the cost model: the order is the planner's, not the mover's
    slow = [GPU(g.id, g.node, g.memory_bytes, 0.5 if g.id == "g3" else 1.0) for g in gpus]
    kept = plan_world(spec, slow, Constraints(global_batch=256), current=old, current_members=ids, config=new)
    assert [g.id for g in kept.gpus] == list(ids)


def test_a_moved_order_keeps_each_pods_gpus_consecutive_and_in_order():
    spec, old, new = PRESETS["gpt-125m"], ParallelConfig.parse("tp=2,pp=2,dp=1"), \
        ParallelConfig.parse("tp=1,pp=1,dp=4,dist_opt")
    ids = ("a/0", "a/1", "b/0", "b/1")
    gpus = [GPU(g, "n0", 80 << 30) for g in ids]
    plan = plan_world(spec, gpus, Constraints(global_batch=4, granularity=2), current=old, current_members=ids,
                      config=new)
    got = [g.id for g in plan.gpus]
    assert got in (list(ids), ["b/0", "b/1", "a/0", "a/1"])


@pytest.mark.parametrize("model, old, new, devices", [
    ("llama3-8b", "tp=8,pp=1,dp=4,dist_opt", "tp=4,pp=2,dp=4,dist_opt", {}),
    ("llama3-8b", "tp=4,pp=2,dp=4,dist_opt", "tp=4,pp=2,dp=3,dist_opt", {"leaving": frozenset(range(24, 32))}),
    ("tiny-moe", "pp=2,ep=2,dp=2,dist_opt", "ep=4,dp=4,dist_opt", {"joining": 4}),
    ("gpt-125m", "tp=2,pp=2,dp=2", "tp=1,pp=2,dp=2,dist_opt", {"dead": frozenset({5}), "leaving": frozenset({6, 7})}),
])
def test_the_overlap_figures_choose_and_price_a_rank_order_as_the_whole_plan_does(model, old, new, devices):
    """The whole plan is the oracle: the order the figures pick is the plan's, and the bytes they
    say stay in place are the plan's local copies, for the plan's order and for any other."""
    from liveshard.runtime.vps.devices import DeviceMap
    from liveshard.runtime.vps.transition import overlap_figures, plan_transition

    spec, old_cfg, new_cfg = PRESETS[model], ParallelConfig.parse(old), ParallelConfig.parse(new)
    device_map = DeviceMap(old_cfg.world_size, **devices)
    figures = overlap_figures(spec, old_cfg, new_cfg, device_map)
    whole = plan_transition(spec, old_cfg, new_cfg, device_map, cached=False)
    assert figures.best_order == whole.rank_to_device
    assert figures.kept_bytes(whole.rank_to_device) == whole.local_copy_bytes
    other = tuple(reversed(whole.rank_to_device))
    assert figures.kept_bytes(other) == plan_transition(spec, old_cfg, new_cfg, device_map, other,
                                                        cached=False).local_copy_bytes
