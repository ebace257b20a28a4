"""megatron's groups made by their members only (``comms.groups``): which of megatron's calls
splits the world for a whole kind of group, which call gets which group, and that every rank makes
the same collectives in the same order. No process group is made: ``split_group`` and the
members' own connection are stand-ins."""

from __future__ import annotations

import importlib.util

import pytest
import torch.distributed as dist

if importlib.util.find_spec("megatron.core") is None:  # checked without importing it here
    pytest.skip("needs megatron-core (the runtime extra)", allow_module_level=True)

from liveshard.runtime.comms import groups
from liveshard.runtime.comms.groups import CONNECT, SKIP, SPLIT, STOCK, TAKE, MembersOnly, steps
from liveshard.runtime.comms.world import GroupRequest
from liveshard.runtime.megatron.build import group_requests
from liveshard.runtime.parallel import ParallelConfig

CONFIGS = ["tp=2,pp=2,dp=2", "tp=1,pp=3,dp=2,layers=2+1+1", "tp=1,pp=2,dp=4,ep=2", "tp=2,pp=1,dp=4,ep=4,etp=1"]


def _collectives(plan) -> list[tuple[str, tuple]]:
    return [(s.how, s.split) for s in plan if s.how in (SPLIT, STOCK)]


@pytest.mark.parametrize("text", CONFIGS)
def test_one_split_per_kind_the_same_on_every_rank_and_each_call_gets_its_group(text):
    cfg = ParallelConfig.parse(text)
    requests = group_requests(cfg, 0)
    kinds = {(r.desc, r.gloo) for r in requests if not r.gloo}
    collectives = None
    for rank in range(cfg.world_size):
        plan = steps(requests, rank, splittable=True)
        # every rank splits the world at the same calls with the same groups: the splits are collectives
        if collectives is None:
            collectives = _collectives(plan)
        assert _collectives(plan) == collectives
        groups_of_split: dict[tuple, tuple] = {}
        for req, step in zip(requests, plan, strict=True):
            kind = (req.desc, req.gloo)
            assert step.member == (rank in req.ranks)
            if req.gloo:  # a CPU-side group: its members connect it alone
                assert step.how == (CONNECT if step.member else SKIP)
                continue
            if step.how == SPLIT:
                # the kind's groups, all of them, disjoint: one split makes this rank's
                assert sorted(step.split) == sorted(r.ranks for r in requests if (r.desc, r.gloo) == kind)
                groups_of_split[kind] = next((g for g in step.split if rank in g), ())
            else:
                assert step.how in (TAKE, SKIP), (req, step)
            if step.member:  # the call gets the group its kind's split gave this rank
                assert groups_of_split[kind] == req.ranks
    assert collectives is not None and {h for h, _ in collectives} == {SPLIT}
    assert len(collectives) == len(kinds) < len([r for r in requests if not r.gloo])


def test_without_a_splittable_world_members_connect_and_the_others_return_at_once():
    requests = group_requests(ParallelConfig.parse("tp=2,pp=2,dp=2"), 5)
    plan = steps(requests, 5, splittable=False)
    assert [s.how for s in plan] == [CONNECT if 5 in r.ranks else SKIP for r in requests]


def test_a_kind_whose_groups_overlap_is_made_by_every_rank():
    requests = [GroupRequest("A", (0, 1), False), GroupRequest("A", (2, 3), False),
                GroupRequest("B", (0, 1), False), GroupRequest("B", (1, 2), False), GroupRequest("", (0, 3), False)]
    plan = steps(requests, 3, splittable=True)
    assert [(s.how, s.member) for s in plan] == [(SPLIT, False), (TAKE, True), (STOCK, False), (STOCK, False),
                                                 (STOCK, True)]
    assert plan[0].split == ((0, 1), (2, 3))


def test_members_only_hands_each_call_its_group(monkeypatch):
    """Through ``MembersOnly.make``, as megatron's calls reach it: a split once per kind, this
    rank's group at the call that names it, NON_GROUP_MEMBER elsewhere; gloo groups connected."""
    cfg, rank = ParallelConfig.parse("tp=2,pp=2,dp=2"), 6
    requests = group_requests(cfg, rank)
    splits: list[tuple] = []

    def split_group(parent, split_ranks, **kwargs):
        splits.append(tuple(tuple(g) for g in split_ranks))
        return next((("split", tuple(g)) for g in split_ranks if rank in g), None)

    monkeypatch.setattr(dist, "split_group", split_group)
    monkeypatch.setattr(groups, "_connect", lambda ranks, name, backend, kwargs: ("connect", tuple(ranks), name))
    maker = MembersOnly(requests, rank, split=True)
    got = [maker.make(r, lambda: pytest.fail("no stock call"), None, {"group_desc": r.desc}) for r in requests]
    for i, (req, group) in enumerate(zip(requests, got, strict=True)):
        if rank not in req.ranks:
            assert group is dist.GroupMember.NON_GROUP_MEMBER
        elif req.gloo:
            assert group == ("connect", req.ranks, f"{maker.prefix}{i}")
        else:
            assert group == ("split", req.ranks)
    assert len(splits) == len({(r.desc, r.gloo) for r in requests if not r.gloo})
    with pytest.raises(RuntimeError, match="not the one listed beforehand"):
        maker.make(requests[0], lambda: None, None, {})
