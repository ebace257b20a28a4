"""What the operator should do for one job, given what it sees now: a pure decision.

``reconcile(job, pods, nodes, now)`` reads the job (spec and status), its pods and the signal
of every node, and returns a ``Decision``: the status to write (a new plan, conditions,
history), pods to create and to delete, events to post. It keeps no state of its own: all of
it lives in the job's status, so an operator restarted mid-reconfiguration decides the same
thing again from the same objects.

The protocol with the runtime (operator/README.md): a plan is written with a new generation;
the coordinator acks it by setting ``status.appliedGeneration``. Leaving pods are deleted only
after the ack of a plan that excludes them (or once they are dead), never before: until then
they may still hold state the new owners copy from.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from liveshard.operator import builders, tracking
from liveshard.operator.conditions import condition, set_condition
from liveshard.operator.endings import HISTORY_LIMIT, Endings, status_count
from liveshard.operator.observed import Worker, observe_workers
from liveshard.operator.planning import Planning
from liveshard.operator.policy import DEFAULT_POLICY, JobPolicy, refusal
from liveshard.operator.signals import Signal
from liveshard.runtime.contract.causes import LOSSES, Cause
from liveshard.runtime.contract.crd import LABEL_ROLE, ROLE_COORDINATOR
from liveshard.runtime.contract.jobspec import JobSpec, deprecated_fields, read_spec
from liveshard.runtime.contract.status import (
    AdaptiveReport,
    CheckpointReport,
    CommittedWorld,
    ConditionType,
    Finished,
    InvalidStatus,
    JobPhase,
    PlanAbort,
    PlanAck,
    RuntimeFailure,
    StatusPlan,
    Telemetry,
)
from liveshard.runtime.contract.times import iso, parse_time
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.planner.pods import Candidate

ABORT_RETRY_SECONDS = 30.0
IDLE_REQUEUE_SECONDS = 30.0
UNACKED_REQUEUE_SECONDS = 5.0
# A failed worker pod is re-created after a back-off that doubles with each failure of the job's
# pods (as a Kubernetes Job's pods are), so a crash loop costs little API and scheduler work.
POD_BACKOFF_BASE_SECONDS = 10.0
POD_BACKOFF_MAX_SECONDS = 300.0


def pod_backoff_seconds(pod_failures: int) -> float:
    """The wait before re-creating a pod after the job's ``pod_failures``-th failed pod."""
    return min(POD_BACKOFF_BASE_SECONDS * 2 ** max(0, pod_failures - 1), POD_BACKOFF_MAX_SECONDS)


@dataclass
class Decision:
    status: dict[str, Any] = field(default_factory=dict)  # merge patch for .status
    create_workers: list[int] = field(default_factory=list)
    create_coordinator: bool = False
    delete_pods: list[str] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    replan_reason: Cause | None = None  # metric label of a plan written now
    triggers: list[str] = field(default_factory=list)  # nodes/pods whose signal caused it
    applied: tuple[int, float] | None = None  # (generation, plan-to-ack seconds) newly acked
    new_failures: int = 0
    requeue_after: float = IDLE_REQUEUE_SECONDS
    scale_up_key: Hashable | None = None  # candidates already tried for scale-up
    spec: JobSpec | None = None


def _generation_of(plan: Any) -> int:
    """The generation of a status plan however malformed the rest is (0 if it has none)."""
    try:
        return max(0, int(plan.get("generation") or 0))
    except (AttributeError, TypeError, ValueError):
        return 0


# ---- the decision -----------------------------------------------------------------------------
def reconcile(job: dict[str, Any], pods: list[dict[str, Any]], nodes: Mapping[str, Signal | None],
              now: datetime, *, node_labels: Mapping[str, Mapping[str, str]] | None = None,
              scale_up_checked: Hashable | None = None, policy: JobPolicy = DEFAULT_POLICY) -> Decision:
    """``policy``: what this operator allows jobs (``liveshard operator`` flags)."""
    return _Reconciler(job, pods, nodes, node_labels or {}, now, scale_up_checked, policy).run()


