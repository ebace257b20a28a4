"""The operator's planning phase for one job: whether to plan anew (a start, a departure, an
overdue ack, a spec change, a scale-up), how a plan is written into the status, and how a world
the runtime made on its own is recorded. Functions of the pass's ``Observation`` that write into
its ``Outputs`` (``reconcile`` calls them); pure."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from liveshard.operator import signals
from liveshard.operator.observation import Observation, Outputs, is_lost, why_departing
from liveshard.runtime.contract.causes import WITHOUT_NOTICE, Cause
from liveshard.runtime.contract.status import CommittedWorld, JobPhase, StatusPlan, answer_due
from liveshard.runtime.contract.times import iso, parse_time
from liveshard.runtime.planner.pods import Candidate, PodAssignment, micro_batches, plan_for
from liveshard.runtime.planner.search import NoFeasiblePlan

ABORT_RETRY_SECONDS = 30.0


@dataclass
class NextPlan:
    """What the planning phase decided: a new plan, a stop, or nothing (``assignment`` and
    ``stop_reason`` None)."""

    assignment: PodAssignment | None = None
    stop_reason: str | None = None
    cause: Cause | None = None
    text: str = ""
    deadline: datetime | None = None


def next_plan(o: Observation, out: Outputs, plan: StatusPlan | None, members: list[str],
              candidates: list[Candidate], acked: bool, aborted: bool) -> NextPlan:
    """Whether to plan anew, by precedence: members leaving or lost, a start, a retry after an
    abort or an overdue ack, a spec change, a scale-up."""
    by_name = o.by_name
    leaving = [(m, why) for m in members if m in by_name and (why := why_departing(o, by_name[m]))]
    lost = [m for m in members if m not in by_name]
    if members and (leaving or lost):
        unnoticed = [m for m, why in leaving if why.kind in WITHOUT_NOTICE] + lost
        if not unnoticed:
            return _plan_departures(o, out, plan, members, candidates, leaving, [])
        if not acked:
            # A plan the runtime does not run yet that names a pod lost since: it cannot run
            # as written. Replaced (it is a wish, not a world: no other authority is involved).
            return _attempt(o, out, plan, candidates, Cause.RETRY,
                            f"retry: generation {plan.generation} names {', '.join(unnoticed)}, "
                            "lost without notice")
        # One authority per event: a loss without notice is the runtime's. It recovers on its
        # own (it sees the loss first) and the world it commits is recorded when reported
        # (``status.world``, which wakes this loop); nothing is planned for it here, and
        # nothing else either until then: any plan now would race that recovery.
        return NextPlan()
    if not members:
        return _plan_start(o, out, plan, candidates)
    if aborted and _abort_backoff_over(o, out, plan.generation):
        return _attempt(o, out, plan, candidates, Cause.RETRY,
                        f"retry: generation {plan.generation} was aborted by the runtime")
    if not acked and not aborted and _ack_overdue(o, out, plan):
        return _plan_overdue(o, out, plan, members, candidates)
    if o.status.get("observedGeneration") not in (None, o.meta.get("generation")):
        return _plan_spec_change(o, out, plan, members, candidates)
    if acked and any(c.pod not in members for c in candidates):
        return _plan_scale_up(o, out, plan, members, candidates)
    return NextPlan()


def _ack_overdue(o: Observation, out: Outputs, plan: StatusPlan) -> bool:
    """Whether ``plan`` is past the time by which a live coordinator has answered it
    (``contract.answer_due``): the runtime alone acks or aborts a plan (it aborts one whose
    members are not up by the deadline), so before that time there is nothing to decide here;
    after it no coordinator is there to answer, and planning again is the operator's."""
    due = answer_due(plan)
    if due is None:
        return False
    left = (due - o.now).total_seconds()
    if left > 0:
        out.requeue(left + 0.1)
    return left <= 0


