"""What the operator should do for one job, given what it sees now: a pure decision.

``reconcile(job, pods, nodes, now)`` reads the job (spec and status), its pods and the signal
of every node, and returns a ``Decision``: the status to write (a new plan, conditions,
history), pods to create and to delete, events to post. It keeps no state of its own: all of
it lives in the job's status, so an operator restarted mid-reconfiguration decides the same
thing again from the same objects.

Vocabulary. A pass reads everything once into an ``Observation`` (frozen, ``observation.py``):
the job's metadata and raw status, its spec as read (or why it is refused), the runtime's
status parts (``plan``, ``ack``, ``abort``, ``telemetry``, ``world``, ``finished``, ``failure``,
``checkpoint``, ``adaptive``; a malformed one reads as absent and is reported where it is
used), the operator's ``tracking`` records, the worker pods with the signal each acts on
(``workers``, ``by_name``), those that crashed since the last pass (``crashed``), Kueue's
admission of a job behind a queue (``admission``, ``kueue.py``; its admitted count bounds the
``desired`` size), and ``now``.
Its phases are functions of the observation that write into the ``Outputs`` (the ``Decision``
being built, with the conditions and history the status gets), in this order (``_decide``):

1. **inputs**: the spec (an unreadable or refused one fails the job until it changes), its
   deprecated fields and the malformed status parts reported; then, unless the run has
   finished, the coordinator pod (a stopped one replaced) and when to look again for node
   signals still settling;
2. **endings** (``endings.py``): finished, a configuration error every pod repeats, the budget
   of crashed pods spent, the runtime's failure report: each ends the pass; otherwise the
   runtime's checkpoint report (conditions) and straggler switches (events) are noted;
3. **answers**: the runtime's answer to the current plan (acked, aborted) and the world it runs
   (``status.world``; one it made on its own is recorded as the plan) give the ``Current``
   plan, its members, whether it is acked;
4. **plan** (``planning.py``): who leaves, who can take part, and whether to write a new plan
   or a stop;
5. **pods**: leavers deleted once it is safe, missing pods created (after a failed pod's
   back-off);
6. **conditions**: the phase, the conditions and the history written into the status.

A job behind a Kueue queue that may not run (not admitted, evicted, ``spec.suspend``) takes
``queueing.hold`` instead of phases 4-6: its Workload created, no pod, a stop plan for a running
world, its pods released once stopped, then its quota; an admitted one ends with
``queueing.admitted`` (the flavors' placement, an elastic Workload resized).

The protocol with the runtime (operator/README.md): a plan is written with a new generation;
the coordinator acks it by setting ``status.appliedGeneration``. Leaving pods are deleted only
after the ack of a plan that excludes them (or once they are dead), never before: until then
they may still hold state the new owners copy from.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from liveshard.operator import builders, queueing, tracking
from liveshard.operator.conditions import condition
from liveshard.operator.endings import (
    close,
    config_error,
    config_failed,
    failed,
    failure_budget_spent,
    runtime_failed,
    succeeded,
)
from liveshard.operator.kueue import Admission
from liveshard.operator.observation import (
    IDLE_REQUEUE_SECONDS,
    Decision,
    Observation,
    Outputs,
    cond,
    observe,
    part,
    status_count,
    track,
    why_departing,
    why_leaving,
)
from liveshard.operator.planning import (
    ABORT_RETRY_SECONDS,
    next_plan,
    record_observed,
    unrecorded,
    write_plan,
    write_stop,
)
from liveshard.operator.policy import DEFAULT_POLICY, JobPolicy
from liveshard.operator.signals import Signal
from liveshard.runtime.contract.crd import LABEL_ROLE, ROLE_COORDINATOR
from liveshard.runtime.contract.jobspec import deprecated_fields
from liveshard.runtime.contract.status import CheckpointReport, ConditionType, JobPhase, StatusPlan
from liveshard.runtime.contract.times import iso, parse_time
from liveshard.runtime.planner.pods import Candidate

UNACKED_REQUEUE_SECONDS = 5.0
# A failed worker pod is re-created after a back-off that doubles with each failure of the job's
# pods (as a Kubernetes Job's pods are), so a crash loop costs little API and scheduler work.
POD_BACKOFF_BASE_SECONDS = 10.0
POD_BACKOFF_MAX_SECONDS = 300.0


def pod_backoff_seconds(pod_failures: int) -> float:
    """The wait before re-creating a pod after the job's ``pod_failures``-th failed pod."""
    return min(POD_BACKOFF_BASE_SECONDS * 2 ** max(0, pod_failures - 1), POD_BACKOFF_MAX_SECONDS)


