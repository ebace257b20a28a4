"""Uneven data parallelism (``ParallelConfig.dp_split``): the config, the batch plan, the planner's
checks and the transition plan of a change of the split alone. Pure: no processes."""

from __future__ import annotations

import pytest

from liveshard.runtime.data.batches import BatchPlan
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.planner import FEWEST_CHANGES, GPU, Constraints, plan_world
from liveshard.runtime.presets import PRESETS

TINY = PRESETS["tiny-gpt"]


# ---- the config ------------------------------------------------------------------------------
def test_string_form_round_trips_and_derives_dp():
    cfg = ParallelConfig.parse("tp=2,pp=1,dp=2,ep=1,dp_split=3+1,dist_opt")
    assert cfg.dp_split == (3, 1)
    assert str(cfg) == "tp=2,pp=1,dp=2,ep=1,dp_split=3+1,dist_opt"
    assert ParallelConfig.parse(str(cfg)) == cfg
    three = ParallelConfig.parse("tp=2,dp_split=2+1+1", world_size=6)
    assert (three.dp, three.dp_split) == (3, (2, 1, 1))
    assert ParallelConfig.parse(str(three)) == three


def test_an_all_equal_split_is_the_even_config():
    cfg = ParallelConfig.parse("dp=2,dp_split=2+2")
    assert cfg.dp_split is None
    assert cfg == ParallelConfig(dp=2) and str(cfg) == str(ParallelConfig(dp=2))
    assert hash(cfg) == hash(ParallelConfig(dp=2))
    assert ParallelConfig(dp=1, dp_split=(4,)).dp_split is None


def test_with_even_dp_drops_only_the_split():
    cfg = ParallelConfig.parse("tp=2,pp=2,dp=2,layers=1+3,dp_split=1+3,dist_opt,bucket=100")
    even = cfg.with_even_dp()
    assert even.dp_split is None
    assert (even.tp, even.pp, even.dp, even.layers, even.dist_opt, even.bucket_size) == (2, 2, 2, (1, 3), True, 100)
    assert even.with_even_dp() is even


@pytest.mark.parametrize(("text", "field", "words"), [
    ("dp=2,dp_split=3", "dp_split", "1 micro-batch counts given for dp=2"),
    ("dp=2,dp_split=1+2+1", "dp_split", "3 micro-batch counts given for dp=2"),
    ("dp=2,dp_split=3+0", "dp_split", "at least one micro-batch"),
    ("dp=2,dp_split=4+-1", "dp_split", "at least one micro-batch"),
    ("dp=2,dp_split=3+x", "parallel.dp_split", "'+'-joined"),
    ("dp=2,dp_split=", "parallel.dp_split", "'+'-joined"),
])
def test_bad_splits_name_the_field_and_the_fix(text, field, words):
    with pytest.raises(ConfigError) as e:
        ParallelConfig.parse(text)
    assert e.value.field == field
    assert e.value.fix
    assert words in str(e.value)


def test_a_split_of_booleans_is_refused():
    with pytest.raises(ConfigError, match="at least one micro-batch"):
        ParallelConfig(dp=2, dp_split=(True, 2))


def test_validation_refuses_a_split_with_context_parallelism():
    with pytest.raises(ConfigError) as e:
        ParallelConfig.parse("cp=2,dp=2,dp_split=3+1").validate(PRESETS["llama3-8b"])
    assert e.value.field == "dp_split" and "cp=2" in str(e.value)


def test_expert_parallel_groups_must_run_the_same_micro_batch_count():
    moe = PRESETS["tiny-moe"]
    # tp=1, ep=2, dp=4: replicas 0,1 and 2,3 share an expert-parallel group (megatron's order)
    ParallelConfig.parse("ep=2,dp=4,dp_split=2+2+1+1").validate(moe)
    with pytest.raises(ConfigError, match="expert-parallel group") as e:
        ParallelConfig.parse("ep=2,dp=4,dp_split=2+1+2+1").validate(moe)
    assert e.value.fix
    with pytest.raises(ConfigError, match="expert-parallel group"):
        ParallelConfig.parse("ep=2,dp=2,dp_split=3+1").validate(moe)
    ParallelConfig.parse("ep=1,dp=2,dp_split=3+1").validate(moe)  # experts inside each replica


# ---- the batch plan --------------------------------------------------------------------------
@pytest.mark.parametrize(("global_batch", "micro_batch", "split"), [
    (4, 1, (3, 1)), (4, 1, (2, 1, 1)), (24, 2, (1, 5, 3, 3)), (10, 2, (4, 1)),
])
def test_uneven_slices_cover_the_global_batch_once_in_order(global_batch, micro_batch, split):
    plan = BatchPlan(global_batch, micro_batch, len(split), split)
    for cursor in (0, 7, 1000):
        slices = [plan.rank_samples(cursor, r) for r in range(len(split))]
        assert [i for s in slices for i in s] == list(range(cursor, cursor + global_batch))
        assert [len(s) for s in slices] == [n * micro_batch for n in split]
    assert [plan.micro_batches(r) for r in range(len(split))] == list(split)
    assert plan.total_micro_batches == sum(split) == global_batch // micro_batch


