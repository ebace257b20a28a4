"""How a generation ends: the coordinator's judgement of a pending plan, and of a plan left open
by a coordinator that died inside its commit window. Pure: reads in, a verdict out.

The commit point of a live transition is the generation's decision (``Keys.decision``), written
once by whoever comes first: the last new member ready ("committed"), a member that failed, or
the coordinator ("aborted: ...") on a death, a failure or a timeout. Everything else (results,
outcome, history) follows that one value. A plan without live state (a first world, a stop, a
restore) has no commit point: it is committed when every member reported ok.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from liveshard.runtime.contract.env import Defaults
from liveshard.runtime.contract.keys import COMMITTED
from liveshard.runtime.control.protocol import LIVE, MemberResult, WorldPlan, transition_members


@dataclass
class Generation:
    """A plan being switched to."""

    plan: WorldPlan
    started: float  # the coordinator's clock when it was published
    results: dict[str, MemberResult] = field(default_factory=dict)
    outcome: str | None = None
    # Left open in its commit window by a coordinator that died: decided from the members'
    # reports (``resolve_open``) by the coordinator that took over.
    reopened: bool = False
    # member -> (the newest training step seen from it while it had taken up this plan, when that
    # step was first seen): a member training towards the switch step is slow, not stuck (``waited``)
    advanced: dict[str, tuple[int, float]] = field(default_factory=dict)
    # The last tick's reads of its commit point, for the reason it waits (``phases``)
    ready: frozenset[str] = frozenset()
    decision: str | None = None

    def pause(self, gap: float) -> None:
        """The coordinator's process was stopped for ``gap`` seconds (its store with it): the
        time does not count against the generation's timeout."""
        self.started += gap
        self.advanced = {m: (step, t + gap) for m, (step, t) in self.advanced.items()}

    def saw_step(self, member: str, step: int, now: float) -> None:
        """A heartbeat of ``member`` training in the running world at ``step``. The first one is
        the baseline (it counts from ``started``); each later step counts from when it was seen."""
        prev = self.advanced.get(member)
        if prev is None:
            self.advanced[member] = (step, self.started)
        elif step > prev[0]:
            self.advanced[member] = (step, now)

    def waited(self, missing: Iterable[str], now: float, timeout: float) -> float:
        """How long the generation has waited for ``missing`` (involved, alive, no result yet):
        since the stalest of them last advanced a training step, or since it was published.
        Progress extends the wait by at most ``PROGRESS_CAP`` timeouts in all, so a member that
        trains on but never takes up the plan still ends it within a bound."""
        since = min((self.advanced.get(m, (0, self.started))[1] for m in missing), default=self.started)
        waited = now - max(self.started, since)
        if now - self.started > PROGRESS_CAP * timeout:
            return max(waited, now - self.started)
        return waited


@dataclass(frozen=True)
class Judgement:
    """``decide``: write this abort as the decision (the first value written stands: the loop
    reads back what the key holds and calls ``finish`` with it); ``finish``: the outcome;
    neither: wait."""

    decide: str | None = None
    finish: str | None = None


WAIT = Judgement()
# A generation whose missing members keep training towards it may take this many transition
# timeouts in all (a loaded node's steps are slow; the switch step is some steps away).
PROGRESS_CAP = Defaults.TRANSITION_PROGRESS_CAP  # the operator counts on it too (contract.answer_due)
TIMED_OUT = "aborted: no result from"  # how an outcome for members that never answered starts


def involved(current: WorldPlan | None, plan: WorldPlan) -> tuple[str, ...]:
    """The processes a generation waits for: its transition's members, or its own."""
    return transition_members(current, plan) if current is not None else plan.members


def judge(gen: Generation, current: WorldPlan | None, dead: set[str] | frozenset[str], *, decision: str | None,
          arrived: int, now: float, timeout: float, ready: frozenset[str] = frozenset()) -> Judgement:
    """The pending generation's state after this tick's reads: ``decision`` the value of its
    commit point (None: none yet), ``arrived`` the new members counted in to build the new world
    (from then on every source has delivered, and a leaver's death no longer matters), ``ready``
    the new members whose ready vote is in (all of them: the coordinator writes the commit the
    last member's write may have missed)."""
    plan = gen.plan
    alive = tuple(m for m in involved(current, plan) if m not in dead)
    failed = [m for m, r in gen.results.items() if not r.ok]
    lost = [m for m in plan.members if m in dead]
    # a live change's sources (leavers included) matter until the new members arrive: from then
    # on the transfer has delivered (``agent.world_change``: every strategy that moves state live)
    live = current is not None and plan.mode == LIVE
    if current is not None and live and not lost and arrived == 0:
        lost = [m for m in transition_members(current, plan) if m in dead]
    complete = all(m in gen.results for m in alive)
    why = None
    if failed:
        why = f"aborted: {failed[0]}: {gen.results[failed[0]].error}"
    elif lost:
        why = f"aborted: member {lost[0]} died during the transition"
    elif not complete and gen.waited(missing := sorted(set(alive) - set(gen.results)), now, timeout) > timeout:
        why = f"{TIMED_OUT} {', '.join(missing[:3])} in {now - gen.started:.0f} s"
    if live:
        if decision is None:
            if plan.members and all(m in ready for m in plan.members):
                return Judgement(decide=COMMITTED)  # every vote is yes: nothing can have aborted it
            return Judgement(decide=why) if why is not None else WAIT
        if decision == COMMITTED and not (complete or why is not None):
            return WAIT  # the members' reports (phase timings) follow at once
        return Judgement(finish=decision)
    if why is not None or complete:
        return Judgement(finish=why or COMMITTED)
    return WAIT


class OpenReport(Protocol):
    """What a member tells a restarted coordinator about a generation whose decision it did not
    learn (``control.protocol.OpenGeneration``): it reached the commit window (its new world is
    built, or it failed and then knows the abort), whether its ready vote is confirmed, and the
    decision it read, if any (read-only: the reports are frozen records)."""

    @property
    def generation(self) -> int: ...

    @property
    def ready(self) -> bool: ...

    @property
    def decision(self) -> str | None: ...


def resolve_open(plan: WorldPlan, reports: Mapping[str, OpenReport], registered: Iterable[str],
                 dead: Iterable[str] = (), adopted: Iterable[str] = ()) -> str | None:
    """The decision of a generation whose coordinator (and its store, holding the commit point)
    died inside the commit window, from what the live processes report (two-phase commit's
    recovery), or None while it cannot be known yet:

    * a process read a decision, or trains in the generation's world (``adopted``: it read
      "committed"): that one (it may act on it already);
    * a new member is neither re-registered nor dead: wait. It may have read "committed" (it
      may even have written it), and only it can say; a dead one's view no longer matters;
    * every new member is alive and reached the commit window (its world is built; a vote
      not confirmed may still have landed, so it counts as cast): "committed";
    * else "aborted": a member that is dead, or alive without having voted, cannot have let
      anyone commit, or no live process acted on it.
    """
    if any(True for _ in adopted):
        return COMMITTED
    mine = {m: r for m, r in reports.items() if r is not None and r.generation == plan.generation}
    for r in mine.values():
        if r.decision:
            return r.decision
    registered, dead = set(registered), set(dead)
    if any(m not in registered and m not in dead for m in plan.members):
        return None
    if plan.members and all(m in mine and m not in dead for m in plan.members):
        return COMMITTED
    return "aborted: the coordinator restarted inside the commit window before every member was ready"
