"""How a request becomes a published world plan: the planner's world, the no-live-copy check and
its checkpoint fallback, recoveries, stops, and a first world made again when every worker of
the running one is gone. Functions over a ``CoordinatorCore`` (they read and move its state and
return the actions to take); pure: the time is the core's last observation's."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from liveshard.runtime.contract.causes import Cause
from liveshard.runtime.control.protocol import GenerationOutcome, WorldPlan
from liveshard.runtime.coordinator.events import Action, Observation, Publish, Report, Stop
from liveshard.runtime.coordinator.generations import Generation
from liveshard.runtime.coordinator.phases import Deferred, Restart
from liveshard.runtime.coordinator.requests import PlanningInputs, PlanRequest
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.notice import notice
from liveshard.runtime.planner import NoFeasiblePlan

if TYPE_CHECKING:
    from liveshard.runtime.coordinator.core import CoordinatorCore

log = logging.getLogger("liveshard.coordinator")


def recover(core: CoordinatorCore, reason: str | None = None) -> list[Action]:
    """A plan without the current world's dead: its survivors go on, or every one is gone."""
    assert core.current is not None
    survivors = tuple(m for m in (*core.current.members, *core.current.standbys) if m not in core.dead)
    if not survivors:
        return world_lost(core)
    lost = sorted(m for m in core.current.members if m in core.dead)
    return start(core, PlanRequest(members=survivors, reason=reason or f"lost {', '.join(lost)} without notice",
                                   cause=Cause.LOST_WITHOUT_NOTICE), None)


def world_lost(core: CoordinatorCore) -> list[Action]:
    """Every process of the running world is gone: the job starts again from its newest
    checkpoint with whichever workers register (replacements, or the same ids as new
    processes), as a first world does; with no checkpoint it cannot go on."""
    lost = core.current
    assert lost is not None
    checkpoint = core.checkpoints.latest() or core.adopted_checkpoint
    if checkpoint is None:
        return fail(core, "NoSurvivingCopy", f"every worker of generation {lost.generation} is gone and there "
                                             "is no checkpoint to restart from")
    log.warning("every worker of generation %d is gone: restarting from %s", lost.generation, checkpoint["path"])
    history(core, GenerationOutcome(lost.generation, f"aborted: every worker lost; restarting from "
                                                     f"{checkpoint['path']}", reason="recovery"))
    core.change(current=None, restart=Restart(True, core.now))
    return [Report()]


def restart_request(core: CoordinatorCore, obs: Observation) -> list[Action]:
    """After ``world_lost``: a first world of the live registered workers, from the checkpoint."""
    assert core.state.restart is not None
    restore, since = core.state.restart.restore, core.state.restart.since
    regs = obs.registrations or {}
    members = tuple(m for m in regs if m not in core.dead and not ended(core, m)
                    and not (m in core.unresponsive and not core.liveness.beat_since(m, core.unresponsive[m])))
    if not members:
        if core.now - since > core.liveness.never_seen_grace:
            return fail(core, "NoWorkers", "every worker was lost and none came back")
        return []
    # The newest verified checkpoint now (the one known when the world was lost may be gone)
    checkpoint = (core.checkpoints.latest() or core.adopted_checkpoint) if restore else None
    if restore and checkpoint is None:
        return fail(core, "NoSurvivingCopy", "the world was lost and no verified checkpoint is left")
    core.change(restart=None)
    where = f"from {checkpoint['path']}" if checkpoint else "afresh"
    request = PlanRequest(members=members, reason=f"a first world again, {where}", ordered=False,
                          cause=Cause.LOST_WITHOUT_NOTICE if checkpoint else None)
    return start(core, request, obs, restore=checkpoint)


# ---- plans -------------------------------------------------------------------------------
def inputs_of(core: CoordinatorCore) -> PlanningInputs:
    """The job's planning inputs as last read (the operator's may change), else our own."""
    return core.read_inputs or core.planning


def start(core: CoordinatorCore, request: PlanRequest, obs: Observation | None,
          restore: dict[str, Any] | None = None) -> list[Action]:
    """Plan ``request`` and publish it; or defer it while workers it names have not registered;
    or reject it (recorded in the history)."""
    if request.config == "":
        return start_stop(core, request)
    unknown = _unregistered(core, request, obs.registrations if obs is not None else None)
    if unknown is None:
        return []  # deferred: its workers may still register
    members = tuple(m for m in request.members if m not in core.dead and m not in unknown and not ended(core, m))
    if not members:
        return reject(core, request, "none of the workers it names is alive and registered")
    try:
        world = core.chooser.choose(request, members, current=core.current, dead=core.dead,
                                    inputs=inputs_of(core), node_of=node_of(core), memory_of=core.memory.get)
    except (ConfigError, NoFeasiblePlan) as e:
        return reject(core, request, str(e))
    plan = core.chooser.plan(request, world, members, core.current, core.dead, core.next_generation, core.wall)
    if core.current is None:
        # A first world with a complete checkpoint on the job's volume continues from it:
        # every process of the job was replaced (a whole spot pool gone, a restart), not a new run.
        found = restore or core.checkpoints.on_volume()
        if found is not None:
            notice(f"resuming from the checkpoint of step {found.get('step')} ({found['path']})")
            plan = replace(plan, restore_from=found["path"])
        return publish(core, plan)
    return _with_restore_if_needed(core, request, plan)