class _Reconciler(Planning, Endings):
    """One pass over one job, in phases: read the spec, the coordinator pod, the runtime's
    answer to the current plan, who is leaving, whether to plan anew, pods, conditions."""

    def __init__(self, job, pods, nodes, node_labels, now, scale_up_checked, policy=DEFAULT_POLICY) -> None:
        self.job = job
        self.policy = policy
        self.meta = job.get("metadata") or {}
        self.name = self.meta.get("name", "")
        self.status: dict[str, Any] = dict(job.get("status") or {})
        self.pods = pods
        self.nodes = nodes
        self.node_labels = node_labels
        self.now = now
        self.scale_up_checked = scale_up_checked
        self.d = Decision()
        self.conditions = list(self.status.get("conditions") or [])
        self.history = [dict(h) for h in self.status.get("history") or []]
        self.tracking = tracking.tracking_of(self.status)  # the operator's records of failed pods
        self.config_error: dict[str, Any] | None = None  # tracking.configError as this pass leaves it
        self.resume_reason = "WithinPodFailureBudget"  # of a Failed condition cleared in this pass

    # -- helpers --
    def event(self, kind: str, reason: str, message: str) -> None:
        self.d.events.append((kind, reason, message))

    def track(self, key: str, value: Any) -> None:
        """Write one of ``status.tracking``'s records (a merge patch: a map merges into what
        this pass already wrote, None removes), and its old field too while the status has no
        ``tracking`` (``tracking.mirror``)."""
        st = self.d.status
        records = st.setdefault(tracking.TRACKING, {})
        if isinstance(value, dict) and isinstance(records.get(key), dict):
            records[key] = {**records[key], **value}
        else:
            records[key] = value
        if tracking.mirror(self.status):
            st[tracking.OLD_NAME[key]] = records[key]

    def cond(self, ctype: str, status: bool, reason: str, message: str) -> None:
        old = condition(self.conditions, ctype)
        was = bool(old and old.get("status") == "True")
        self.conditions = set_condition(self.conditions, ctype, status, reason, message, self.now,
                                        observed_generation=self.meta.get("generation"))
        if status and not was and ctype in ("Suspended", "Degraded", "CheckpointFailing", "CheckpointUnavailable"):
            self.event("Warning", reason, message)

    def run(self) -> Decision:
        d, st = self.d, self.d.status
        st["observedGeneration"] = self.meta.get("generation")
        st.update(tracking.migration(self.status))  # an older operator's records, moved
        st["selector"] = builders.worker_selector(self.name)
        if not self._read_inputs():
            st["conditions"] = self.conditions
            return d
        finished = self._status_part(Finished.from_status, None)
        if finished is not None:
            self._succeeded(finished)
            return d
        self._coordinator_pod()
        debounce = self.spec.elasticity.debounce_seconds
        workers = observe_workers(self.pods, self.nodes, self.node_labels, self.spec.elasticity.act_on, self.now,
                                  debounce)
        settling = [s.settling(self.now, debounce) for s in (self.nodes.get(w.node) for w in workers if w.node)
                    if s is not None]
        if any(settling):  # look again when the youngest withdrawable signal has held long enough
            self.d.requeue_after = min(self.d.requeue_after, min(x for x in settling if x) + 0.1)
        self.by_name = {w.name: w for w in workers}
        budget_spent = self._failure_budget_spent(workers)
        if self._config_error(workers):
            self._config_failed(workers)
            return d
        if budget_spent:
            self._failed(workers)
            return d
        failure = self._status_part(RuntimeFailure.from_status, None)
        if failure is not None:
            self._runtime_failed(failure, workers)
            return d
        self._checkpoint_conditions()
        self._adaptive_event()
        plan = self.plan
        # an observed plan records a world that runs already: applied when written
        acked = plan is None or self.ack.generation >= plan.generation or plan.observed_world is not None
        members = list(plan.members) if plan else []
        st["worldSize"] = int(self.status.get("worldSize") or 0)
        # 1. the runtime's answer to the current plan
        if plan and acked and plan.generation:
            self._note_ack(plan)
            st["worldSize"] = plan.world_size
        aborted = plan is not None and not acked and self.abort.generation >= plan.generation
        if aborted:
            self._note_abort(plan)
        # 1b. the world the runtime runs (status.world, the coordinator's at each commit) is what
        # the status shows: its size at once, and a world the runtime made on its own (a recovery
        # from a loss without notice, a straggler switch) recorded as the plan once no plan of the
        # operator's is on its way (an answered one was acked only if it runs, so never hides it)
        world = self.world
        if world is not None:
            st["worldSize"] = world.world_size
            if (plan is None or acked or aborted) and self._unrecorded(world, plan):
                plan = self._record_observed(plan, world)
                members, acked, aborted = list(plan.members), True, False
        # the pods of the world that runs (as far as the status knows): one in neither it nor the
        # next plan holds nothing anyone copies from
        applied = set(members) if acked else None
        # 2. who is leaving, who can take part; 3. a new plan?
        # A pod the current plan has leaving is not taken back (the same pod: its uid): one the
        # runtime left out of its world is lost even while its node's signal still settles.
        left = {m: (plan.member_uids.get(m) if plan else None) for m in (plan.leaving if plan else ())}
        candidates = [Candidate(w.name, w.node or "", w.gpu_memory_bytes, float(self.speeds.get(w.name, 1.0)))
                      for w in workers if w.running and (self._leaving(w) is None
                                                         or (w.name in members and self._departure(w) is None))
                      and not (w.name in left and left[w.name] == w.uid)]
        nxt = self._next_plan(plan, members, candidates, acked, aborted)
        # 4. write it
        if nxt.assignment is not None:
            new = self._write_plan(plan, nxt, members)
            plan, members, acked = new, list(new.members), False
        elif nxt.stop_reason is not None and members:
            new = self._write_stop(plan, nxt, members)
            plan, members, acked = new, [], False
        # 5. pods: delete leavers once it is safe, create what is missing
        self._pods(workers, members, acked, applied)
        # 6. phase and conditions
        self._conditions(plan, members, acked, self.ack.generation, self.spec.workers.replicas)
        st["conditions"] = self.conditions
        st["history"] = self.history[-HISTORY_LIMIT:]
        if plan and not acked:
            d.requeue_after = min(d.requeue_after, UNACKED_REQUEUE_SECONDS)
        return d

    def _checkpoint_conditions(self) -> None:
        """``CheckpointUnavailable`` and ``CheckpointFailing`` from the runtime's checkpoint
        report: training goes on either way, but a loss with no surviving copy would roll back
        further than the job's schedule promises (or, with no checkpoint at all, fail the job)."""
        report = self._status_part(CheckpointReport.from_status, CheckpointReport())
        if report.unavailable or condition(self.conditions, ConditionType.CHECKPOINT_UNAVAILABLE):
            self.cond(ConditionType.CHECKPOINT_UNAVAILABLE, bool(report.unavailable),
                      "DirectoryUnusable" if report.unavailable else "DirectoryUsable",
                      f"{report.unavailable}; mount a shared writable volume (spec.checkpoint)"
                      if report.unavailable else "")
        if report.failed_saves or condition(self.conditions, ConditionType.CHECKPOINT_FAILING):
            failing = report.failing
            self.cond(ConditionType.CHECKPOINT_FAILING, failing, "SaveFailed" if failing else "SaveSucceeded",
                      f"{report.failed_saves} failed save(s), last: {report.last_failure}" if failing
                      else f"checkpoint of step {report.latest_step} complete")

    def _adaptive_event(self) -> None:
        """An event for each switch the straggler policy made (``status.adaptive``), once: the
        decision's time is remembered in ``status.adaptive.announcedAt``."""
        report = self._status_part(AdaptiveReport.from_status, AdaptiveReport())
        last = report.last_decision or {}
        when = last.get("time")
        if not last.get("switch") or not when or (self.status.get("adaptive") or {}).get("announcedAt") == when:
            return
        self.event("Normal", "StragglerReplan",
                   f"{last.get('config')} ({last.get('kind')}) for slow device(s) "
                   f"{', '.join(last.get('stragglers') or ()) or '-'}: {last.get('reason')}")
        self.d.status["adaptive"] = {"announcedAt": when}

    # -- phase 0: inputs --
    def _read_inputs(self) -> bool:
        """The spec and the runtime's part of the status; False (and a Failed job) if the spec
        is invalid. A malformed status field is reported and treated as absent, never raised."""
        st = self.d.status
        try:
            spec = read_spec(self.job.get("spec"))
        except ConfigError as e:
            problem, reason = e, "InvalidSpec"
        else:
            problem, reason = refusal(self.job.get("spec") or {}, self.policy), "RefusedByOperator"
        if problem is not None:
            # Not terminal: once the spec (or the operator's flags) changes, the job starts.
            st["phase"] = JobPhase.FAILED
            st["message"] = str(problem)
            self.cond(ConditionType.READY, False, reason, str(problem))
            if self.status.get("message") != str(problem):
                self.event("Warning", reason, str(problem))
            return False
        self.d.spec = self.spec = spec
        if self.status.get("observedGeneration") != self.meta.get("generation"):  # a spec not seen before
            for line in deprecated_fields(self.job.get("spec")):
                self.event("Warning", "DeprecatedField", line)
        self.plan = self._status_part(StatusPlan.from_status, None)
        # A plan this operator cannot read is replaced, under a newer generation than it had.
        self.last_generation = self.plan.generation if self.plan else _generation_of(self.status.get("plan"))
        self.ack = self._status_part(PlanAck.from_status, PlanAck(0))
        self.abort = self._status_part(PlanAbort.from_status, PlanAbort(0))
        self.speeds = self._status_part(Telemetry.from_status, Telemetry()).speeds
        self.world = self._status_part(CommittedWorld.from_status, None)
        return True

    def _status_part(self, read: Callable[[dict[str, Any]], Any], default: Any) -> Any:
        try:
            return read(self.status)
        except InvalidStatus as e:
            self.event("Warning", "InvalidStatus", f"{e}; ignored")
            return default

    def _coordinator_pod(self) -> None:
        coordinators = [p for p in self.pods if ((p.get("metadata") or {}).get("labels") or {}).get(
            LABEL_ROLE) == ROLE_COORDINATOR and not p["metadata"].get("deletionTimestamp")]
        for p in coordinators:
            if (p.get("status") or {}).get("phase") in ("Failed", "Succeeded"):
                # e.g. evicted: a stopped pod is not restarted, so replace it (next pass)
                self.d.delete_pods.append(p["metadata"]["name"])
                self.event("Warning", "CoordinatorReplaced",
                           f"coordinator pod {p['metadata']['name']} stopped: "
                           f"{(p.get('status') or {}).get('reason') or 'no reason given'}")
        self.d.create_coordinator = not coordinators

    # -- phase 2: who leaves --
    def _leaving(self, w: Worker) -> Signal | None:
        if w.signal is not None:
            return w.signal
        desired = self.spec.workers.replicas
        if w.index >= desired:
            return Signal(Cause.SCALE_DOWN, f"scaled down to {desired} workers", None,
                          source="spec.workers.replicas")
        return None

    def _lost(self, pod: str) -> bool:
        """A member pod gone, or going for a reason that leaves nothing to copy from it."""
        w = self.by_name.get(pod)
        why = self._leaving(w) if w is not None else None
        return w is None or w.dead or (why is not None and why.kind in LOSSES)

    # -- phase 3: a new plan? --
    def _pods(self, workers: list[Worker], members: list[str], acked: bool, applied: set[str] | None = None) -> None:
        d, st = self.d, self.d.status
        counted = list(self.tracking[tracking.COUNTED])
        crashed = {w.uid for w in self.crashed}
        pod_failures = self.pod_failures
        old_backoff = self.tracking[tracking.RECREATE_AFTER]
        backoff = dict(old_backoff)
        limit = self.spec.elasticity.max_pod_failures
        for w in workers:
            why = self._leaving(w)
            if w.deleting or why is None:
                continue
            outside = w.name not in members and (acked or (applied is not None and w.name not in applied))
            if not (w.dead or outside):
                continue
            d.delete_pods.append(w.name)
            if why.failure and w.uid not in counted:
                counted.append(w.uid)
                d.new_failures += 1
                if w.uid in crashed:
                    pod_failures += 1
                    wait = pod_backoff_seconds(pod_failures)
                    backoff[w.name] = iso(self.now + timedelta(seconds=wait))
                    allowed = f" of {limit} allowed" if limit is not None else ""
                    self.event("Warning", "WorkerFailed", f"{w.name} failed: {why.reason}; pod failure "
                               f"{pod_failures}{allowed}; re-created in {wait:.0f}s")
            self.event("Normal", "WorkerRemoved", f"deleting {w.name}: {why.reason}")
        if d.new_failures:
            st["failures"] = status_count(self.status.get("failures")) + d.new_failures
            self.track(tracking.COUNTED, counted[-tracking.COUNTED_LIMIT:])
        if pod_failures != self.pod_failures:
            st["podFailures"] = pod_failures
        existing = {w.name for w in workers}
        for i in range(self.spec.workers.replicas):
            name = builders.worker_name(self.name, i)
            if name in existing:
                continue
            wait = self._backoff_left(backoff.get(name))
            if wait > 0:  # a failed pod's replacement waits out its back-off
                d.requeue_after = min(d.requeue_after, wait + 0.1)
                continue
            d.create_workers.append(i)
        # A merge patch: new entries are written, those whose time has passed removed (null).
        changes = {n: t for n, t in backoff.items() if old_backoff.get(n) != t}
        changes.update({n: None for n, t in backoff.items() if n in old_backoff and self._backoff_left(t) <= 0})
        if changes:
            self.track(tracking.RECREATE_AFTER, changes)
        st["replicas"] = sum(1 for w in workers if not w.deleting and w.name not in d.delete_pods)

    def _backoff_left(self, until: Any) -> float:
        at = parse_time(until)
        return 0.0 if at is None else (at - self.now).total_seconds()

    # -- planning --
    def _note_ack(self, plan: StatusPlan) -> None:
        gen = plan.generation
        entry = next((h for h in self.history if h.get("generation") == gen), None)
        if entry is None or entry.get("outcome"):
            return
        applied_at = self.ack.at or self.now
        created = plan.created_at or applied_at
        seconds = max(0.0, (applied_at - created).total_seconds())
        entry.update(appliedAt=iso(applied_at), seconds=round(seconds, 3), outcome="Applied")
        self.d.applied = (gen, seconds)
        what = f"{plan.config} on {plan.world_size} GPUs" if plan.members else "stopped"
        self.event("Normal", "Reconfigured", f"generation {gen} applied: {what} ({seconds:.1f}s after the plan)")

    def _note_abort(self, plan: StatusPlan) -> None:
        entry = next((h for h in self.history if h.get("generation") == plan.generation), None)
        if entry is not None and entry.get("outcome") != "Aborted":
            entry.update(outcome="Aborted", abortedAt=iso(self.now))
            self.event("Warning", "ReconfigurationAborted", f"generation {plan.generation} aborted by the "
                       f"runtime: {self.abort.reason or 'no reason'}")

    def _abort_backoff_over(self, gen: int) -> bool:
        entry = next((h for h in self.history if h.get("generation") == gen), None)
        since = parse_time((entry or {}).get("abortedAt")) or self.now
        left = ABORT_RETRY_SECONDS - (self.now - since).total_seconds()
        if left > 0:
            self.d.requeue_after = min(self.d.requeue_after, left + 0.1)
            return False
        return True

    # -- time --
    def _waited(self, seconds: float) -> bool:
        created = parse_time(self.meta.get("creationTimestamp"))
        if created is None:
            return True
        left = seconds - (self.now - created).total_seconds()
        if left > 0:
            self.d.requeue_after = min(self.d.requeue_after, left + 0.1)
        return left <= 0

    def _cooldown_left(self, plan: StatusPlan | None, seconds: float) -> float:
        created = plan.created_at if plan else None
        if created is None:
            return 0.0
        return seconds - (self.now - created).total_seconds()

    # -- phase 6: status --
    def _conditions(self, plan: StatusPlan | None, members: list[str], acked: bool, applied: int,
                    desired: int) -> None:
        st = self.d.status
        stopped = plan is not None and not members
        if st.get("phase") == JobPhase.SUSPENDED or stopped:
            why = (plan.reason if plan else "") or st.get("message") or "no feasible plan"
            st["phase"] = JobPhase.SUSPENDED
            st["message"] = why
            kind = "BelowMinWorkers" if "fewer than workers.min" in why else "NoFeasiblePlan"
            self.cond(ConditionType.SUSPENDED, True, kind, why)
        else:
            self.cond(ConditionType.SUSPENDED, False, "Planned" if plan else "Waiting", "")
        if "phase" not in st:
            if not acked:
                st["phase"] = JobPhase.PENDING if applied == 0 else "Reconfiguring"
            else:
                st["phase"] = JobPhase.RUNNING
            st["message"] = plan.reason if plan else ""
        running = st["phase"] == "Running"
        pending = plan is not None and not acked
        self.cond(ConditionType.READY, running, st["phase"], st.get("message", ""))
        self.cond(ConditionType.RECONFIGURING, pending, "PlanPending" if pending else "Idle",
                  f"waiting for the runtime to apply generation {plan.generation}" if pending else "")
        degraded, reason, message = False, "AsDesired", ""
        if pending and plan.deadline and self.now > plan.deadline:
            degraded, reason = True, "AckDeadlineExceeded"
            message = f"generation {plan.generation} not applied by its deadline {iso(plan.deadline)}"
        elif pending and self.abort.generation >= plan.generation:
            degraded, reason = True, "ReconfigurationAborted"
            message = self.abort.reason or "the runtime aborted the reconfiguration"
        elif running and len(members) < desired:
            ready = sum(1 for w in getattr(self, "by_name", {}).values() if w.running and self._leaving(w) is None)
            if ready >= desired and plan is not None:
                # every desired pod runs: the planner left some standing by (the plan says why)
                reason = "StandbyByChoice"
                why = next((line for line in plan.explanation if "standby" in line), "")
                message = (f"training on {len(members)} of {desired} worker pods, the others stand by"
                           + (f": {why}" if why else ""))
            else:
                degraded, reason = True, "BelowDesiredSize"
                message = f"training on {len(members)} of {desired} desired worker pods ({ready} running)"
        self.cond(ConditionType.DEGRADED, degraded, reason, message)
        failed = condition(self.conditions, ConditionType.FAILED)
        if failed is not None and failed.get("status") != "False":  # resumed: maxPodFailures raised, spec edited
            self.cond(ConditionType.FAILED, False, self.resume_reason, "")


__all__ = ["Decision", "reconcile"]
