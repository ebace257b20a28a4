"""Which ``WorldChange`` a plan gets (``agent.world_change.choose``), and what each one answers:
a leave with notice shrinks the running world; everything else that moves state live rebuilds."""

from __future__ import annotations

import pytest

from liveshard.runtime.agent.world_change import (
    STRATEGIES,
    CheckpointRestart,
    LiveRebuild,
    Shrink,
    StartWorld,
    choose,
)
from liveshard.runtime.control.protocol import CHECKPOINT, LIVE, START, WorldPlan

OLD = WorldPlan(1, "tp=1,pp=1,dp=3", ("a", "b", "c"))


def plan(members: tuple[str, ...], **kw) -> WorldPlan:
    return WorldPlan(2, f"tp=1,pp=1,dp={len(members)}", members, previous=1, **kw)


@pytest.mark.parametrize(("old", "new", "strategy", "mode"), [
    (None, WorldPlan(0, "tp=1,pp=1,dp=3", ("a", "b", "c")), StartWorld, START),
    (OLD, WorldPlan(2, "", (), previous=1), CheckpointRestart, CHECKPOINT),  # a stop
    (OLD, plan(("a", "b"), restore_from="/ckpt/x"), CheckpointRestart, CHECKPOINT),
    (OLD, plan(("a", "c")), Shrink, LIVE),  # b leaves with notice
    (OLD, plan(("a", "b"), standbys=("c",)), LiveRebuild, LIVE),  # c stays, as a standby: no leave
    (OLD, plan(("c", "a")), LiveRebuild, LIVE),  # the survivors change their order
    (OLD, plan(("a", "b"), dead=("c",)), LiveRebuild, LIVE),  # a loss without notice
    (OLD, plan(("a", "b", "c", "d")), LiveRebuild, LIVE),  # a join
    (OLD, plan(("a", "b", "c")), LiveRebuild, LIVE),  # a reshape keeps every member
])
def test_the_plan_chooses_the_change(old, new, strategy, mode):
    assert new.mode == mode and new.is_live_transition == (mode == LIVE)
    change = choose(old, new)
    assert type(change) is strategy and change.live == (mode == LIVE)


def test_a_shrink_transfers_over_the_running_world_and_builds_nothing_ahead():
    leave, join = plan(("a", "c")), plan(("a", "b", "c", "d"))
    assert choose(OLD, leave).transfers_over_running_world(OLD, leave) and not choose(OLD, leave).builds_ahead()
    assert not choose(OLD, join).transfers_over_running_world(OLD, join) and choose(OLD, join).builds_ahead()
    reorder = plan(("c", "a"))  # a leave all the same: its transfer needs no group of its own
    assert choose(OLD, reorder).transfers_over_running_world(OLD, reorder)


def test_every_strategy_has_a_name_of_its_own():
    assert len({s.name for s in STRATEGIES}) == len(STRATEGIES)
