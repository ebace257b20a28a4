"""The pending generation: its results collected each tick, its verdict (``generations.judge``)
carried out, its outcome recorded. Functions over a ``CoordinatorCore`` in the ``SWITCHING`` and
``RESOLVING`` phases; pure: the time is the observation's."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from liveshard.runtime.contract.keys import COMMITTED
from liveshard.runtime.control.protocol import GenerationOutcome, MemberResult, WorkerPhase
from liveshard.runtime.coordinator import planning
from liveshard.runtime.coordinator.events import (
    Action,
    Decide,
    MarkDead,
    Observation,
    Precompute,
    Report,
    WriteOutcome,
)
from liveshard.runtime.coordinator.generations import TIMED_OUT, Generation, involved, judge, resolve_open
from liveshard.runtime.coordinator.phases import Restart
from liveshard.runtime.coordinator.requests import PlanRequest

if TYPE_CHECKING:
    from liveshard.runtime.coordinator.core import CoordinatorCore

log = logging.getLogger("liveshard.coordinator")

RETRIES = 2  # a change whose members' transition failed is asked again this many times in a row


def collect(core: CoordinatorCore, obs: Observation) -> list[Action]:
    """This tick's reads of the pending generation, and what they decide: a decision to write,
    an outcome, or nothing yet."""
    gen = core.pending
    assert gen is not None
    for m, r in obs.results.items():
        gen.results.setdefault(m, r)
    gen.ready, gen.decision = obs.ready, obs.decision
    if gen.reopened and obs.decision is None:
        regs = obs.registrations or {}
        votes = {m: r.open for m, r in regs.items() if r.open is not None}
        adopted = [m for m, r in regs.items() if r.plan is not None and r.plan.generation == gen.plan.generation]
        value = resolve_open(gen.plan, votes, regs.keys(), core.dead, adopted)
        return [] if value is None else [Decide(gen.plan.generation, value)]
    _progress_of_members(core, gen, obs.now)
    if gen.plan.is_live_transition and obs.decision is None and _trains_in_it(core, gen):
        # A member's beats name the new world: it read "committed" there. The decision's key can be
        # deleted by anyone on the network before this coordinator read it; the member's sealed
        # beats keep coming, and a commit is the only decision it can have read.
        return [Decide(gen.plan.generation, COMMITTED)]
    verdict = judge(gen, core.current, core.dead, decision=obs.decision, arrived=obs.arrived, ready=obs.ready,
                    now=obs.now, timeout=core.transition_timeout)
    if verdict.decide is not None:
        return [Decide(gen.plan.generation, verdict.decide)]
    if verdict.finish is not None:
        return finish(core, gen, verdict.finish, obs.now)
    return []


def _trains_in_it(core: CoordinatorCore, gen: Generation) -> bool:
    for m in gen.plan.members:
        b = core.liveness.latest(m)
        # ``generation`` is the world the sender adopted: only a commit puts it there (the state
        # may be anything since: its world broken, its process ending)
        if b is not None and b.generation == gen.plan.generation:
            return True
    return False


def _progress_of_members(core: CoordinatorCore, gen: Generation, now: float) -> None:
    """What the heartbeats say of the generation: a member training in its world took it up; one
    training towards its switch step in the running world is slow, not stuck."""
    if not gen.plan.is_live_transition:
        # A member heartbeating from inside the new world has taken it up: as good as its
        # result (which one write carries, and an attacker can delete; beats keep coming).
        for m in gen.plan.members:
            b = core.liveness.latest(m)
            if m not in gen.results and b is not None and b.generation == gen.plan.generation \
                    and b.state == WorkerPhase.TRAINING:
                gen.results[m] = MemberResult(ok=True)
    if core.current is not None:
        for m in core.involved_alive():
            b = core.liveness.latest(m)
            if b is not None and b.state == WorkerPhase.TRAINING and b.step is not None \
                    and b.generation == core.current.generation and b.preparing == gen.plan.generation:
                gen.saw_step(m, b.step, now)


def finish(core: CoordinatorCore, gen: Generation, outcome: str, now: float) -> list[Action]:
    """The generation's outcome: recorded, written, and followed (a committed world runs; a first
    world that did not start is made again; a world that lost a member is recovered)."""
    plan = gen.plan
    gen.outcome = outcome
    phases: dict[str, float] = {}
    for r in gen.results.values():
        for k, v in r.phases.items():
            phases[k] = max(phases.get(k, 0.0), v)
    planning.history(core, GenerationOutcome(
        plan.generation, outcome, reason=plan.reason, config=plan.config, world_size=len(plan.members),
        cause=plan.cause, phases=phases, downtime=phases.get("downtime", 0.0),
        switch_step=max((r.step for r in gen.results.values()), default=-1), seconds=now - gen.started))
    out: list[Action] = [WriteOutcome(plan.generation, outcome)]
    if outcome == COMMITTED:
        out += _committed(core, gen)
    core.change(pending=None)
    log.info("generation %d %s", plan.generation, outcome)
    out += unanswered(core, gen, outcome)
    again(core, gen, outcome)
    if outcome != COMMITTED and plan.previous is None and core.current is None and not plan.is_stop:
        # A first world that did not start: made again with the workers that answered. Only a
        # timeout says something of the silent: after a member's death the others may still
        # be waiting for it in the world's rendezvous (they answer once that fails).
        if outcome.startswith(TIMED_OUT):
            for m in plan.members:
                if m not in gen.results:
                    core.unresponsive[m] = now
        core.change(restart=Restart(plan.restore_from is not None, now))
    out.append(Report())
    if outcome == COMMITTED:
        out += precompute_action(core)
    if core.finished is None and core.current is not None and any(m in core.dead for m in core.current.members):
        out += planning.recover(core)  # the world lost a member (before this generation, or after its commit point)
    return out


def _committed(core: CoordinatorCore, gen: Generation) -> list[Action]:
    """The generation's world is the running one now."""
    plan = gen.plan
    core.change(current=plan)
    core.broken_recoveries = 0
    if core.stragglers is not None:
        core.stragglers.committed(plan)
    for m in plan.members:
        core.broken_since.pop(m, None)
    # The plan's own dead (gone without notice when it was made) stay dead under any
    # coordinator: one restarted since then never saw the verdict, and the process may
    # be alive after all (frozen): it must drop the world the job went past and come back
    # as a new process.
    out: list[Action] = []
    for m in plan.dead:
        death = core.liveness.declare(m, f"named dead by generation {plan.generation}")
        if death is not None:
            core.forget(m)
            out.append(MarkDead(m, death.incarnation))
    return out