def _plan_overdue(o: Observation, out: Outputs, plan: StatusPlan, members: list[str],
                  candidates: list[Candidate]) -> NextPlan:
    """A plan nobody answered: plan again for the pods running now, if that gives another
    world (the same one again would only restart the wait; the job stays Degraded)."""
    proposal, _ = _try_plan(o, candidates, plan)
    if proposal is not None and (proposal.config != plan.config or list(proposal.members) != members):
        return NextPlan(proposal, None, Cause.RETRY,
                        f"retry: generation {plan.generation} was not applied by its deadline")
    return NextPlan()


def _attempt(o: Observation, out: Outputs, plan: StatusPlan | None, candidates: list[Candidate], cause: Cause,
             text: str, deadline: datetime | None = None) -> NextPlan:
    assignment, stop_reason = _try_plan(o, candidates, plan)
    return NextPlan(assignment, stop_reason, cause, text, deadline)


def _plan_departures(o: Observation, out: Outputs, plan, members, candidates, leaving, lost) -> NextPlan:
    by_name = o.by_name
    deadline = None
    if leaving:
        first = signals.most_pressing([s for _, s in leaving])
        cause = first.kind
        names = [m for m, _ in leaving]
        where = sorted({by_name[m].node for m in names if by_name[m].node})
        text = (f"{first.kind}: {first.reason}"
                + (f" (node {', '.join(where)})" if where and first.kind != Cause.SCALE_DOWN else "")
                + f"; leaving: {', '.join(names)}")
        deadline = min((s.deadline for _, s in leaving if s.deadline), default=None)
        if deadline is not None and deadline <= o.now:
            # already gone (a pod deleted with no grace, a node deleted): nothing to race, the
            # switch gets the job's reconfiguration timeout, not a deadline in the past
            deadline = None
        out.decision.triggers = [by_name[m].node or m for m in names]
        if lost:
            text += f"; lost: {', '.join(lost)}"
    else:
        cause, text = Cause.MEMBER_LOST, f"member-lost: pods {', '.join(lost)} no longer exist"
    # A plan racing a notice names the members and the pods the runtime reports up
    # (status.standby): a pod still starting (a recreated one imports for tens of seconds)
    # would hold the switch until it registered. It joins by a scale-up once up.
    ready = [c for c in candidates if c.pod in members or o.standby.up(c.pod, by_name[c.pod].uid)]
    if len(ready) < len(candidates):
        quick = _attempt(o, out, plan, ready, cause, text, deadline)
        if quick.assignment is not None:
            return quick
    return _attempt(o, out, plan, candidates, cause, text, deadline)


def _plan_start(o: Observation, out: Outputs, plan: StatusPlan | None, candidates: list[Candidate]) -> NextPlan:
    spec, st = o.spec, out.decision.status
    desired = spec.workers.replicas
    ready = len(candidates) >= spec.workers.min and (
        len(candidates) >= desired or _waited(o, out, spec.elasticity.scale_up_cooldown_seconds))
    if ready:
        cause = Cause.INITIAL if plan is None else Cause.RESUME
        nxt = _attempt(o, out, plan, candidates, cause, f"{cause}: {len(candidates)} worker pods running")
        if nxt.assignment is None:
            nxt.cause = None  # nothing to stop: just stay suspended
    else:
        nxt = NextPlan()
        if plan is None:
            st["phase"] = JobPhase.PENDING
            st["message"] = (f"waiting for worker pods: {len(candidates)} of {desired} running "
                             f"(min {spec.workers.min})")
    if nxt.stop_reason and not plan:
        st["phase"] = JobPhase.SUSPENDED
        st["message"] = nxt.stop_reason
    return nxt


def _plan_spec_change(o: Observation, out: Outputs, plan: StatusPlan, members: list[str],
                      candidates: list[Candidate]) -> NextPlan:
    proposal, _ = _try_plan(o, candidates, plan)
    if proposal is not None and (proposal.config != plan.config or list(proposal.members) != members):
        return NextPlan(proposal, None, Cause.SPEC_CHANGED,
                        f"spec-changed: job generation {o.meta.get('generation')}")
    return NextPlan()


