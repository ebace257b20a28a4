"""The queue phase of a pass for a job behind Kueue (``kueue.py``): functions of the
``Observation`` that write into its ``Outputs`` (``reconcile`` calls them). Pure.

A queued job runs only while its Workload is admitted (``o.admission``). Until then it creates
no pod and shows ``Suspended`` with Kueue's reason. Evicted (preempted, a flavor gone, its
queue stopped) or held by ``spec.suspend``, a running job is told to checkpoint and stop (the
same stop plan as a job below ``workers.min``), its pods are deleted once the runtime acked the
stop or the eviction's grace (the workers' termination grace) ran out, and the Workload's quota
is handed back (``status.admission`` cleared) so Kueue queues it again; re-admitted, it
resumes from that checkpoint. An admission of fewer workers than desired (partial admission, a
partial preemption) lowers the job's desired size (``Observation.desired``): a live shrink.

An elastic job's Workload follows what the job runs: lowered in place when it runs fewer (scaled
down, admitted fewer, a node's workers gone once their leave is acked), grown by a replacement
slice; worker pods beyond what the admission grants wait behind Kueue's elastic-job scheduling
gate, which is removed once a slice counting them is admitted (``_gate``).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING

from liveshard.operator import builders, kueue
from liveshard.operator.observation import Observation, Outputs, cond, why_leaving
from liveshard.operator.planning import NextPlan, write_stop
from liveshard.runtime.contract.causes import NODE_KINDS, Cause
from liveshard.runtime.contract.status import ConditionType, JobPhase

if TYPE_CHECKING:
    from liveshard.operator.reconcile import Current

QUEUED = "Queued"  # condition: True while the job waits for (or lost) Kueue's admission
# the leaves that lower an elastic job's Workload in place: its node goes
_NODE_LEAVES = frozenset({*NODE_KINDS, Cause.NODE_GONE})


def runs(o: Observation) -> bool:
    """Whether the job may run pods now: no queue, or admitted and neither evicted nor held."""
    a = o.admission
    return a is None or (a.admitted and a.evicted is None and not a.held)


def _why(o: Observation) -> tuple[str, str]:
    """(condition reason, message) of a job that may not run."""
    a = o.admission
    assert a is not None
    if a.held:
        return "Suspended", "spec.suspend is true"
    if a.evicted is not None:
        reason, message = a.evicted
        return reason, f"evicted by Kueue ({reason}): {message}"
    reason, message = a.waiting
    return reason, f"queued in {a.queue}: {reason}" + (f": {message}" if message else "")


def hold(o: Observation, out: Outputs, cur: Current) -> Current:
    """A job that may not run: create its Workload, stop training (checkpoint), delete its
    pods once stopped, then hand the quota back."""
    a = o.admission
    assert a is not None and o.spec is not None
    d, st = out.decision, out.decision.status
    d.create_coordinator = False
    d.create_workers = []
    reason, why = _why(o)
    if a.workload is None and a.queue:
        d.workload.create = kueue.build_workload(o.job, o.spec, priority=a.priority)
    _sync_active(o, out)
    if cur.members and (cur.plan is None or not cur.plan.is_stop):
        # the eviction's grace: the workers' termination grace, as a drain would give them
        grace = float((o.spec.raw.get("template") or {}).get("terminationGracePeriodSeconds", 120))
        nxt = NextPlan(None, why, Cause.QUEUE_EVICTION, f"{Cause.QUEUE_EVICTION}: {why}",
                       o.now + timedelta(seconds=grace))
        new = write_stop(o, out, cur.plan, nxt, cur.members)
        cur = replace(cur, plan=new, members=[], acked=False)
        out.event("Warning", "Evicted" if a.evicted else reason, f"checkpoint and stop: {why}")
    stopping = cur.plan is not None and cur.plan.is_stop and not cur.acked and cur.plan.deadline is not None \
        and cur.plan.deadline > o.now
    if stopping:
        assert cur.plan is not None and cur.plan.deadline is not None
        out.requeue((cur.plan.deadline - o.now).total_seconds() + 0.1)
    else:
        live = [p["metadata"]["name"] for p in o.pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
        for name in live:
            if name not in d.delete_pods:
                d.delete_pods.append(name)
        if live:
            out.event("Normal", "PodsReleased", f"released {len(live)} pod(s): {why}")
        elif a.workload is not None and kueue.has_admission(a.workload) and not runs(o):
            d.workload.release = a.workload_name  # nothing runs: the quota goes back to the queue
    st["phase"] = JobPhase.SUSPENDED
    st["message"] = why
    st["replicas"] = sum(1 for w in o.workers if not w.deleting and w.name not in d.delete_pods)
    cond(o, out, ConditionType.SUSPENDED, True, reason, why)
    cond(o, out, QUEUED, True, reason, why)
    cond(o, out, ConditionType.READY, False, JobPhase.SUSPENDED, why)
    pending = cur.plan is not None and not cur.acked
    cond(o, out, ConditionType.RECONFIGURING, pending, "PlanPending" if pending else "Idle",
         f"waiting for the runtime to checkpoint and stop (generation {cur.plan.generation})"
         if pending and cur.plan else "")
    return cur


def admitted(o: Observation, out: Outputs) -> None:
    """A job that runs under its admission: its pods get the admitted flavors' placement; an
    elastic job's Workload follows its size (lowered in place, grown by a replacement slice)."""
    a = o.admission
    if a is None:
        return
    assert o.spec is not None and a.workload is not None
    d = out.decision
    d.placements = dict(a.placements)
    _sync_active(o, out)
    cq = ((a.workload.get("status") or {}).get("admission") or {}).get("clusterQueue", "")
    cond(o, out, QUEUED, False, "Admitted", f"admitted by ClusterQueue {cq}: {a.workers} worker pod(s)")
    requested = a.requested or 0
    want = o.spec.workers.replicas
    if not a.elastic:
        return
    keep = min(want, a.workers)
    left = _node_leavers(o, out)
    if left:
        # a node took workers away (their leave acked, their pods deleted now): the Workload
        # asks for no more than the job still runs, so the quota goes back to the queue at once
        keep = min(keep, sum(1 for w in o.workers if not (w.gated or w.dead or w.deleting)
                             and w.name not in d.delete_pods))
    if keep < requested:
        # scaled down, a node gone, or Kueue admits fewer (a partial admission or preemption):
        # the Workload asks for no more than runs, so the quota goes back at once (an elastic
        # Workload shrinks in place); growing back is a replacement slice
        d.workload.shrink = (a.workload_name or "", keep)
        why = f" ({', '.join(left)} left)" if left else ""
        out.event("Normal", "WorkloadShrunk", f"Workload {a.workload_name}: {requested} -> {keep} worker pods{why}")
    elif want > requested and a.pending_slice is None:
        index = _slice_index(a.workload_name or "") + 1
        d.workload.create = kueue.build_workload(o.job, o.spec, workers=want, slice_index=index,
                                                 replaces=a.workload_name, priority=a.priority)
        out.event("Normal", "WorkloadSliceRequested",
                  f"asked Kueue for {want} worker pods (slice {d.workload.create['metadata']['name']} "
                  f"replaces {a.workload_name})")
    _gate(o, out, min(a.granted, keep))


