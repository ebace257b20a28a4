"""How a request becomes a published world plan: the planner's world, the no-live-copy check and
its checkpoint fallback, recoveries, stops, and a first world made again when every worker of
the running one is gone. Part of ``CoordinatorCore`` (its state is the core's); pure."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from liveshard.runtime.contract.causes import Cause
from liveshard.runtime.control.protocol import GenerationOutcome, WorldPlan
from liveshard.runtime.coordinator.events import Action, Observation, Publish, Report, Stop
from liveshard.runtime.coordinator.generations import Generation
from liveshard.runtime.coordinator.requests import PlanningInputs, PlanRequest
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.planner import NoFeasiblePlan

if TYPE_CHECKING:
    from liveshard.runtime.coordinator.core import CoordinatorCore

log = logging.getLogger("liveshard.coordinator")


class Planning:
    """Mixed into ``CoordinatorCore``: the methods that turn requests into plans."""

    def _recover(self: CoordinatorCore, reason: str | None = None) -> list[Action]:
        assert self.current is not None
        survivors = tuple(m for m in (*self.current.members, *self.current.standbys) if m not in self.dead)
        if not survivors:
            return self._world_lost()
        lost = sorted(m for m in self.current.members if m in self.dead)
        return self._start(PlanRequest(members=survivors, reason=reason or f"lost {', '.join(lost)} without notice",
                                       cause=Cause.LOST_WITHOUT_NOTICE), None)

    def _world_lost(self: CoordinatorCore) -> list[Action]:
        """Every process of the running world is gone: the job starts again from its newest
        checkpoint with whichever workers register (replacements, or the same ids as new
        processes), as a first world does; with no checkpoint it cannot go on."""
        lost = self.current
        assert lost is not None
        checkpoint = self.checkpoints.latest() or self.adopted_checkpoint
        if checkpoint is None:
            return self._fail("NoSurvivingCopy", f"every worker of generation {lost.generation} is gone and there "
                                                 "is no checkpoint to restart from")
        log.warning("every worker of generation %d is gone: restarting from %s", lost.generation, checkpoint["path"])
        self._history(GenerationOutcome(lost.generation, f"aborted: every worker lost; restarting from "
                                                         f"{checkpoint['path']}", reason="recovery"))
        self.current = None
        self._restart = (True, self._now)
        return [Report()]

    def _restart_request(self: CoordinatorCore, obs: Observation) -> list[Action]:
        """After ``_world_lost``: a first world of the live registered workers, from the checkpoint."""
        restore, since = self._restart
        regs = obs.registrations or {}
        members = tuple(m for m in regs if m not in self.dead and not self._ended(m)
                        and not (m in self._unresponsive and not self.liveness.beat_since(m, self._unresponsive[m])))
        if not members:
            if self._now - since > self.liveness.never_seen_grace:
                return self._fail("NoWorkers", "every worker was lost and none came back")
            return []
        # The newest verified checkpoint now (the one known when the world was lost may be gone)
        checkpoint = (self.checkpoints.latest() or self.adopted_checkpoint) if restore else None
        if restore and checkpoint is None:
            return self._fail("NoSurvivingCopy", "the world was lost and no verified checkpoint is left")
        self._restart = None
        where = f"from {checkpoint['path']}" if checkpoint else "afresh"
        request = PlanRequest(members=members, reason=f"a first world again, {where}", ordered=False,
                              cause=Cause.LOST_WITHOUT_NOTICE if checkpoint else None)
        return self._start(request, obs, restore=checkpoint)

    # ---- plans -------------------------------------------------------------------------------
    def _inputs(self: CoordinatorCore) -> PlanningInputs:
        """The job's planning inputs as last read (the operator's may change), else our own."""
        return self._read_inputs or self.planning

    def _start(self: CoordinatorCore, request: PlanRequest, obs: Observation | None, restore: dict | None = None) -> list[Action]:
        if request.config == "":
            return self._start_stop(request)
        regs = obs.registrations if obs is not None else None
        if self._deferred is not None and self._deferred[0] is not request:
            # another change first (a recovery): the waiting request is asked again after it,
            # not dropped (its workers may still register)
            waiting, self._deferred = self._deferred[0], None
            self._reissue.insert(0, waiting)
            log.warning("request %r waits for %r", waiting.reason, request.reason)
        # A plan never names a worker that has not registered: a joiner killed before it
        # registered would stall the running world. The request waits for them (they may be
        # starting) up to the liveness judge's grace for the never seen, then goes without them.
        known = set(regs or ()) | ({*self.current.members, *self.current.standbys} if self.current else set())
        unknown = [m for m in request.members if regs is not None and m not in known]
        if unknown:
            since = self._deferred[1] if self._deferred and self._deferred[0] is request else self._now
            # Waiting stalls nothing (the running world trains on): as long as a transition may take.
            if self._now - since < max(self.liveness.never_seen_grace, self.transition_timeout):
                self._deferred = (request, since)
                return []
            log.warning("request %r: %s never registered; planned without them", request.reason,
                        ", ".join(unknown))
        self._deferred = None
        members = tuple(m for m in request.members if m not in self.dead and m not in unknown and not self._ended(m))
        if not members:
            return self._reject(request, "none of the workers it names is alive and registered")
        try:
            world = self.chooser.choose(request, members, current=self.current, dead=self.dead,
                                        inputs=self._inputs(), node_of=self._node_of, memory_of=self.memory.get)
        except (ConfigError, NoFeasiblePlan) as e:
            return self._reject(request, str(e))
        plan = self.chooser.plan(request, world, members, self.current, self.dead, self.next_generation, self._wall)
        if self.current is None:
            # A first world with a complete checkpoint on the job's volume continues from it:
            # every process of the job was replaced (a whole spot pool gone, a restart), not a new run.
            found = restore or self.checkpoints.on_volume()
            if found is not None:
                log.warning("a first world with a checkpoint on the job's volume: continuing from step %s (%s)",
                            found.get("step"), found["path"])
                plan = replace(plan, restore_from=found["path"])
        else:
            try:
                no_copy = self.chooser.no_live_copy(plan, self.current)
            except (ConfigError, ValueError) as e:  # e.g. a device order the transition cannot use
                return self._reject(request, str(e))
            if no_copy is not None:  # the last checkpoint is the way back
                # the one published, else the newest verified on the job's volume (a save that
                # completed while its world broke, before rank 0 could publish it)
                checkpoint = self.checkpoints.latest() or self.adopted_checkpoint or self.checkpoints.on_volume()
                if checkpoint is None:
                    why = f"{no_copy} (and no checkpoint to restore from)"
                    if any(m in self.dead for m in self.current.members):
                        return self._fail("NoSurvivingCopy", why)  # the state is gone: nothing can continue
                    return self._reject(request, why)  # a plan the running world need not take
                log.warning("%s: restoring step %s from %s", no_copy, checkpoint.get("step"), checkpoint["path"])
                plan = replace(plan, restore_from=checkpoint["path"])
        return self._publish(plan)

    def _ended(self: CoordinatorCore, worker: str) -> bool:
        """Whether the worker's last heartbeat says it is gone on purpose (left, exited)."""
        beat = self.liveness.latest(worker)
        return beat is not None and beat.ended

    def _node_of(self: CoordinatorCore, worker: str) -> str:
        return self.nodes.get(worker, worker)

    def _start_stop(self: CoordinatorCore, request: PlanRequest) -> list[Action]:
        """A stop: the running world saves a checkpoint, and every worker waits for a plan that
        restores it (the operator's answer when no layout fits the workers that remain)."""
        if self.current is None or self.current.is_stop:
            return self._reject(request, "no running world to stop")
        alive = tuple(m for m in (*self.current.members, *self.current.standbys, *request.members)
                      if m not in self.dead)
        plan = WorldPlan(generation=self.next_generation, config="", members=(), standbys=tuple(dict.fromkeys(alive)),
                         reason=request.reason, previous=self.current.generation,
                         switch_at_step=request.switch_at_step, deadline=request.deadline,
                         dead=tuple(sorted(self.dead & set(self.current.members))), created=self._wall)
        return self._publish(plan)

    def _publish(self: CoordinatorCore, plan: WorldPlan) -> list[Action]:
        self._recovery_refused.clear()
        self.next_generation = max(self.next_generation, plan.generation) + 1
        self.pending = Generation(plan, self._now)
        log.info("published plan %d: %s on %d members (%s)", plan.generation, plan.config, len(plan.members),
                 plan.reason)
        return [Publish(plan), Report()]

    def _fail(self: CoordinatorCore, reason: str, message: str) -> list[Action]:
        """The run cannot go on: a terminal status the operator turns into a Failed job, and a
        stop for every worker still waiting."""
        log.error("the job cannot continue (%s): %s", reason, message)
        self.failure = {"reason": reason, "message": message, "time": self._wall}
        self._history(GenerationOutcome(None, f"failed: {message}", reason="recovery"))
        return [Stop(), Report()]

    def _reject(self: CoordinatorCore, request: PlanRequest, why: str) -> list[Action]:
        if self.current is not None and any(m in self.dead for m in self.current.members):
            # A recovery that cannot be planned is asked again every tick (a worker may come
            # back); the same refusal is recorded once, and after ``transition_timeout`` of them
            # the run cannot go on.
            since = self._recovery_refused.setdefault(why, self._now)
            if len(self._recovery_refused) > 1 or since != self._now:
                if self._now - min(self._recovery_refused.values()) > self.transition_timeout:
                    return self._fail("NoFeasiblePlan", f"no world can be planned for the survivors: {why}")
                return []
        log.error("plan request rejected (%s): %s", request.reason, why)
        self._history(GenerationOutcome(None, f"rejected: {why}", reason=request.reason))
        return [Report()]

    def _history(self: CoordinatorCore, entry: GenerationOutcome) -> None:
        self.history.append(entry.to_dict())