def _plan_scale_up(o: Observation, out: Outputs, plan: StatusPlan, members: list[str],
                   candidates: list[Candidate]) -> NextPlan:
    key = (tuple(c.pod for c in candidates), plan.generation)
    # Growing back after the runtime shrank alone (a loss without notice: ``plan`` records its
    # world) is not a scale-up to batch: the pods standing by run already, and the job may be
    # below spec.parallelism.minDataParallel, one more loss from losing state. So no cooldown.
    # The operator is the one authority for it, not the runtime's recovery: which pods may
    # join is a capacity decision made from what only the operator sees (node signals, e.g.
    # a standby on a node with a spot notice or a cordon; spec.workers.replicas; each node's
    # GPU memory), the recovery itself must stay on its short path (survivors only: no
    # joiner's bootstrap while the world is broken), and the runtime's world never holds the
    # operator's standby pods (a plan's members are all it is given).
    # (a world the straggler policy made is not a loss: its left-out pod is not taken back,
    # as no plan's leaver is, and the cooldown stands)
    regrow = plan.observed_world is not None and plan.cause == Cause.LOST_WITHOUT_NOTICE
    wait = 0.0 if regrow else _cooldown_left(o, plan, o.spec.elasticity.scale_up_cooldown_seconds)
    if wait > 0:
        out.requeue(wait + 0.1)
        return NextPlan()
    out.decision.scale_up_key = key
    if key == o.scale_up_checked:
        return NextPlan()
    proposal, _ = _try_plan(o, candidates, plan)
    if proposal is not None and proposal.world_size > plan.world_size:
        joining = [m for m in proposal.members if m not in members]
        if regrow:
            return NextPlan(proposal, None, Cause.SCALE_UP,
                            f"scale-up: grow back after the runtime's recovery ({plan.reason}): "
                            f"{', '.join(joining)} join")
        return NextPlan(proposal, None, Cause.SCALE_UP, f"scale-up: {', '.join(joining)} joined")
    return NextPlan()


# -- the world the runtime runs --
def unrecorded(o: Observation, out: Outputs, world: CommittedWorld, plan: StatusPlan | None) -> bool:
    """Whether ``world`` is one the runtime made on its own that the status does not show yet:
    no operator plan is it (``planGeneration``), the current plan is not it, and it was not
    recorded before (``observedWorld`` of the plan or of a past one in the history)."""
    if world.plan_generation is not None or world.runs(plan):
        return False
    recorded = {h.get("runtimeGeneration") for h in out.history}
    return world.generation not in recorded and (plan is None or plan.observed_world != world.generation)


def record_observed(o: Observation, out: Outputs, old: StatusPlan | None, world: CommittedWorld) -> StatusPlan:
    """Record the world the runtime committed on its own as the job's plan, applied: the
    status shows what runs. A record, not a request: the coordinator acks it as the world it
    runs and never makes it a transition (``observedWorld``)."""
    old_members = list(old.members) if old is not None and not old.is_stop else []
    gen = (old.generation if old else o.last_generation) + 1
    leaving = tuple(m for m in old_members if m not in world.members)
    # the uids of the pods it names (members and leavers): a leaver the runtime lost is not
    # taken back into the grow-back while its node's signal still settles (same uid)
    uids = {m: o.by_name[m].uid for m in world.members if m in o.by_name and o.by_name[m].uid}
    uids.update({m: old.member_uids[m] for m in leaving if old is not None and old.member_uids.get(m)})
    at = world.committed_at or o.now
    why = world.reason or "the runtime changed its world"
    plan = StatusPlan(
        generation=gen, config=world.config, members=world.members,
        gpus_per_worker=o.spec.workers.gpus_per_worker, cause=world.cause or Cause.LOST_WITHOUT_NOTICE,
        reason=f"observed: {why}", created_at=at, leaving=leaving, member_uids=uids,
        joining=tuple(m for m in world.members if m not in old_members),
        explanation=(f"the world the runtime committed on its own (runtime generation {world.generation})",),
        observed_world=world.generation)
    out.decision.status.update(plan.to_status())
    if old is not None:
        for h in out.history:
            if h.get("generation") == old.generation and not h.get("outcome"):
                h["outcome"] = "Superseded"
    out.history.append({"generation": gen, "reason": plan.reason, "from": old.config if old else "",
                        "to": plan.config, "worldSize": world.world_size, "createdAt": iso(at),
                        "appliedAt": iso(at), "seconds": 0.0, "outcome": "Observed",
                        "runtimeGeneration": world.generation})
    out.event("Normal", "RuntimeReconfigured",
              f"generation {gen}: the runtime runs {world.config or 'nothing (stopped)'} on {world.world_size} "
              f"GPUs ({why})")
    return plan


