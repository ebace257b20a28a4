"""The coordinator's phase, derived in one place from its state, and the reason it waits.

``ControlState`` is what the phases decide over: the committed world, the pending generation,
the terminal records, and what the coordinator waits on before it can plan (a first world to make
again, a request whose workers have not registered, plans owed after a restart, a takeover from
the workers' registrations). ``phase_of`` names the one phase that state is in; the loop's
questions (``accepting``, ``wants_request``, ``wants_registrations``, ``reads_adoption``) are
functions of it. ``waiting_reason`` says in words what the coordinator waits for and for how long
of its bound; it goes into the status report (``status.waiting``), in the shape of torchft's
Lighthouse, whose quorum publishes its reason while it waits. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from liveshard.runtime.contract.keys import COMMITTED
from liveshard.runtime.control.protocol import WorldPlan
from liveshard.runtime.coordinator.generations import Generation, involved
from liveshard.runtime.coordinator.requests import PlanRequest


class Phase(StrEnum):
    """What the coordinator is doing; exactly one at a time (``phase_of``)."""

    STARTING = "Starting"  # no world yet and nothing owed: a new job's first request, or a first look
    ADOPTING = "Adopting"  # a restarted coordinator waits for the workers to re-register their worlds
    RESTARTING = "Restarting"  # every world is gone: a first world again, once workers register
    DEFERRED = "Deferred"  # a request waits for workers it names to register
    STEADY = "Steady"  # a committed world trains; requests are taken
    SWITCHING = "Switching"  # a published generation is being switched to
    RESOLVING = "Resolving"  # a generation left open by the previous coordinator is decided
    FINISHED = "Finished"  # trainIters reached, the final checkpoint saved (terminal)
    FAILED = "Failed"  # the run cannot go on (terminal)


TERMINAL = frozenset({Phase.FINISHED, Phase.FAILED})


@dataclass(frozen=True)
class Restart:
    """A first world to make again (every worker of the running world lost, or a first world
    aborted): from the newest verified checkpoint when ``restore``, asked since ``since``."""

    restore: bool
    since: float


@dataclass(frozen=True)
class Deferred:
    """A request waiting for the workers it names to register (``unknown``), since ``since``."""

    request: PlanRequest
    since: float
    unknown: tuple[str, ...] = ()


@dataclass(frozen=True)
class ControlState:
    """The state the coordinator's phases decide over. ``pending`` is the one mutable part: the
    generation being switched to collects its members' results as they come."""

    current: WorldPlan | None = None  # the committed world
    pending: Generation | None = None  # a generation being switched to
    failure: dict[str, Any] | None = None  # why the run cannot go on (terminal)
    finished: dict[str, Any] | None = None  # rank 0's report at trainIters (terminal)
    restart: Restart | None = None
    deferred: Deferred | None = None
    reissue: tuple[PlanRequest, ...] = ()  # plans a restarted coordinator owes the workers
    adopting_since: float | None = None  # the first look at the registrations without a world
    awaiting_adoption: bool = False  # registrations say workers ran plans: wait for their world
    adoption_waits_for: tuple[str, ...] = ()  # members of that world not re-registered yet


def phase_of(state: ControlState) -> Phase:
    """The one phase ``state`` is in, by precedence: terminal first, then a generation in
    flight, then what blocks planning, then whether a world runs."""
    if state.failure is not None:
        return Phase.FAILED
    if state.finished is not None:
        return Phase.FINISHED
    if state.pending is not None:
        return Phase.RESOLVING if state.pending.reopened else Phase.SWITCHING
    if state.restart is not None:
        return Phase.RESTARTING
    if state.awaiting_adoption:  # only ever without a world: a completed takeover clears it
        return Phase.ADOPTING
    if state.deferred is not None:
        return Phase.DEFERRED
    return Phase.STARTING if state.current is None else Phase.STEADY


def reads_adoption(state: ControlState) -> bool:
    """Whether registrations are a takeover to consider (``adoption.adopt``): no world is known
    and nothing else is in flight (a request may wait for its workers meanwhile)."""
    return state.current is None and phase_of(state) in (Phase.STARTING, Phase.ADOPTING, Phase.DEFERRED)


def accepting(state: ControlState) -> bool:
    """Whether a request would be taken now: nothing in flight, not terminal, and not while a
    restarted coordinator waits to learn what the workers run."""
    return phase_of(state) in (Phase.STARTING, Phase.STEADY, Phase.DEFERRED, Phase.RESTARTING)


def wants_request(state: ControlState) -> bool:
    """Whether the plan source should be polled: accepting, and nothing owed comes first (a
    deferred request, plans owed after a restart, a first world to make again)."""
    return phase_of(state) in (Phase.STARTING, Phase.STEADY) and not state.reissue


