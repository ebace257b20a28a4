"""The process groups megatron-core will ask for, probed without touching its parallel state."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("megatron.core") is None:  # checked without importing it here
    pytest.skip("needs megatron-core (the runtime extra)", allow_module_level=True)

from liveshard.runtime.megatron.build import group_requests
from liveshard.runtime.parallel import ParallelConfig


def _mine(requests, desc: str, rank: int) -> tuple[int, ...]:
    (ranks,) = [r.ranks for r in requests if r.desc == desc and rank in r.ranks and not r.gloo]
    return ranks


def test_requests_follow_megatrons_rank_order_tp_cp_ep_dp_pp():
    requests = group_requests(ParallelConfig.parse("tp=2,pp=2,dp=2"), 5)
    assert _mine(requests, "TENSOR_MODEL_PARALLEL_GROUP", 5) == (4, 5)
    assert _mine(requests, "DATA_PARALLEL_GROUP", 5) == (5, 7)
    assert _mine(requests, "PIPELINE_MODEL_PARALLEL_GROUP", 5) == (1, 5)
    assert _mine(requests, "MODEL_PARALLEL_GROUP", 5) == (0, 1, 4, 5)
    # every rank is asked for every group (torch's new_group contract), members or not
    tp = [r.ranks for r in requests if r.desc == "TENSOR_MODEL_PARALLEL_GROUP"]
    assert sorted(tp) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert any(r.gloo for r in requests if r.desc == "DATA_PARALLEL_GROUP_GLOO")


def test_every_rank_sees_the_same_list_and_megatron_state_is_untouched():
    from megatron.core import parallel_state

    cfg = ParallelConfig.parse("tp=1,pp=2,dp=2,ep=2")
    lists = [group_requests(cfg, rank) for rank in range(cfg.world_size)]
    assert all(lst == lists[0] for lst in lists)  # one order for all: members meet group by group
    assert not parallel_state.model_parallel_is_initialized()
    assert parallel_state._TENSOR_MODEL_PARALLEL_GROUP is None


def test_every_group_asks_for_the_jobs_collective_timeout():
    """megatron gives its groups ``distributed_timeout_minutes`` (30 minutes unless told): with
    the job's collective timeout, every group waits that long for a lost peer, no longer."""
    cfg = ParallelConfig.parse("tp=2,pp=2,dp=2")
    timed = group_requests(cfg, 3, timeout=20.0)
    assert timed and {r.timeout for r in timed} == {20.0, None}
    # megatron-core 0.16.1 asks for its expert data-parallel gloo groups with no timeout (torch's
    # 30 minutes): init_parallel gives them the job's, as build_world_ahead does
    assert {r.desc for r in timed if r.timeout is None} == {"EXPERT_DATA_PARALLEL_GROUP_GLOO"}
    untimed = group_requests(cfg, 3)
    assert {r.timeout for r in untimed} == {30 * 60.0, None}  # megatron's own default, as before
    assert [(r.desc, r.ranks, r.gloo) for r in timed] == [(r.desc, r.ranks, r.gloo) for r in untimed]
