"""How the next world comes to exist: one ``WorldChange`` strategy per kind of change.

The plan chooses the strategy (``choose``: ``WorldPlan.mode``, refined by the old world): the
first of ``STRATEGIES`` whose ``applies`` holds. Each answers the questions a switch asks, in the
order it asks them:

* ``transfers_over_running_world``: does the transfer run over the old world's default group
  (no transition group to connect)? (asked while preparing)
* ``builds_ahead``: are the new world's communicators connected while the old world trains?
* ``switch``: the phases of the switch, at a step boundary or while not training;
* ``retire``: what of the old world goes once the vote said yes (``Transition.build``);
* ``make_world``: how a new member makes the new world and megatron's groups
  (``comms.world.World``'s constructors).

They act on the worker through a narrow host (``Host``: retire, build, adopt, report). Adding a
strategy is a class here and an entry in ``STRATEGIES``.

Strategies:

* ``StartWorld``: a first world (every member meets on the store) or a standby;
* ``CheckpointRestart``: a stop saves a checkpoint; a restore builds the world from one;
* ``LiveRebuild``: state moves live, the new world is made anew (from communicators built
  ahead, or from scratch at the commit);
* ``Shrink``: a leave with notice (nobody joins, nobody is dead, the survivors keep their
  order): the transfer runs over the old world, the leavers still in it; then the leavers shut
  their side down and the survivors shrink them away (``World.shrink``) and make megatron's
  groups on the shrunk world, each by its members only (``comms.groups``). No world is made
  from scratch. A shrink that fails or passes its bound (any survivor's: they agree on the
  store) falls back to a rebuild from scratch (``World.recreate``), and the switch goes on.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from liveshard.runtime.comms import world as worlds
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.control.barrier import STORE_BACKOFF, wait_until
from liveshard.runtime.control.protocol import (
    CHECKPOINT,
    LIVE,
    START,
    MemberResult,
    WorldPlan,
    transition_members,
)
from liveshard.runtime.parallel import ParallelConfig

if TYPE_CHECKING:
    from liveshard.runtime.agent.live_switch import Transition
    from liveshard.runtime.agent.prepare import Prepared
    from liveshard.runtime.agent.worker import WorkerAgent

log = logging.getLogger("liveshard.worker")

# Seconds the survivors' shrink may take before they fall back to a rebuild (at most the job's
# collective timeout).
SHRINK_BOUND = 30.0


class Host(Protocol):
    """What a strategy does to the worker."""

    def retire(self, defer_free: bool = False, keep_world: bool = False) -> Any: ...

    def build(self, cfg: ParallelConfig, initialize: bool = True, spare_buffers: Any = None,
              groups_ready: bool = False) -> None: ...

    def adopt(self, plan: WorldPlan, rank: int | None) -> None: ...

    def report(self, gen: int, result: MemberResult) -> None: ...


def leaving(old: WorldPlan, plan: WorldPlan) -> list[str]:
    """Old members that are not in ``plan``'s world (gone, or standbys now), none of them dead."""
    return [m for m in old.members if m not in plan.members and m not in plan.dead]


def is_leave(old: WorldPlan, plan: WorldPlan) -> bool:
    """Someone goes with notice, nobody joins, nobody is dead: every device of the transition
    is a rank of the running world, in the same order. (A change that keeps every member, a
    reshape or a recovery of a world whose collectives failed, keeps a group of its own: a
    transfer aborted half-way must not leave the world it falls back to with unmatched
    messages.)"""
    gone = set(old.members) - set(plan.members) - set(plan.standbys)
    return transition_members(old, plan) == old.members and bool(gone)


