"""A member declared dead is cut off: the survivors abort the old world's communicators.

A member lost without notice breaks its world's collectives, but not always at once for every
survivor: with gloo, a survivor whose collective waits on another survivor (whose own collective
already failed, and which keeps its connections open) stays blocked until the group's timeout,
and so never reaches the coordinator's recovery. The coordinator is the one liveness judge: it
declares the member dead (``dead/<id>``, the incarnation it was) and publishes a recovery plan
that names it (``WorldPlan.dead``). On either sign, each survivor's control thread cuts the
world off (``world.cut_off``): a collective blocked in it, in any thread, fails at once, the
training thread reports the world "broken" as after any failed collective, and the recovery
plan is taken from there. The recovery's transition group is made afterwards (the control
thread prepares a plan only after this check), so it is never cut.

Only a member of the dead peer's world cuts anything, and only that world: ``world.cut_off``
does nothing once the training world torch.distributed holds is another one (a commit made the
next world meanwhile). The dead keys of the peers are read only while training makes no
progress (a death always stalls the survivors' next collective), so a large world does not read
every peer's key a few times a second.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from liveshard.runtime.comms import world as worlds
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.control.protocol import WorldPlan

if TYPE_CHECKING:
    from liveshard.runtime.agent.worker import WorkerOptions, WorkerState

log = logging.getLogger("liveshard.worker")


class PeerWatch:
    """Watches for the death of a peer of this worker's current world (control thread)."""

    def __init__(self, worker_id: str, options: WorkerOptions, state: WorkerState) -> None:
        self.id = worker_id
        self.options = options
        self.state = state
        self._generation: int | None = None  # the world whose peers' dead keys are in _seen
        self._seen: dict[str, str | None] = {}  # each peer's dead key when this world was first seen
        self._cut: int | None = None  # the generation this worker cut off last
        self._progress: tuple[int | None, int] = (None, 0)  # (generation, steps recorded)
        self._progress_time = 0.0
        self._next_read = 0.0

    def _world(self) -> WorldPlan | None:
        """The world this worker is a member of now (None: none, or a standby)."""
        plan = self.state.plan
        if plan is None or self.state.rank is None or self.id not in plan.members:
            return None
        return plan

    def plan_seen(self, plan: WorldPlan) -> None:
        """A newly read plan: one that names members of this worker's world dead cuts it off."""
        world = self._world()
        if world is None or plan.generation <= world.generation:
            return
        dead = sorted(set(plan.dead) & set(world.members) - {self.id})
        if dead:
            self.cut(world.generation, dead, f"plan {plan.generation} names them dead")

    def excluded(self) -> None:
        """This process was declared dead itself (frozen, cut off): its world went on without it."""
        world = self._world()
        if world is not None:
            self.cut(world.generation, [self.id], "the coordinator declared this worker dead")

    def poll(self, store: Any, now: float | None = None) -> None:
        """Read the peers' dead keys, while training makes no progress."""
        now = time.time() if now is None else now
        world = self._world()
        if world is None:
            return
        peers = [m for m in world.members if m != self.id]
        if self._generation != world.generation:
            # Keys of an earlier life of a peer's id (declared dead, back as a new process) are
            # stale: a declaration during this world changes the key.
            self._seen = {m: store.get(Keys.dead(m)) for m in peers}
            self._generation = world.generation
            return
        if self._cut == world.generation or not self._stalled(now) or now < self._next_read:
            return
        self._next_read = now + self.options.heartbeat_interval
        dead = [m for m in peers if (v := store.get(Keys.dead(m))) is not None and v != self._seen.get(m)]
        if dead:
            self.cut(world.generation, dead, "the coordinator declared them dead")

    def _stalled(self, now: float) -> bool:
        """No step recorded for a while: longer than a few steps take, and a few heartbeats."""
        records = self.state.records
        progress = (self.state.generation, len(records))
        if progress != self._progress:
            self._progress, self._progress_time = progress, now
            return False
        step = records[-1].seconds if records else 0.0
        return now - self._progress_time > max(1.0, 2 * self.options.heartbeat_interval, 3 * step)

    def cut(self, generation: int, dead: list[str], why: str) -> None:
        """Cut the world of ``generation`` off (once); recorded in the worker's events."""
        if self._cut == generation:
            return
        self._cut = generation
        t0 = time.perf_counter()
        shut = worlds.cut_off(Keys.world_prefix(generation))
        if shut is None:
            return  # not the world torch.distributed holds now (retired, or not made yet)
        log.warning("cut off the world of generation %d (%s lost: %s): %d connection(s) shut down", generation,
                    ", ".join(dead), why, shut)
        self.state.events.append({"kind": "cut-off", "generation": generation, "dead": dead, "why": why,
                                  "connections": shut, "seconds": time.perf_counter() - t0, "time": time.time()})