def wants_registrations(state: ControlState) -> bool:
    """Whether the registrations should be read this tick (besides with a request): a takeover,
    a request waiting for its workers, a first world again, owed plans, or an open generation
    decided from the members' reports. Nothing is read once terminal."""
    phase = phase_of(state)
    if phase in TERMINAL:
        return False
    return reads_adoption(state) or phase in (Phase.RESTARTING, Phase.RESOLVING, Phase.DEFERRED) \
        or bool(state.reissue)


# ---- the reason it waits ---------------------------------------------------------------------
@dataclass(frozen=True)
class Limits:
    """The bounds the coordinator's waits run against (seconds)."""

    heartbeat_timeout: float
    transition_timeout: float
    never_seen_grace: float  # the liveness judge's grace for a member never seen
    adoption_grace: float


@dataclass(frozen=True)
class Waits:
    """What a committed world waits on, besides the phase's own: a recovery refused (its reason,
    since when), members reporting the world broken (since when), holders not reconnected."""

    refused: Mapping[str, float] | None = None
    broken: Mapping[str, float] | None = None
    holders_missing: bool = False
    dead: frozenset[str] = frozenset()


def names(members: Iterable[str], most: int = 3) -> str:
    """``w1``, ``w1 and w2``, ``w1, w2, w3 and 2 more``."""
    ms = list(members)
    if len(ms) <= 1:
        return "".join(ms)
    if len(ms) <= most:
        return f"{', '.join(ms[:-1])} and {ms[-1]}"
    return f"{', '.join(ms[:most])} and {len(ms) - most} more"


def _of(elapsed: float, bound: float) -> str:
    return f"{max(0.0, elapsed):.1f} s of {bound:.0f} s"


def waiting_reason(state: ControlState, now: float, limits: Limits, waits: Waits = Waits()) -> str | None:
    """What the coordinator waits for now, in words, with how long it has waited of its bound;
    None when it waits for nothing (a world trains, or the run is over)."""
    phase = phase_of(state)
    if phase in TERMINAL:
        return None
    if phase in (Phase.SWITCHING, Phase.RESOLVING):
        assert state.pending is not None
        return _switch_wait(state.pending, state.current, now, limits.transition_timeout, waits.dead)
    if phase is Phase.RESTARTING:
        assert state.restart is not None
        where = "from the newest checkpoint" if state.restart.restore else "afresh"
        return (f"restarting {where}: waiting for workers to register, "
                f"{_of(now - state.restart.since, limits.never_seen_grace)}")
    if phase is Phase.ADOPTING:
        since = state.adopting_since if state.adopting_since is not None else now
        who = f"{names(state.adoption_waits_for)} to re-register" if state.adoption_waits_for \
            else "the workers' registrations"
        return f"adopting: waiting for {who}, {_of(now - since, limits.adoption_grace)}"
    if phase is Phase.DEFERRED:
        assert state.deferred is not None
        d = state.deferred
        bound = max(limits.never_seen_grace, limits.transition_timeout)
        return (f"request {d.request.reason!r}: waiting for {names(d.unknown) or 'its workers'} to register, "
                f"{_of(now - d.since, bound)}")
    if phase is Phase.STARTING:
        return "no world yet: waiting for a plan request"
    return _steady_wait(state, now, limits, waits)


def _switch_wait(gen: Generation, current: WorldPlan | None, now: float, timeout: float,
                 dead: frozenset[str]) -> str:
    plan = gen.plan
    g = plan.generation
    if gen.reopened:
        return (f"generation {g} was open when the coordinator restarted: waiting for its members' reports "
                "to decide it")
    missing = sorted(m for m in involved(current, plan) if m not in dead and m not in gen.results)
    waited = _of(gen.waited(missing, now, timeout), timeout)
    live = current is not None and plan.is_live_transition
    if live and gen.decision is None:
        votes = [m for m in plan.members if m not in gen.ready]
        if votes:
            what = f"{votes[0]}'s ready vote" if len(votes) == 1 else f"the ready votes of {names(votes)}"
            return f"generation {g}: waiting for {what}, {waited}"
    if live and gen.decision == COMMITTED:
        return f"generation {g} committed: waiting for the reports of {names(missing) or 'its members'}"
    if missing:
        return f"generation {g}: waiting for the results of {names(missing)}, {waited}"
    return f"generation {g}: waiting for its decision"


def _steady_wait(state: ControlState, now: float, limits: Limits, waits: Waits) -> str | None:
    current = state.current
    assert current is not None
    if waits.refused:
        why, since = min(waits.refused.items(), key=lambda kv: kv[1])
        return (f"no world can be planned for the survivors ({why}): asking again, "
                f"{_of(now - since, limits.transition_timeout)}")
    if waits.broken:
        member, since = min(waits.broken.items(), key=lambda kv: kv[1])
        return (f"{member} reports the world of generation {current.generation} broken: recovering unless a death "
                f"explains it first, {_of(now - since, limits.heartbeat_timeout)}")
    if waits.holders_missing:
        return f"waiting for the members of generation {current.generation} to reconnect after the coordinator restart"
    return None