class WorldChange:
    """A kind of world change (the base: what every live change shares)."""

    name: ClassVar[str] = ""
    live: ClassVar[bool] = True  # state moves from the old world's members

    @classmethod
    def applies(cls, old: WorldPlan | None, plan: WorldPlan) -> bool:
        raise NotImplementedError

    def transfers_over_running_world(self, old: WorldPlan, plan: WorldPlan) -> bool:
        return False

    def builds_ahead(self) -> bool:
        return False

    def switch(self, agent: WorkerAgent, prep: Prepared, switch_step: int) -> None:
        raise NotImplementedError

    def retire(self, host: Host, plan: WorldPlan, worker: str) -> Any:
        """The old world goes once the vote said yes: its groups, not its state (returned)."""
        return host.retire(defer_free=True)

    def make_world(self, transition: Transition, cfg: ParallelConfig, rank: int) -> None:
        raise NotImplementedError


class StartWorld(WorldChange):
    """A first world: every member meets on the store and makes it from scratch; the others
    wait as standbys."""

    name, live = START, False

    @classmethod
    def applies(cls, old: WorldPlan | None, plan: WorldPlan) -> bool:
        return old is None or plan.mode == START

    def switch(self, agent: WorkerAgent, prep: Prepared, switch_step: int) -> None:
        from liveshard.runtime.agent.switch import start_world

        if agent.id in prep.plan.members:
            # a first world continues the job's newest checkpoint when the coordinator found one
            start_world(agent, prep.plan, load_dir=prep.plan.restore_from)
        else:
            agent.adopt(prep.plan, None)  # a standby from the start


class CheckpointRestart(WorldChange):
    """No live state: a stop saves a checkpoint, a restore builds the world from one."""

    name, live = CHECKPOINT, False

    @classmethod
    def applies(cls, old: WorldPlan | None, plan: WorldPlan) -> bool:
        return plan.mode == CHECKPOINT

    def switch(self, agent: WorkerAgent, prep: Prepared, switch_step: int) -> None:
        from liveshard.runtime.agent.switch import through_checkpoint

        through_checkpoint(agent, prep, switch_step)


class LiveRebuild(WorldChange):
    """State moves live; the new world is made anew beside the old one's state."""

    name = LIVE

    @classmethod
    def applies(cls, old: WorldPlan | None, plan: WorldPlan) -> bool:
        return old is not None and plan.mode == LIVE

    def transfers_over_running_world(self, old: WorldPlan, plan: WorldPlan) -> bool:
        return is_leave(old, plan)

    def builds_ahead(self) -> bool:
        return True

    def switch(self, agent: WorkerAgent, prep: Prepared, switch_step: int) -> None:
        """transfer, vote, build, decide, then commit or abort (``live_switch.Transition``)."""
        from liveshard.runtime.agent.live_switch import Transition
        from liveshard.runtime.contract.keys import COMMITTED

        transition = Transition(agent, prep, switch_step)
        transition.transfer()
        if not transition.vote():
            transition.abort()  # the old world (if any) keeps training on its untouched state
            return
        transition.build()
        decision = transition.decide()
        if decision == COMMITTED:
            transition.commit()
        else:
            transition.abort(decision)

    def make_world(self, transition: Transition, cfg: ParallelConfig, rank: int) -> None:
        """With the communicators built ahead the world is made without waiting for the other
        members; otherwise its rendezvous would, so they are awaited on the store first."""
        from liveshard.runtime.agent.live_switch import arrive
        from liveshard.runtime.megatron.build import init_parallel

        agent, plan, ahead = transition.agent, transition.plan, transition.prep.world
        # Arrival tells the coordinator that the sources have delivered (a leaver's death no
        # longer matters).
        arrive(agent, plan, wait=ahead is None, epoch=transition.prep.epoch)
        transition.mark("meet")
        prefix, timeout = Keys.world_prefix(plan.generation), agent.options.collective_timeout
        if ahead is not None:
            worlds.World.from_ahead(agent.store.store, prefix, rank, cfg.world_size, timeout, ahead)
        else:
            worlds.World.scratch(agent.store.store, prefix, rank, cfg.world_size, timeout)
        init_parallel(cfg, ahead, timeout=timeout)  # megatron's groups on the new world