def test_even_plans_are_unchanged():
    even = BatchPlan(16, 2, 4)
    for cursor in (0, 16, 48):
        assert [even.rank_samples(cursor, r) for r in range(4)] == [
            range(cursor + 4 * r, cursor + 4 * r + 4) for r in range(4)]
    assert [even.micro_batches(r) for r in range(4)] == [2] * 4 and even.total_micro_batches == 8
    equal = BatchPlan(16, 2, 4, (2, 2, 2, 2))
    assert equal.split is None and equal == even


@pytest.mark.parametrize(("args", "field", "words"), [
    ((4, 1, 2, (2, 1)), "dp_split", "3 sequences, the global batch is 4"),
    ((4, 1, 3, (2, 1)), "dp_split", "2 micro-batch counts"),
    ((4, 1, 2, (4, 0)), "dp_split", "at least one"),
    ((5, 2, 2, (2, 1)), "dp_split", "multiple of micro_batch=2"),
    ((4, 1, 3, None), "global_batch", "dp=3"),
])
def test_batch_errors(args, field, words):
    with pytest.raises(ConfigError) as e:
        BatchPlan(*args)
    assert e.value.field == field
    assert words in str(e.value)


# ---- the planner -----------------------------------------------------------------------------
def _gpus(*ids: str) -> list[GPU]:
    return [GPU(i, f"node-{i}", 80 << 30) for i in ids]


def test_a_split_lets_a_batch_run_on_a_dp_that_does_not_divide_it():
    c = Constraints(tp=(1,), pp=(1,), global_batch=4, micro_batch=1, dist_opt=False)
    with pytest.raises(ConfigError, match="does not split over dp=3"):
        plan_world(TINY, _gpus("a", "b", "c"), c, config=ParallelConfig.parse("dp=3"))
    plan = plan_world(TINY, _gpus("a", "b", "c"), c, config=ParallelConfig.parse("dp=3,dp_split=2+1+1"))
    assert plan.config.dp_split == (2, 1, 1)
    with pytest.raises(ConfigError) as e:
        plan_world(TINY, _gpus("a", "b", "c"), c, config=ParallelConfig.parse("dp=3,dp_split=2+2+1"))
    assert e.value.field == "dp_split" and "global batch is 4" in str(e.value)


def test_a_change_of_the_split_alone_is_a_plan_that_moves_nothing():
    from liveshard.runtime.vps.devices import DeviceMap
    from liveshard.runtime.vps.transition import plan_transition

    c = Constraints(tp=(1,), pp=(1,), global_batch=4, micro_batch=1, dist_opt=False)
    even = ParallelConfig.parse("tp=2,dp=2")
    uneven = ParallelConfig.parse("tp=2,dp=2,dp_split=3+1")
    ids = ("a", "b", "c", "d")
    plan = plan_world(TINY, _gpus(*ids), c, current=even, current_members=ids, config=uneven)
    assert plan.config == uneven and [g.id for g in plan.gpus] == list(ids)
    devices = DeviceMap(4)
    moved = plan_transition(TINY, even, uneven, devices, (0, 1, 2, 3))
    assert moved.bytes_moved == 0 and moved.network_copies == []
    same = plan_transition(TINY, even, even, devices, (0, 1, 2, 3))
    # the ranks agree on the split too: it is part of what the checksum covers
    assert moved.checksum != same.checksum
    assert plan_transition(TINY, even, uneven, devices, (0, 1, 2, 3)).checksum == moved.checksum


def test_fewest_changes_drops_a_split_priced_for_other_gpus():
    c = Constraints(global_batch=4, micro_batch=1, objective=FEWEST_CHANGES)
    current = ParallelConfig.parse("tp=1,pp=1,dp=2,dp_split=3+1")
    plan = plan_world(TINY, _gpus("w0", "w1", "w2", "w3"), c, current=current, current_members=("w0", "w1"))
    assert plan.config.dp_split is None and plan.config.dp == 4


def test_the_runtime_sees_a_change_of_the_split_as_a_new_config():
    from liveshard.runtime.coordinator.kube_source import same_config

    assert not same_config("tp=1,pp=1,dp=2", "tp=1,pp=1,dp=2,dp_split=3+1")
    assert same_config("tp=1,pp=1,dp=2", "tp=1,pp=1,dp=2,dp_split=2+2")


# ---- the command line ------------------------------------------------------------------------
def test_run_local_refuses_a_split_that_does_not_add_up(capsys):
    from liveshard.runtime.cli import main

    code = main(["run-local", "--model", "tiny-gpt", "--mock-data", "--workers", "2", "--steps", "2",
                 "--global-batch", "4", "--parallel", "tp=1,pp=1,dp=2,dp_split=2+1", "--quiet"])
    assert code == 2
    err = capsys.readouterr().err
    assert "dp_split" in err and "global batch is 4" in err
