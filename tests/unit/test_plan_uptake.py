"""``control.takes_up``: what a worker does with the newest plan it read. The control thread and
the protocol simulator's workers both decide with it (a planted bug in it is caught by the
simulator: mutant ``generation-prepared-twice``)."""

from __future__ import annotations

import pytest

from liveshard.runtime.agent.control import Uptake, takes_up
from liveshard.runtime.control.protocol import WorldPlan

WORLD = WorldPlan(generation=3, config="tp=1,pp=1,dp=2", members=("w0", "w1"), standbys=("w2",))
NEXT = WorldPlan(generation=4, config="tp=1,pp=1,dp=3", members=("w0", "w1", "w3"), previous=3)


def uptake(worker: str, plan: WorldPlan = NEXT, world: WorldPlan | None = WORLD, *, known: bool = False,
           decided: bool = False, replacement: bool = False) -> Uptake:
    asked: list[bool] = []

    def ask() -> bool:
        asked.append(True)
        return replacement

    out = takes_up(worker, plan, generation=world.generation if world else None, world=world, known=known,
                   decided=decided, replacement=ask)
    if known or decided or (world is not None and plan.generation <= world.generation):
        assert not asked  # the store is not read for a plan already settled
    return out


@pytest.mark.parametrize("worker", ["w0", "w1", "w3"])
def test_a_plan_that_concerns_the_worker_is_prepared(worker):
    assert uptake(worker) is Uptake.PREPARE  # members of the world it follows, and a joiner


def test_a_standby_of_the_plan_prepares_it_even_while_it_waits_outside_any_world():
    plan = WorldPlan(generation=4, config="tp=1,pp=1,dp=2", members=("w0", "w1"), standbys=("w5",), previous=3)
    assert uptake("w5", plan, world=None) is Uptake.PREPARE


@pytest.mark.parametrize("why", ["known", "decided", "replacement"])
def test_a_plan_prepared_before_decided_or_naming_another_process_is_never_taken_up(why):
    assert uptake("w0", **{why: True}) is Uptake.NEVER


def test_a_process_the_plan_counts_dead_never_takes_it_up():
    """A process cut off (frozen past the timeout), back after a coordinator restart whose new
    store has not its verdict yet: the recovery's plan counts it dead and its transition leaves it
    out; it must not prepare the plan (it rejoins as a new process once the plan commits)."""
    recovery = WorldPlan(generation=4, config="tp=1,pp=1,dp=1", members=("w0",), previous=3, dead=("w1",))
    assert uptake("w1", recovery) is Uptake.NEVER
    assert uptake("w0", recovery) is Uptake.PREPARE


def test_a_plan_no_newer_than_the_world_it_trains_in_is_never_taken_up():
    assert uptake("w0", plan=WORLD) is Uptake.NEVER


def test_a_plan_about_other_workers_is_looked_at_again_once_the_worker_holds_another_world():
    # w2 stands by in WORLD, and NEXT names neither it nor a world it is a member of
    assert uptake("w2") is Uptake.NOT_NOW
    assert uptake("w9", world=None) is Uptake.NOT_NOW