class Shrink(LiveRebuild):
    """A leave with notice: the survivors shrink the leavers away (module docstring)."""

    name = "shrink"

    @classmethod
    def applies(cls, old: WorldPlan | None, plan: WorldPlan) -> bool:
        return (old is not None and plan.mode == LIVE and is_leave(old, plan)
                and plan.members == tuple(m for m in old.members if m in plan.members))

    def builds_ahead(self) -> bool:
        return False  # the survivors' world comes from the running one

    def retire(self, host: Host, plan: WorldPlan, worker: str) -> Any:
        """A survivor keeps the running default group (to shrink it), megatron's groups go; a
        leaver shuts its whole side down (it must not take part in the shrink)."""
        return host.retire(defer_free=True, keep_world=worker in plan.members)

    def make_world(self, transition: Transition, cfg: ParallelConfig, rank: int) -> None:
        from liveshard.runtime.agent.live_switch import arrive
        from liveshard.runtime.megatron.build import init_parallel

        agent, plan, old = transition.agent, transition.plan, transition.prep.old
        assert old is not None
        arrive(agent, plan, wait=True, epoch=transition.prep.epoch)
        transition.mark("meet")
        gen, timeout = plan.generation, agent.options.collective_timeout
        name = Keys.world_prefix(gen)
        running = worlds.World.current()
        world, error = None, ""
        try:
            if running is None:
                raise worlds.ShrinkFailed("no running world to shrink")
            excluded = [i for i, m in enumerate(old.members) if m not in plan.members]
            world = running.shrink(excluded, name, min(SHRINK_BOUND, timeout))
        except worlds.ShrinkFailed as e:
            error = str(e)
        if not _all_shrank(agent, plan, ok=world is not None):
            log.warning("generation %d: the shrink failed (%s): rebuilding the world", gen,
                        error or "another survivor's failed")
            transition.fallback = f"shrink: {error or 'another survivor failed'}"
            worlds.shutdown_current(defer_free=True)
            world = worlds.World.recreate(agent.store.store, f"{name}rebuild/", rank, cfg.world_size, timeout,
                                          name=name)
        # megatron's groups on the shrunk or rebuilt world, each made by its members only: the world
        # is eager on NCCL, where megatron's own calls would split it once per group on every rank
        init_parallel(cfg, None, timeout=timeout, members_only=True)


def _all_shrank(agent: WorkerAgent, plan: WorldPlan, ok: bool) -> bool:
    """Whether every survivor's shrink succeeded (each says so on the store, then waits for the
    others'): a shrink is kept by all of them or by none. Raises ``NotArrived`` when the
    generation is decided meanwhile (a survivor died) or the wait times out."""
    from liveshard.runtime.agent.live_switch import NotArrived

    raw, gen = agent.store.store, plan.generation
    base = f"{Keys.world_prefix(gen)}liveshard-shrink/"
    if ok:
        raw.add(f"{base}ok", 1)
    raw.add(f"{base}done", 1)
    n = len(plan.members)
    outcome = wait_until(lambda: raw.add(f"{base}done", 0) >= n,
                         abort=lambda: agent.store.get(Keys.decision(gen)),
                         timeout=agent.options.commit_timeout, poll=STORE_BACKOFF)
    if outcome.aborted or outcome.timed_out:
        raise NotArrived(f"the survivors of generation {gen} did not all shrink: "
                         f"{outcome.reason if outcome.aborted else 'timed out'}")
    return int(raw.add(f"{base}ok", 0)) >= n


# The strategies, most specific first: ``choose`` takes the first that applies.
STRATEGIES: tuple[type[WorldChange], ...] = (StartWorld, CheckpointRestart, Shrink, LiveRebuild)


def choose(old: WorldPlan | None, plan: WorldPlan) -> WorldChange:
    """The strategy of the change from the world of ``old`` (None: no world) to ``plan``'s."""
    for strategy in STRATEGIES:
        if strategy.applies(old, plan):
            return strategy()
    raise ValueError(f"no world change applies to generation {plan.generation} ({plan.mode})")