@dataclass(frozen=True)
class Current:
    """The plan the job has as far as this pass knows: ``members`` train in it once ``acked``;
    ``applied``: the pods of the world that runs (None: not known to be any), which only
    ``plan`` or ``acked`` change when a new plan is written."""

    plan: StatusPlan | None
    members: list[str]
    acked: bool
    aborted: bool
    applied: set[str] | None


# ---- the decision -----------------------------------------------------------------------------
def reconcile(job: dict[str, Any], pods: list[dict[str, Any]], nodes: Mapping[str, Signal | None],
              now: datetime, *, node_labels: Mapping[str, Mapping[str, str]] | None = None,
              scale_up_checked: Hashable | None = None, policy: JobPolicy = DEFAULT_POLICY,
              admission: Admission | None = None) -> Decision:
    """``policy``: what this operator allows jobs (``liveshard operator`` flags); ``admission``:
    Kueue's admission of a job behind a queue (``kueue.read_admission``; None: no queue)."""
    o = observe(job, pods, nodes, now, node_labels or {}, scale_up_checked, policy, admission)
    out = Outputs.start(o)
    _decide(o, out)
    return out.decision


def _decide(o: Observation, out: Outputs) -> None:
    """The phases, in order; an ending stops the pass."""
    st = out.decision.status
    st["observedGeneration"] = o.generation
    st.update(tracking.migration(o.status))  # an older operator's records, moved
    st["selector"] = builders.worker_selector(o.name)
    if not _inputs(o, out):
        st["conditions"] = out.conditions
        return
    finished = part(o, out, "finished")
    if finished is not None:
        succeeded(o, out, finished)
        queueing.finished(o, out)
        return
    _coordinator_pod(o, out)
    _settling(o, out)
    if config_error(o, out):
        config_failed(o, out)
        return
    if failure_budget_spent(o):
        failed(o, out)
        return
    failure = part(o, out, "failure")
    if failure is not None:
        runtime_failed(o, out, failure)
        return
    _checkpoint_conditions(o, out)
    _adaptive_event(o, out)
    cur = _answers(o, out)
    if not queueing.runs(o):  # behind a queue, not admitted (or evicted): no pods, a stop
        queueing.hold(o, out, cur)
        close(out)
        return
    cur = _replan(o, out, cur)
    _pods(o, out, cur)
    _conditions(o, out, cur)
    queueing.admitted(o, out)
    close(out)
    if cur.plan and not cur.acked:
        out.requeue(UNACKED_REQUEUE_SECONDS)


# -- phase 1: inputs --
def _inputs(o: Observation, out: Outputs) -> bool:
    """False (and a Failed job) if the spec is invalid or refused: not terminal, once the spec
    (or the operator's flags) changes the job starts. Otherwise the spec's deprecated fields
    (a spec not seen before) and the malformed parts of the runtime's status are reported."""
    if o.problem is not None:
        problem, reason = o.problem
        st = out.decision.status
        st["phase"] = JobPhase.FAILED
        st["message"] = str(problem)
        cond(o, out, ConditionType.READY, False, reason, str(problem))
        if o.status.get("message") != str(problem):
            out.event("Warning", reason, str(problem))
        return False
    out.decision.spec = o.spec
    if o.status.get("observedGeneration") != o.generation:  # a spec not seen before
        for line in deprecated_fields(o.job.get("spec")):
            out.event("Warning", "DeprecatedField", line)
    for name in ("plan", "ack", "abort", "telemetry", "world"):
        part(o, out, name)  # (reported once here; read from the observation where used)
    return True


def _coordinator_pod(o: Observation, out: Outputs) -> None:
    d = out.decision
    coordinators = [p for p in o.pods if ((p.get("metadata") or {}).get("labels") or {}).get(
        LABEL_ROLE) == ROLE_COORDINATOR and not p["metadata"].get("deletionTimestamp")]
    for p in coordinators:
        if (p.get("status") or {}).get("phase") in ("Failed", "Succeeded"):
            # e.g. evicted: a stopped pod is not restarted, so replace it (next pass)
            d.delete_pods.append(p["metadata"]["name"])
            out.event("Warning", "CoordinatorReplaced",
                      f"coordinator pod {p['metadata']['name']} stopped: "
                      f"{(p.get('status') or {}).get('reason') or 'no reason given'}")
    d.create_coordinator = not coordinators