# -- a plan, tried and written --
def _try_plan(o: Observation, candidates: list[Candidate], current: StatusPlan | None
              ) -> tuple[PodAssignment | None, str | None]:
    spec = o.spec
    if len(candidates) < spec.workers.min:
        return None, (f"{len(candidates)} running worker pods, fewer than workers.min="
                      f"{spec.workers.min}")
    running = current if current is not None and not current.is_stop else None
    lost = [m for m in running.members if is_lost(o, m)] if running else []
    try:
        assignment = plan_for(spec, candidates, running.config if running else "",
                              running.members if running else (), lost)
    except NoFeasiblePlan as e:
        return None, f"no feasible plan: {e}"
    return _keeping_members(o, candidates, running, lost, assignment), None


def _keeping_members(o: Observation, candidates: list[Candidate], running: StatusPlan | None, lost: list[str],
                     assignment: PodAssignment) -> PodAssignment:
    """``assignment``, or one that keeps every running member still a candidate: a plan moves
    the pods a signal names (a notice, a loss), never a healthy member the planner would rather
    swap for a standby (a faster one, say): that member would restart for nothing. The
    standbys fill what fits around the members: the planner's world over the members and the
    most standbys (in candidate order) with which it keeps them all. A world too small for
    them all (a spec that shrank it) stays as planned."""
    pods = {c.pod for c in candidates}
    members = [m for m in (running.members if running else ()) if m in pods and m not in lost]
    if set(members) <= set(assignment.members) or len(assignment.members) < len(members):
        return assignment
    assert running is not None
    standbys = [c for c in candidates if c.pod not in members]
    kept = [c for c in candidates if c.pod in members]
    for k in range(len(standbys) - 1, -1, -1):
        try:
            other = plan_for(o.spec, kept + standbys[:k], running.config, running.members, lost)
        except NoFeasiblePlan:
            continue
        if set(members) <= set(other.members):
            return other
    return assignment


def write_plan(o: Observation, out: Outputs, old: StatusPlan | None, nxt: NextPlan,
               old_members: list[str]) -> StatusPlan:
    """Write ``nxt``'s assignment as the job's plan, under the next generation."""
    new = nxt.assignment
    assert new is not None
    gen = (old.generation if old else o.last_generation) + 1
    plan = StatusPlan(
        generation=gen, config=new.config, members=new.members,
        gpus_per_worker=o.spec.workers.gpus_per_worker, cause=nxt.cause, reason=nxt.text,
        deadline=nxt.deadline or _default_deadline(o), created_at=o.now,
        leaving=tuple(m for m in old_members if m not in new.members),
        joining=tuple(m for m in new.members if m not in old_members),
        micro_batches=micro_batches(o.spec, new.plan),
        step_seconds=round(float(new.plan.step_seconds), 6),
        tokens_per_second=round(float(new.plan.tokens_per_second), 3),
        explanation=_with_device(o, new)[:12],
        member_uids={m: o.by_name[m].uid for m in (*new.members, *old_members)
                     if m in o.by_name and o.by_name[m].uid})
    _record_plan(o, out, old, plan)
    standby = f"; {len(new.standby)} pod(s) stand by: {new.standby_reason}" if new.standby_reason else ""
    out.event("Normal", "Replanned", f"generation {gen}: {new.config} on {new.world_size} GPUs "
              f"({len(new.members)} pods); {nxt.text}{standby}")
    return plan


GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"  # GPU feature discovery: the GPU model of a node


def _with_device(o: Observation, new: PodAssignment) -> tuple[str, ...]:
    """The plan's explanation, saying whose figures its prediction (``stepSeconds``,
    ``tokensPerSecond``) uses where the members' nodes are not of that GPU (no GPU model
    labelled: CPU nodes advertising ``nvidia.com/gpu``, or another model)."""
    from liveshard.runtime.planner.cost_model import Hardware

    figures = Hardware().name
    nodes = {o.by_name[m].node for m in new.members if m in o.by_name}
    products = sorted({(o.node_labels.get(n) or {}).get(GPU_PRODUCT_LABEL) or "" for n in nodes})
    head, *rest = new.plan.explanation or ("",)
    if products and all(figures.lower() in p.lower() for p in products):
        return tuple(new.plan.explanation)
    devices = ("no GPU model (no " + GPU_PRODUCT_LABEL + " label: a CPU job runs far slower)") if products == [""] \
        else ", ".join(p or "no GPU model" for p in products)
    note = (f"stepSeconds and tokensPerSecond are GPU figures ({figures}), not a measurement: the nodes report "
            f"{devices}; status.progress.tokensPerSecond is measured")
    return (head, note, *rest)


def write_stop(o: Observation, out: Outputs, old: StatusPlan | None, nxt: NextPlan,
               old_members: list[str]) -> StatusPlan:
    """No plan fits the pods that remain: tell the runtime to checkpoint and stop."""
    why = nxt.stop_reason or ""
    plan = StatusPlan(
        generation=(old.generation if old else o.last_generation) + 1, config="", members=(),
        gpus_per_worker=o.spec.workers.gpus_per_worker, cause=nxt.cause or Cause.MEMBER_LOST,
        reason=f"{nxt.text}; suspended: {why}", deadline=nxt.deadline or _default_deadline(o),
        created_at=o.now, leaving=tuple(old_members), explanation=(why,))
    _record_plan(o, out, old, plan)
    return plan


def _default_deadline(o: Observation) -> datetime:
    return o.now + timedelta(seconds=o.spec.elasticity.reconfiguration_timeout_seconds)


def _record_plan(o: Observation, out: Outputs, old: StatusPlan | None, plan: StatusPlan) -> None:
    out.decision.status.update(plan.to_status())
    if old is not None:
        for h in out.history:
            if h.get("generation") == old.generation and not h.get("outcome"):
                h["outcome"] = "Superseded"
    out.history.append({"generation": plan.generation, "reason": plan.reason,
                        "from": old.config if old else "", "to": plan.config,
                        "worldSize": plan.world_size, "createdAt": iso(o.now)})
    out.decision.replan_reason = plan.cause


# -- time --
def _abort_backoff_over(o: Observation, out: Outputs, gen: int) -> bool:
    entry = next((h for h in out.history if h.get("generation") == gen), None)
    since = parse_time((entry or {}).get("abortedAt")) or o.now
    left = ABORT_RETRY_SECONDS - (o.now - since).total_seconds()
    if left > 0:
        out.requeue(left + 0.1)
        return False
    return True


def _waited(o: Observation, out: Outputs, seconds: float) -> bool:
    created = parse_time(o.meta.get("creationTimestamp"))
    if created is None:
        return True
    left = seconds - (o.now - created).total_seconds()
    if left > 0:
        out.requeue(left + 0.1)
    return left <= 0


def _cooldown_left(o: Observation, plan: StatusPlan | None, seconds: float) -> float:
    created = plan.created_at if plan else None
    if created is None:
        return 0.0
    return seconds - (o.now - created).total_seconds()