def _node_leavers(o: Observation, out: Outputs) -> list[str]:
    """Running (ungated) workers deleted in this pass because their node goes (a spot notice,
    a cordon, the node gone): once their leave is acked, or they are dead."""
    d = out.decision
    return [w.name for w in o.workers if w.name in d.delete_pods and not w.gated
            and (why := why_leaving(o, w)) is not None and why.kind in _NODE_LEAVES]


def _gate(o: Observation, out: Outputs, granted: int) -> None:
    """Kueue's elastic-job gate on an elastic job's worker pods: at most ``granted`` of them
    (the admitted count) are ungated, as Kueue's ``ElasticJobUngater`` counts (pods not
    terminated, an ungated one counts whatever it does); the others wait behind
    ``kueue.x-k8s.io/elastic-job`` for the replacement slice that counts them. Gated pods are
    ungated lowest index first, then new pods take what room is left; the pods of a growth
    (indices up to the pending slice's count) are created now, gated."""
    d = out.decision
    existing = {w.name for w in o.workers}
    for i in range(o.desired, o.growing_to):  # a growth under way: its pods wait gated
        if builders.worker_name(o.name, i) not in existing and i not in d.create_workers:
            d.create_workers.append(i)
    room = granted - sum(1 for w in o.workers if not w.gated and not w.dead)
    for w in sorted((w for w in o.workers if w.gated and not w.dead and not w.deleting
                     and w.name not in d.delete_pods), key=lambda w: w.index):
        if room <= 0:
            break
        d.ungate_pods.append(w.name)
        room -= 1
    for i in sorted(d.create_workers):
        if room > 0:
            room -= 1
        else:
            d.gated_workers.append(i)
    if d.ungate_pods:
        out.event("Normal", "PodsUngated", f"admitted: scheduling gate {kueue.ELASTIC_GATE} removed from "
                  f"{', '.join(d.ungate_pods)}")


def _slice_index(name: str) -> int:
    head, _, tail = name.rpartition("-s")
    return int(tail) if head and tail.isdigit() else 0


def _sync_active(o: Observation, out: Outputs) -> None:
    """``spec.suspend`` deactivates the Workload (``spec.active: false``: Kueue evicts it)."""
    a = o.admission
    assert a is not None
    if a.workload is not None and bool((a.workload.get("spec") or {}).get("active", True)) == a.held:
        out.decision.workload.active = (a.workload_name or "", not a.held)



def finished(o: Observation, out: Outputs) -> None:
    """The job succeeded: its Workload is marked ``Finished`` (Kueue stops counting its quota)."""
    a = o.admission
    if a is not None and a.workload is not None and not kueue.is_true(a.workload, kueue.FINISHED):
        out.decision.workload.finish = a.workload_name