def _settling(o: Observation, out: Outputs) -> None:
    """Look again when the youngest withdrawable node signal has held long enough."""
    assert o.spec is not None
    debounce = o.spec.elasticity.debounce_seconds
    settling = [s.settling(o.now, debounce) for s in (o.nodes.get(w.node) for w in o.workers if w.node)
                if s is not None]
    if any(settling):
        out.requeue(min(x for x in settling if x) + 0.1)


# -- phase 2 (after endings.py's): what the runtime reports --
def _checkpoint_conditions(o: Observation, out: Outputs) -> None:
    """``CheckpointUnavailable`` and ``CheckpointFailing`` from the runtime's checkpoint
    report: training goes on either way, but a loss with no surviving copy would roll back
    further than the job's schedule promises (or, with no checkpoint at all, fail the job)."""
    report: CheckpointReport = part(o, out, "checkpoint")
    if report.unavailable or condition(out.conditions, ConditionType.CHECKPOINT_UNAVAILABLE):
        cond(o, out, ConditionType.CHECKPOINT_UNAVAILABLE, bool(report.unavailable),
             "DirectoryUnusable" if report.unavailable else "DirectoryUsable",
             f"{report.unavailable}; mount a shared writable volume (spec.checkpoint)"
             if report.unavailable else "")
    if report.failed_saves or condition(out.conditions, ConditionType.CHECKPOINT_FAILING):
        failing = report.failing
        cond(o, out, ConditionType.CHECKPOINT_FAILING, failing, "SaveFailed" if failing else "SaveSucceeded",
             f"{report.failed_saves} failed save(s), last: {report.last_failure}" if failing
             else f"checkpoint of step {report.latest_step} complete")


def _adaptive_event(o: Observation, out: Outputs) -> None:
    """An event for each switch the straggler policy made (``status.adaptive``), once: the
    decision's time is remembered in ``status.adaptive.announcedAt``."""
    last = part(o, out, "adaptive").last_decision or {}
    when = last.get("time")
    if not last.get("switch") or not when or (o.status.get("adaptive") or {}).get("announcedAt") == when:
        return
    out.event("Normal", "StragglerReplan",
              f"{last.get('config')} ({last.get('kind')}) for slow device(s) "
              f"{', '.join(last.get('stragglers') or ()) or '-'}: {last.get('reason')}")
    out.decision.status["adaptive"] = {"announcedAt": when}


# -- phase 3: the runtime's answers --
def _answers(o: Observation, out: Outputs) -> Current:
    """The runtime's answer to the current plan, and the world it runs (``status.world``, the
    coordinator's at each commit): its size shows at once, and a world the runtime made on its
    own (a recovery from a loss without notice, a straggler switch) is recorded as the plan
    once no plan of the operator's is on its way (an answered one was acked only if it runs,
    so never hides it)."""
    st = out.decision.status
    plan = o.plan
    # an observed plan records a world that runs already: applied when written
    acked = plan is None or o.ack.generation >= plan.generation or plan.observed_world is not None
    members = list(plan.members) if plan else []
    st["worldSize"] = int(o.status.get("worldSize") or 0)
    if plan and acked and plan.generation:
        _note_ack(o, out, plan)
        st["worldSize"] = plan.world_size
    aborted = plan is not None and not acked and o.abort.generation >= plan.generation
    if aborted:
        assert plan is not None
        _note_abort(o, out, plan)
    world = o.world
    if world is not None:
        st["worldSize"] = world.world_size
        if (plan is None or acked or aborted) and unrecorded(o, out, world, plan):
            plan = record_observed(o, out, plan, world)
            members, acked, aborted = list(plan.members), True, False
    # the pods of the world that runs (as far as the status knows): one in neither it nor the
    # next plan holds nothing anyone copies from
    return Current(plan, members, acked, aborted, set(members) if acked else None)