def _unregistered(core: CoordinatorCore, request: PlanRequest,
                  regs: Mapping[str, object] | None) -> tuple[str, ...] | None:
    """The workers ``request`` names that never registered, to plan without; None while it waits
    for them (the request is then the deferred one). Another request started first puts a
    deferred one back in line (it is asked again after, not dropped: its workers may still
    register)."""
    deferred = core.state.deferred
    if deferred is not None and deferred.request is not request:
        core.change(deferred=None, reissue=(deferred.request, *core.state.reissue))
        log.warning("request %r waits for %r", deferred.request.reason, request.reason)
        deferred = None
    # A plan never names a worker that has not registered: a joiner killed before it
    # registered would stall the running world. The request waits for them (they may be
    # starting) up to the liveness judge's grace for the never seen, then goes without them.
    current = core.current
    known = set(regs or ()) | ({*current.members, *current.standbys} if current else set())
    unknown = tuple(m for m in request.members if regs is not None and m not in known)
    if unknown:
        since = deferred.since if deferred is not None else core.now
        # Waiting stalls nothing (the running world trains on): as long as a transition may take.
        if core.now - since < max(core.liveness.never_seen_grace, core.transition_timeout):
            core.change(deferred=Deferred(request, since, unknown))
            return None
        log.warning("request %r: %s never registered; planned without them", request.reason, ", ".join(unknown))
    core.change(deferred=None)
    return unknown


def _with_restore_if_needed(core: CoordinatorCore, request: PlanRequest, plan: WorldPlan) -> list[Action]:
    """A change of the running world, published; where no live copy of the state survives it,
    restored from the last checkpoint (or, without one, rejected, or the run fails)."""
    assert core.current is not None
    try:
        no_copy = core.chooser.no_live_copy(plan, core.current)
    except (ConfigError, ValueError) as e:  # e.g. a device order the transition cannot use
        return reject(core, request, str(e))
    if no_copy is not None:  # the last checkpoint is the way back
        # the one published, else the newest verified on the job's volume (a save that
        # completed while its world broke, before rank 0 could publish it)
        checkpoint = core.checkpoints.latest() or core.adopted_checkpoint or core.checkpoints.on_volume()
        if checkpoint is None:
            why = f"{no_copy} (and no checkpoint to restore from)"
            if any(m in core.dead for m in core.current.members):
                return fail(core, "NoSurvivingCopy", why)  # the state is gone: nothing can continue
            return reject(core, request, why)  # a plan the running world need not take
        notice(f"{no_copy}: resuming from the checkpoint of step {checkpoint.get('step')} ({checkpoint['path']})")
        plan = replace(plan, restore_from=checkpoint["path"])
    return publish(core, plan)


def ended(core: CoordinatorCore, worker: str) -> bool:
    """Whether the worker's last heartbeat says it is gone on purpose (left, exited)."""
    beat = core.liveness.latest(worker)
    return beat is not None and beat.ended


def node_of(core: CoordinatorCore) -> Callable[[str], str]:
    """Each worker's node as it registered (its own id where unknown)."""
    return lambda worker: core.nodes.get(worker, worker)


def start_stop(core: CoordinatorCore, request: PlanRequest) -> list[Action]:
    """A stop: the running world saves a checkpoint, and every worker waits for a plan that
    restores it (the operator's answer when no layout fits the workers that remain)."""
    current = core.current
    if current is None or current.is_stop:
        return reject(core, request, "no running world to stop")
    alive = tuple(m for m in (*current.members, *current.standbys, *request.members) if m not in core.dead)
    plan = WorldPlan(generation=core.next_generation, config="", members=(), standbys=tuple(dict.fromkeys(alive)),
                     reason=request.reason, previous=current.generation,
                     switch_at_step=request.switch_at_step, deadline=request.deadline,
                     dead=tuple(sorted(core.dead & set(current.members))), created=core.wall)
    return publish(core, plan)


def publish(core: CoordinatorCore, plan: WorldPlan) -> list[Action]:
    core.recovery_refused.clear()
    core.next_generation = max(core.next_generation, plan.generation) + 1
    core.change(pending=Generation(plan, core.now))
    log.info("published plan %d: %s on %d members (%s)", plan.generation, plan.config, len(plan.members),
             plan.reason)
    return [Publish(plan), Report()]


def fail(core: CoordinatorCore, reason: str, message: str) -> list[Action]:
    """The run cannot go on: a terminal status the operator turns into a Failed job, and a
    stop for every worker still waiting."""
    log.error("the job cannot continue (%s): %s", reason, message)
    core.change(failure={"reason": reason, "message": message, "time": core.wall})
    history(core, GenerationOutcome(None, f"failed: {message}", reason="recovery"))
    return [Stop(), Report()]


def reject(core: CoordinatorCore, request: PlanRequest, why: str) -> list[Action]:
    """A request that cannot be planned, recorded in the history; a recovery refused for longer
    than a transition may take ends the run."""
    if core.current is not None and any(m in core.dead for m in core.current.members):
        # A recovery that cannot be planned is asked again every tick (a worker may come
        # back); the same refusal is recorded once, and after ``transition_timeout`` of them
        # the run cannot go on.
        since = core.recovery_refused.setdefault(why, core.now)
        if len(core.recovery_refused) > 1 or since != core.now:
            if core.now - min(core.recovery_refused.values()) > core.transition_timeout:
                return fail(core, "NoFeasiblePlan", f"no world can be planned for the survivors: {why}")
            return []
    log.error("plan request rejected (%s): %s", request.reason, why)
    history(core, GenerationOutcome(None, f"rejected: {why}", reason=request.reason))
    return [Report()]


def history(core: CoordinatorCore, entry: GenerationOutcome) -> None:
    core.history.append(entry.to_dict())
