"""What a restarted coordinator takes over, from the workers' registrations alone. Pure.

A coordinator that restarts serves a new, empty store: everything it knows comes from the workers
re-registering (``core.Registration``): the world each trains in, the newest generation it saw,
its newest checkpoint, a generation it holds open inside its commit window, a plan it was
preparing. ``adopt`` turns them into one ``Adoption``:

* the running world is the newest one a worker trains in; a generation left open in its commit
  window after it becomes the pending generation again (``reopened``), decided from the members'
  reports as they come (``generations.resolve_open``); one that someone trains in committed; any
  other open one was superseded;
* it waits (returns None) until every member of that world, and of an open transition, has
  re-registered, or ``grace`` has passed: a member still reconnecting may hold a newer world;
* a member of the running world whose id now runs a process without that world (a replacement)
  is lost, and so is one the open plans name dead; a process outside it that holds an older
  world is stale (it must come back as a new one);
* a plan the workers were preparing is asked for again;
* nobody holding a world, though workers saw plans before: the world was lost with the
  coordinator, and the job restarts from its newest checkpoint (``restart``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from liveshard.runtime.contract.keys import COMMITTED
from liveshard.runtime.control.protocol import GenerationOutcome, WorldPlan
from liveshard.runtime.coordinator import planning, switching
from liveshard.runtime.coordinator.events import (
    Action,
    Decide,
    MarkDead,
    Publish,
    Registration,
    Report,
    WriteOutcome,
)
from liveshard.runtime.coordinator.generations import Generation, involved
from liveshard.runtime.coordinator.membership import LOST_PROCESS
from liveshard.runtime.coordinator.phases import Restart
from liveshard.runtime.coordinator.requests import PlanRequest

if TYPE_CHECKING:
    from liveshard.runtime.coordinator.core import CoordinatorCore

log = logging.getLogger("liveshard.coordinator")


@dataclass(frozen=True)
class Adoption:
    world: WorldPlan | None  # the running world (None: nobody holds one)
    next_generation: int  # above every generation a worker saw
    wait: bool = False  # workers saw plans before: wait for them to re-register (nothing else yet)
    checkpoint: dict[str, Any] | None = None  # the newest checkpoint a worker announced
    resolved: tuple[tuple[WorldPlan, str], ...] = ()  # open generations decided now
    reopened: WorldPlan | None = None  # the open generation that follows the world: pending again
    holders: Mapping[str, str | None] = field(default_factory=dict)  # member -> the process holding its part
    lost: tuple[tuple[str, str], ...] = ()  # (member, why): its part is gone with a process
    stale: tuple[tuple[str, str | None], ...] = ()  # (worker, process) holding a world the job went past
    reissue: PlanRequest | None = None  # the change the workers were preparing
    restart: bool = False  # every world is gone: a first world again, from the newest checkpoint
    waiting_for: tuple[str, ...] = ()  # with ``wait``: the members not re-registered yet


# How far above every generation a re-registered worker saw a restarted coordinator numbers its
# plans: the dead coordinator may have published a few that only a worker still frozen (or
# reconnecting) saw, and a generation must never name two plans.
RESTART_GAP = 100


def adopt(regs: Mapping[str, Registration], *, waited: float, grace: float) -> Adoption | None:
    """The takeover; ``wait`` while more registrations may change it (``waited``: seconds since
    the first look, ``grace``: how long to wait at most); None when nothing was ever run (a new
    job: its first request makes the first world)."""
    seen = max((r.latest_seen for r in regs.values()), default=-1)
    next_generation = seen + 1 + RESTART_GAP if seen >= 0 else 0
    checkpoint = max((r.checkpoint for r in regs.values() if r.checkpoint),
                     key=lambda c: c.get("step", -1), default=None)
    plans = [r.plan for r in regs.values() if r.plan is not None]
    if not plans:
        if next_generation == 0:
            return None
        # workers that saw plans before (this coordinator is a restarted one) but hold none
        if waited < grace:
            return Adoption(None, next_generation, wait=True)
        return Adoption(None, next_generation, checkpoint=checkpoint, restart=True)
    best = max(plans, key=lambda p: p.generation)
    opens = {r.open.generation: r.open.plan for r in regs.values() if r.open is not None and r.open.plan}
    waiting_for = set(best.members) | {m for p in opens.values() if p.previous == best.generation
                                       for m in involved(best, p)}
    if any(m not in regs for m in waiting_for) and waited < grace:
        return Adoption(None, next_generation, wait=True, waiting_for=tuple(sorted(m for m in waiting_for
                                                                                 if m not in regs)))
    resolved: list[tuple[WorldPlan, str]] = []
    world = best
    following = [p for g, p in opens.items() if p.previous == best.generation]
    reopened = max(following, key=lambda p: p.generation) if following else None
    trained = {r.plan.generation for r in regs.values() if r.plan is not None}
    read = {r.open.generation: r.open.decision for r in regs.values() if r.open is not None and r.open.decision}
    for g, plan in sorted(opens.items()):
        next_generation = max(next_generation, g + 1)
        if plan is reopened:
            continue
        if g in read:
            resolved.append((plan, read[g]))  # a process read its decision: that one
        elif g == best.generation or g in trained or best.previous == g:
            # someone trains in it (its world may have broken since), or the newest world
            # follows it: only a commit gets there
            resolved.append((plan, COMMITTED))
        else:
            # nobody trains in it, and it does not follow the newest world (or a later plan
            # that does is the one left open): had it committed, its members would be past it
            resolved.append((plan, f"aborted: superseded by generation {(reopened or best).generation}"))
    def holds(r: Registration) -> bool:  # trains in the world, or is inside its commit window
        return (r.plan is not None and r.plan.generation == world.generation) or \
            (r.open is not None and r.open.generation == world.generation)

    holders = {m: regs[m].incarnation if m in regs and holds(regs[m]) else None for m in world.members}
    lost: list[tuple[str, str]] = []
    known_dead = {m for r in regs.values() for p in (r.pending_plan, r.open.plan if r.open else None)
                  if p is not None and p.previous == world.generation for m in p.dead}
    for m in world.members:
        reg = regs.get(m)
        in_window = reg is not None and reg.open is not None and reg.open.generation == world.generation
        if m in known_dead and reg is None:
            lost.append((m, "dead before the coordinator restarted"))
        elif reg is not None and not in_window and (reg.plan is None or reg.plan.generation < world.generation):
            lost.append((m, "back as a new process without the world's state"))
    stale = tuple((m, r.incarnation) for m, r in regs.items() if r.plan is not None
                  and r.plan.generation < world.generation and m not in world.members and m not in world.standbys)
    owed = [r.pending_plan for r in regs.values() if r.pending_plan is not None and reopened is None
            and r.pending_plan.generation > world.generation and not r.pending_plan.is_stop]
    reissue = None
    for p in {p.generation: p for p in owed}.values():
        if p.generation not in opens:
            # prepared, never switched to by anyone who re-registered: decided against (a process
            # reaching its commit window late reads that), and asked for again under a new number
            resolved.append((p, "aborted: the coordinator restarted before it switched; asked again"))
    if owed:
        p = max(owed, key=lambda p: p.generation)
        reissue = PlanRequest(members=p.members, config=p.config, cause=p.cause,
                              reason=f"{p.reason} (asked again after a coordinator restart)".strip())
    return Adoption(world, max(next_generation, world.generation + 1), checkpoint=checkpoint,
                    resolved=tuple(resolved), reopened=reopened, holders=holders, lost=tuple(lost), stale=stale,
                    reissue=reissue)


def take_over(core: CoordinatorCore, regs: Mapping[str, Registration], now: float) -> list[Action]:
    """Take over what the workers run after a restart (``adopt``): the running world is
    re-published so later plans name it as their ``previous``; open generations get their
    decision; lost members are declared dead; an owed change is asked for again."""
    since = core.state.adopting_since if core.state.adopting_since is not None else now
    took = adopt(regs, waited=now - since, grace=core.adoption_grace)
    waiting_for = took.waiting_for if took is not None and took.wait else ()
    core.change(adopting_since=since, awaiting_adoption=took is not None and took.wait, adoption_waits_for=waiting_for)
    if took is None or took.wait:
        if took is not None:
            core.next_generation = max(core.next_generation, took.next_generation)
        return []
    core.change(adopting_since=None)
    core.next_generation = max(core.next_generation, took.next_generation)
    if took.checkpoint is not None and (core.adopted_checkpoint is None or took.checkpoint.get("step", -1)
                                        > core.adopted_checkpoint.get("step", -1)):
        core.adopted_checkpoint = took.checkpoint
    if took.restart:
        checkpoint = core.checkpoints.on_volume() or core.adopted_checkpoint
        if checkpoint is None:
            return planning.fail(core, "NoSurvivingCopy", "the coordinator restarted, no worker holds a world and "
                                                          "there is no checkpoint to restart from")
        core.change(restart=Restart(True, now))
        return [Report()]
    return _adopt_world(core, took, now)


def _adopt_world(core: CoordinatorCore, took: Adoption, now: float) -> list[Action]:
    """The running world the registrations name becomes the committed one."""
    world = took.world
    assert world is not None
    out: list[Action] = []
    for plan, value in took.resolved:
        log.warning("generation %d was open when the coordinator restarted: %s", plan.generation, value)
        out += [Decide(plan.generation, value), WriteOutcome(plan.generation, value)]
        if plan.generation != world.generation:
            planning.history(core, GenerationOutcome(plan.generation, value, reason=plan.reason, config=plan.config,
                                                     world_size=len(plan.members), cause=plan.cause))
    core.change(current=world)
    core.liveness.expect(took.holders, now, core.adoption_grace + core.heartbeat_timeout, world.generation)
    for m, why in took.lost:
        death = core.liveness.declare(m, why, LOST_PROCESS)
        if death is not None:
            out.append(MarkDead(m, death.incarnation))
    out += [Publish(world), WriteOutcome(world.generation, COMMITTED)]
    planning.history(core, GenerationOutcome(world.generation, COMMITTED, reason="adopted after a coordinator restart",
                                             config=world.config, world_size=len(world.members)))
    log.info("adopted running world of generation %d (%s)", world.generation, world.config)
    if took.reissue is not None:
        core.change(reissue=(*core.state.reissue, took.reissue))
    for m, incarnation in took.stale:
        # a process holding a world the job went past, outside the running one: it must drop
        # that state and come back as a new process (it learns it from ``Keys.dead``)
        if core.liveness.declare(m, "holds a world the job went past", incarnation) is not None:
            out.append(MarkDead(m, incarnation))
    if took.reopened is not None:
        core.change(pending=Generation(took.reopened, now, reopened=True))
        out.append(Publish(took.reopened))  # its plan, in this store too
    if core.stragglers is not None:
        core.stragglers.committed(world)
    return [*out, Report(), *switching.precompute_action(core)]