def _note_ack(o: Observation, out: Outputs, plan: StatusPlan) -> None:
    gen = plan.generation
    entry = next((h for h in out.history if h.get("generation") == gen), None)
    if entry is None or entry.get("outcome"):
        return
    applied_at = o.ack.at or o.now
    created = plan.created_at or applied_at
    seconds = max(0.0, (applied_at - created).total_seconds())
    entry.update(appliedAt=iso(applied_at), seconds=round(seconds, 3), outcome="Applied")
    out.decision.applied = (gen, seconds)
    what = f"{plan.config} on {plan.world_size} GPUs" if plan.members else "stopped"
    out.event("Normal", "Reconfigured", f"generation {gen} applied: {what} ({seconds:.1f}s after the plan)")


def _note_abort(o: Observation, out: Outputs, plan: StatusPlan) -> None:
    entry = next((h for h in out.history if h.get("generation") == plan.generation), None)
    if entry is not None and entry.get("outcome") != "Aborted":
        entry.update(outcome="Aborted", abortedAt=iso(o.now))
        out.event("Warning", "ReconfigurationAborted", f"generation {plan.generation} aborted by the "
                  f"runtime: {o.abort.reason or 'no reason'}")


# -- phase 4: who leaves, who can take part, a new plan? --
def _candidates(o: Observation, cur: Current) -> list[Candidate]:
    """The running pods a plan may name. A pod the current plan has leaving is not taken back
    (the same pod: its uid): one the runtime left out of its world is lost even while its
    node's signal still settles."""
    plan, members = cur.plan, cur.members
    left = {m: (plan.member_uids.get(m) if plan else None) for m in (plan.leaving if plan else ())}
    return [Candidate(w.name, w.node or "", w.gpu_memory_bytes, float(o.speeds.get(w.name, 1.0)))
            for w in o.workers if w.running and (why_leaving(o, w) is None
                                                 or (w.name in members and why_departing(o, w) is None))
            and not (w.name in left and left[w.name] == w.uid)]


def _replan(o: Observation, out: Outputs, cur: Current) -> Current:
    """Write a new plan, or a stop, if the planning phase decides one."""
    nxt = next_plan(o, out, cur.plan, cur.members, _candidates(o, cur), cur.acked, cur.aborted)
    if nxt.assignment is not None:
        new = write_plan(o, out, cur.plan, nxt, cur.members)
        return replace(cur, plan=new, members=list(new.members), acked=False)
    if nxt.stop_reason is not None and cur.members:
        new = write_stop(o, out, cur.plan, nxt, cur.members)
        return replace(cur, plan=new, members=[], acked=False)
    return cur


# -- phase 5: pods --
def _pods(o: Observation, out: Outputs, cur: Current) -> None:
    """Delete the leavers once it is safe, create what is missing."""
    old_backoff = o.tracking[tracking.RECREATE_AFTER]
    backoff = _delete_leavers(o, out, cur, dict(old_backoff))
    d = out.decision
    existing = {w.name for w in o.workers}
    assert o.spec is not None
    for i in range(o.desired):
        name = builders.worker_name(o.name, i)
        if name in existing:
            continue
        wait = _backoff_left(o, backoff.get(name))
        if wait > 0:  # a failed pod's replacement waits out its back-off
            out.requeue(wait + 0.1)
            continue
        d.create_workers.append(i)
    # A merge patch: new entries are written, those whose time has passed removed (null).
    changes = {n: t for n, t in backoff.items() if old_backoff.get(n) != t}
    changes.update({n: None for n, t in backoff.items() if n in old_backoff and _backoff_left(o, t) <= 0})
    if changes:
        track(o, out, tracking.RECREATE_AFTER, changes)
    d.status["replicas"] = sum(1 for w in o.workers if not w.deleting and w.name not in d.delete_pods)


