"""Which world a request gets: the planner's config and rank order, the plan that names them, and
whether the running world still holds a live copy of every piece of state.

Pure computation over explicit inputs (the job's planning inputs, each worker's node), answered
from a ``PlanCache`` keyed by the full inputs, so that the likeliest next events can be asked
ahead in a background thread (``precompute``) and found worked out when they come.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from liveshard.runtime.contract.causes import Cause
from liveshard.runtime.contract.status import pod_of
from liveshard.runtime.control.protocol import WorldPlan
from liveshard.runtime.coordinator.requests import PlanningInputs, PlanRequest, whole_pods
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.planner import GPU, NoFeasiblePlan, ParallelPlan, plan_world
from liveshard.runtime.planner.precompute import PlanCache
from liveshard.runtime.spec import ModelSpec

log = logging.getLogger("liveshard.coordinator")


@dataclass
class WorldChooser:
    spec: ModelSpec
    plans: PlanCache = field(default_factory=PlanCache)

    def choose(self, request: PlanRequest, members: tuple[str, ...], *, current: WorldPlan | None,
               dead: set[str] | frozenset[str], inputs: PlanningInputs, node_of: Callable[[str], str],
               memory_of: Callable[[str], int | None] = lambda m: None, count: bool = True) -> ParallelPlan:
        """The planner's world for ``members``: a request's explicit config keeps the rank order
        it gives (the operator's planner chose it); otherwise the planner chooses both, from the
        inputs the operator has: the job's constraints, its GPU memory and measured speeds; a
        member that announced its device's memory (``memory_of``) is planned with that.
        Raises ``ConfigError`` or ``NoFeasiblePlan``."""
        c = inputs.constraints
        gpus = tuple(GPU(id=m, node=node_of(m), memory_bytes=memory_of(m) or inputs.gpu_memory_bytes,
                         speed=float(inputs.speeds.get(pod_of(m), 1.0))) for m in whole_pods(members, c.granularity))
        config = ParallelConfig.parse(request.config) if request.config is not None else None
        placed = config is not None and request.ordered  # the given order, as it is
        running = current if current is not None and not current.is_stop and not placed else None
        cfg = ParallelConfig.parse(running.config) if running else None
        running_members = running.members if running else ()
        lost = tuple(m for m in running.members if m in dead) if running else ()
        world: ParallelPlan = self.plans.get(
            ("world", self.spec, gpus, c, config, cfg, running_members, lost),
            lambda: plan_world(self.spec, gpus, c, config=config, current=cfg, current_members=running_members,
                               lost=lost),
            count=count)
        return world

    @staticmethod
    def plan(request: PlanRequest, world: ParallelPlan, members: tuple[str, ...], current: WorldPlan | None,
             dead: set[str] | frozenset[str], generation: int, created: float) -> WorldPlan:
        ordered = tuple(g.id for g in world.gpus)
        used = set(ordered)
        if world.standby_reason and any(m not in used for m in members):
            log.info("%d worker(s) stand by: %s", sum(m not in used for m in members), world.standby_reason)
        return WorldPlan(
            generation=generation,
            config=str(world.config),
            members=ordered,
            standbys=tuple(m for m in members if m not in used),
            reason=request.reason,
            previous=current.generation if current else None,
            switch_at_step=request.switch_at_step,
            deadline=request.deadline,
            dead=tuple(sorted(set(dead) & set(current.members))) if current else (),
            created=created,
            cause=request.cause,
            nodes=tuple((g.id, g.node) for g in (*world.gpus, *world.standby)),
        )

    def no_live_copy(self, plan: WorldPlan, current: WorldPlan, count: bool = True) -> str | None:
        """Why ``plan`` cannot take its state from ``current`` (None: it can): whether some state
        is held only by dead members, from their holder sets (``lost_state``), not by planning the
        transition (each member plans its own part). Raises ``ConfigError``/``ValueError`` for a
        device order the transition cannot use."""
        from liveshard.runtime.agent.transition import transition_inputs
        from liveshard.runtime.vps.device_plan import lost_state

        if current.is_stop:
            return "the job was stopped: its state is in its last checkpoint"
        inputs = transition_inputs(current, plan)
        why: str | None = self.plans.get(("lost", self.spec, *inputs), lambda: lost_state(self.spec, *inputs),
                                         count=count)
        return why

    # ---- plans ahead of events ---------------------------------------------------------------
    def precompute(self, current: WorldPlan, dead: frozenset[str], inputs: PlanningInputs,
                   nodes: Mapping[str, str], waiting: tuple[str, ...], moved_on: Callable[[], bool],
                   memory: Mapping[str, int] | None = None) -> dict[str, Any]:
        """The world plans, and their no-live-copy checks, for each node of ``current`` lost
        without notice (each worker, when they all share one node) and for each node of waiting
        workers joining (and all of them, when they are on several), asked exactly as a recovery
        and a join request naming the running world's workers, then the joiners, would ask them.
        Stops as soon as ``moved_on()`` (an event came: the CPU is the transition's)."""
        t0 = time.perf_counter()
        everyone = (*current.members, *current.standbys)
        by_node: dict[str, list[str]] = {}
        for m in everyone:
            by_node.setdefault(nodes[m], []).append(m)
        domains = list(by_node.values()) if len(by_node) > 1 else [[m] for m in everyone]
        asked = 0
        try:
            for lost in domains:
                if moved_on():
                    break
                if not any(m in current.members for m in lost):
                    continue  # losing only standbys plans nothing
                gone = dead | set(lost)
                survivors = tuple(m for m in everyone if m not in gone)
                self._ask(current, PlanRequest(members=survivors, cause=Cause.LOST_WITHOUT_NOTICE), gone, inputs,
                          nodes, memory)
                asked += 1
            arriving: dict[str, list[str]] = {}
            for m in waiting:
                arriving.setdefault(nodes[m], []).append(m)
            joins = list(arriving.values()) + ([list(waiting)] if len(arriving) > 1 else [])
            for new in joins:  # each waiting node joining, and all of them together
                if moved_on():
                    break
                self._ask(current, PlanRequest(members=(*everyone, *new)), dead, inputs, nodes, memory)
                asked += 1
        except Exception:  # a precomputation never takes the coordinator down: the event plans itself
            log.exception("precomputing plans for generation %d", current.generation)
        seconds = time.perf_counter() - t0
        log.info("generation %d: plans for %d likely events precomputed in %.2f s", current.generation, asked, seconds)
        return {"generation": current.generation, "events": asked, "seconds": seconds}

    def _ask(self, current: WorldPlan, request: PlanRequest, dead: frozenset[str], inputs: PlanningInputs,
             nodes: Mapping[str, str], memory: Mapping[str, int] | None = None) -> None:
        members = tuple(m for m in request.members if m not in dead)
        try:
            world = self.choose(request, members, current=current, dead=dead, inputs=inputs,
                                node_of=nodes.__getitem__, memory_of=(memory or {}).get, count=False)
        except (ConfigError, NoFeasiblePlan):
            return  # kept as the answer
        plan = self.plan(request, world, members, current, dead, current.generation + 1, 0.0)
        with contextlib.suppress(ConfigError, ValueError):  # kept as the answer
            self.no_live_copy(plan, current, count=False)