def again(core: CoordinatorCore, gen: Generation, outcome: str) -> None:
    """A change of a running world that failed in its members (a transition group or new world
    whose rendezvous broke: c10d's keys cannot be sealed, and anyone reaching the store can
    overwrite them) is asked again, up to ``RETRIES`` times in a row, while the old world trains
    on: the next generation rendezvouses under a prefix of its own that only the job's processes
    can compute (``contract.keys.rendezvous_token``). A commit ends the count."""
    plan = gen.plan
    if outcome == COMMITTED:
        core.retried.clear()
        return
    failed = [m for m, r in gen.results.items() if not r.ok]
    if (core.current is None or plan.previous is None or plan.is_stop or not failed or core.failure is not None
            or any(m in core.dead for m in (*plan.members, *core.current.members))):
        return  # a first world, a stop, a death or a timeout: handled as before
    reason = plan.reason.split(" (try ")[0]
    tries = core.retried.get(reason, 0)
    if tries >= RETRIES:
        log.error("change %r failed %d times in a row (%s): the job trains on in generation %d",
                  reason, tries + 1, outcome, core.current.generation)
        return
    core.retried[reason] = tries + 1
    log.warning("change %r failed in its members (%s): asked again (try %d of %d) under a new rendezvous prefix",
                reason, outcome, tries + 2, RETRIES + 1)
    request = PlanRequest(members=plan.members, config=plan.config, reason=f"{reason} (try {tries + 2})",
                          cause=plan.cause)
    unheard = tuple(m for m in plan.members if m not in gen.results)
    if unheard:
        core.retry_hold = RetryHold(request, core.now, unheard)
    core.change(reissue=(*core.state.reissue, request))


@dataclass(frozen=True)
class RetryHold:
    """A change asked again (``again``) that waits for a sign of life from the members that gave
    no result in the try that failed."""

    request: PlanRequest
    since: float  # the reader's time of the failed try's outcome
    unheard: tuple[str, ...]


def held(core: CoordinatorCore, request: PlanRequest) -> bool:
    """Whether the owed ``request`` waits before it is asked. A member's failure may be a peer's
    death that is not judged yet: a joiner killed in its transfer resets its peers' connections at
    once, while its silence counts only after the heartbeat timeout. Asked at once, the new try
    would name the dead member and abort again for its death. So a change asked again goes once
    every member that gave no result in the failed try beat anew since it failed; one of them
    found dead meanwhile drops it (the death is handled as any other, the old world trains on);
    past two heartbeat timeouts it is asked anyway (the beats of the living may be hidden by a
    heartbeat key under attack, and the new try has its own bounds)."""
    hold = core.retry_hold
    if hold is None or hold.request is not request:
        return False
    dead = [m for m in hold.unheard if m in core.dead]
    if dead:
        core.retry_hold = None
        core.change(reissue=tuple(r for r in core.state.reissue if r is not request))
        log.warning("change %r not asked again: %s died", request.reason, ", ".join(dead))
        return True
    if all(core.liveness.beat_since(m, hold.since) for m in hold.unheard) \
            or core.now - hold.since > 2 * core.heartbeat_timeout:
        core.retry_hold = None
        return False
    return True


def unanswered(core: CoordinatorCore, gen: Generation, outcome: str) -> list[Action]:
    """A member that gave no result in two aborted generations in a row answers nothing (a
    process alive but hung, whose heartbeats still come): the liveness judge declares it
    dead, so the next plan goes without it instead of timing out again."""
    out: list[Action] = []
    if outcome == COMMITTED:
        core.silent_in.clear()
        return out
    if not outcome.startswith(TIMED_OUT) or not gen.results:
        # aborted for a death or a failure, or nobody answered (the transition could not
        # form: a cause elsewhere): a missing result says nothing of the member
        return out
    for m in involved(core.current, gen.plan):
        if m in gen.results:
            core.silent_in.pop(m, None)
        elif m not in core.dead:
            core.silent_in[m] = core.silent_in.get(m, 0) + 1
            if core.silent_in[m] >= 2:
                death = core.liveness.declare(m, "no result in two generations in a row")
                if death is not None:
                    core.silent_in.pop(m, None)
                    log.warning("member %s is dead: %s", m, death.why)
                    out.append(MarkDead(m, death.incarnation))
    return out


def precompute_action(core: CoordinatorCore) -> list[Action]:
    """Ask the likeliest next events' plans in the background, for a world that runs whole."""
    current = core.current
    core.chooser.plans.clear()  # the questions of the previous world will not be asked again
    if not core.precompute or current is None or current.is_stop or not current.members:
        return []
    if any(m in core.dead for m in current.members):
        return []  # a recovery follows at once
    return [Precompute(current, frozenset(core.dead))]