def _delete_leavers(o: Observation, out: Outputs, cur: Current, backoff: dict[str, Any]) -> dict[str, Any]:
    """Delete each leaving pod that is dead or in no world that runs or is planned; count the
    failed ones (a crashed one sets its replacement's back-off, returned in ``backoff``)."""
    d, st = out.decision, out.decision.status
    assert o.spec is not None
    counted = list(o.tracking[tracking.COUNTED])
    crashed = {w.uid for w in o.crashed}
    pod_failures = o.pod_failures
    limit = o.spec.elasticity.max_pod_failures
    for w in o.workers:
        why = why_leaving(o, w)
        if w.deleting or why is None:
            continue
        outside = w.name not in cur.members and (cur.acked or (cur.applied is not None and w.name not in cur.applied))
        if not (w.dead or outside):
            continue
        d.delete_pods.append(w.name)
        if why.failure and w.uid not in counted:
            counted.append(w.uid)
            d.new_failures += 1
            if w.uid in crashed:
                pod_failures += 1
                wait = pod_backoff_seconds(pod_failures)
                backoff[w.name] = iso(o.now + timedelta(seconds=wait))
                allowed = f" of {limit} allowed" if limit is not None else ""
                out.event("Warning", "WorkerFailed", f"{w.name} failed: {why.reason}; pod failure "
                          f"{pod_failures}{allowed}; re-created in {wait:.0f}s")
        out.event("Normal", "WorkerRemoved", f"deleting {w.name}: {why.reason}")
    if d.new_failures:
        st["failures"] = status_count(o.status.get("failures")) + d.new_failures
        track(o, out, tracking.COUNTED, counted[-tracking.COUNTED_LIMIT:])
    if pod_failures != o.pod_failures:
        st["podFailures"] = pod_failures
    return backoff


def _backoff_left(o: Observation, until: Any) -> float:
    at = parse_time(until)
    return 0.0 if at is None else (at - o.now).total_seconds()


# -- phase 6: phase and conditions --
def _conditions(o: Observation, out: Outputs, cur: Current) -> None:
    st = out.decision.status
    plan, members, acked = cur.plan, cur.members, cur.acked
    stopped = plan is not None and not members
    if st.get("phase") == JobPhase.SUSPENDED or stopped:
        why = (plan.reason if plan else "") or st.get("message") or "no feasible plan"
        st["phase"] = JobPhase.SUSPENDED
        st["message"] = why
        kind = "BelowMinWorkers" if "fewer than workers.min" in why else "NoFeasiblePlan"
        cond(o, out, ConditionType.SUSPENDED, True, kind, why)
    else:
        cond(o, out, ConditionType.SUSPENDED, False, "Planned" if plan else "Waiting", "")
    if "phase" not in st:
        if not acked:
            st["phase"] = JobPhase.PENDING if o.ack.generation == 0 else "Reconfiguring"
        else:
            st["phase"] = JobPhase.RUNNING
        st["message"] = plan.reason if plan else ""
    running = st["phase"] == "Running"
    pending = plan is not None and not acked
    cond(o, out, ConditionType.READY, running, st["phase"], st.get("message", ""))
    cond(o, out, ConditionType.RECONFIGURING, pending, "PlanPending" if pending else "Idle",
         f"waiting for the runtime to apply generation {plan.generation}" if pending and plan else "")
    cond(o, out, ConditionType.DEGRADED, *_degraded(o, cur, running))
    old = condition(out.conditions, ConditionType.FAILED)
    if old is not None and old.get("status") != "False":  # resumed: maxPodFailures raised, spec edited
        cond(o, out, ConditionType.FAILED, False, out.resume_reason, "")


def _degraded(o: Observation, cur: Current, running: bool) -> tuple[bool, str, str]:
    """The ``Degraded`` condition: (status, reason, message)."""
    plan, members = cur.plan, cur.members
    assert o.spec is not None
    desired = o.desired
    if plan is not None and not cur.acked:
        if plan.deadline and o.now > plan.deadline:
            return (True, "AckDeadlineExceeded",
                    f"generation {plan.generation} not applied by its deadline {iso(plan.deadline)}")
        if o.abort.generation >= plan.generation:
            return True, "ReconfigurationAborted", o.abort.reason or "the runtime aborted the reconfiguration"
    if running and len(members) < desired:
        ready = sum(1 for w in o.by_name.values() if w.running and why_leaving(o, w) is None)
        if ready >= desired and plan is not None:
            # every desired pod runs: the planner left some standing by (the plan says why)
            why = next((line for line in plan.explanation if "standby" in line), "")
            return False, "StandbyByChoice", (f"training on {len(members)} of {desired} worker pods, the others "
                                              "stand by" + (f": {why}" if why else ""))
        return (True, "BelowDesiredSize",
                f"training on {len(members)} of {desired} desired worker pods ({ready} running)")
    return False, "AsDesired", ""


__all__ = ["ABORT_RETRY_SECONDS", "IDLE_REQUEUE_SECONDS", "Decision", "reconcile"]
