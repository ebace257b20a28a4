"""What one reconcile pass reads and what it builds: the ``Observation`` (frozen, read once at
the start) and the ``Outputs`` (the ``Decision`` being built, with the conditions and history it
writes). The phases in ``reconcile``, ``planning`` and ``endings`` are functions of the two.
Pure."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from liveshard.operator import tracking
from liveshard.operator.conditions import condition, set_condition
from liveshard.operator.kueue import Admission, Placement, WorkloadChange
from liveshard.operator.observed import Worker, observe_workers
from liveshard.operator.policy import JobPolicy, refusal
from liveshard.operator.signals import Signal
from liveshard.runtime.contract.causes import LOSSES, RUNTIME_JUDGED, Cause
from liveshard.runtime.contract.jobspec import JobSpec, read_spec
from liveshard.runtime.contract.status import (
    AdaptiveReport,
    CheckpointReport,
    CommittedWorld,
    Finished,
    InvalidStatus,
    PlanAbort,
    PlanAck,
    RuntimeFailure,
    StandbyPods,
    StatusPlan,
    Telemetry,
)
from liveshard.runtime.errors import ConfigError

IDLE_REQUEUE_SECONDS = 30.0
# conditions whose turning True is announced with a Warning event
_WARN_ON = ("Suspended", "Degraded", "CheckpointFailing", "CheckpointUnavailable")


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
    workload: WorkloadChange = field(default_factory=WorkloadChange)  # the job's Kueue Workload
    placements: dict[str, Placement] = field(default_factory=dict)  # admitted flavors, by pod set
    gated_workers: list[int] = field(default_factory=list)  # of create_workers: behind the elastic-job gate
    ungate_pods: list[str] = field(default_factory=list)  # pods whose elastic-job gate is removed (admitted)


def _generation_of(plan: Any) -> int:
    """The generation of a status plan however malformed the rest is (0 if it has none)."""
    try:
        return max(0, int(plan.get("generation") or 0))
    except (AttributeError, TypeError, ValueError):
        return 0


def status_count(value: Any) -> int:
    """A counter from the status; a malformed one reads as 0 (never raised)."""
    try:
        return max(0, int(value or 0))
    except (TypeError, ValueError):
        return 0


# the runtime's parts of the status, each read with its reader (a malformed one reads as absent)
_PARTS: dict[str, tuple[Callable[[dict[str, Any]], Any], Any]] = {
    "plan": (StatusPlan.from_status, None),
    "ack": (PlanAck.from_status, PlanAck(0)),
    "abort": (PlanAbort.from_status, PlanAbort(0)),
    "telemetry": (Telemetry.from_status, Telemetry()),
    "world": (CommittedWorld.from_status, None),
    "finished": (Finished.from_status, None),
    "failure": (RuntimeFailure.from_status, None),
    "checkpoint": (CheckpointReport.from_status, CheckpointReport()),
    "adaptive": (AdaptiveReport.from_status, AdaptiveReport()),
    "standby": (StandbyPods.from_status, StandbyPods()),
}


@dataclass(frozen=True)
class Observation:
    """Everything one pass reads, read once: the job (its metadata, raw spec and status), the
    spec as read (or why it cannot be), the runtime's status parts (a malformed one as its
    default, with the problem in ``invalid``), the operator's records (``tracking``), the worker
    pods with the signal each acts on, and the time. Nothing in it changes during the pass."""

    job: dict[str, Any]
    meta: dict[str, Any]
    name: str
    status: dict[str, Any]  # the job's status as read (a copy; never written)
    pods: list[dict[str, Any]]
    nodes: Mapping[str, Signal | None]
    node_labels: Mapping[str, Mapping[str, str]]
    now: datetime
    scale_up_checked: Hashable | None
    policy: JobPolicy
    spec: JobSpec | None  # None: ``problem`` says why
    problem: tuple[Exception, str] | None  # (what is wrong with the spec, the condition's reason)
    parts: Mapping[str, Any]  # the runtime's status parts by name (``_PARTS``)
    invalid: Mapping[str, str]  # part name -> why it was read as absent
    last_generation: int  # the newest plan generation the status had, readable or not
    tracking: Mapping[str, Any]  # the operator's records of failed pods (``tracking.tracking_of``)
    workers: tuple[Worker, ...]  # empty when the spec is unreadable or the run has finished
    by_name: Mapping[str, Worker]
    crashed: tuple[Worker, ...]  # worker pods that crashed since the last pass (not yet counted)
    pod_failures: int  # the job's pod failures counted before this pass
    admission: Admission | None = None  # Kueue's admission of a queued job (None: no queue)

    @property
    def desired(self) -> int:
        """The worker pods the job may have: ``spec.workers.replicas``, at most as many as
        Kueue admitted for a queued job."""
        assert self.spec is not None
        replicas = self.spec.workers.replicas
        return replicas if self.admission is None or not self.admission.admitted \
            else min(replicas, self.admission.workers)

    @property
    def growing_to(self) -> int:
        """The worker pods an elastic job has, gated ones included: up to the count of the
        replacement slice it waits for (its pods beyond ``desired`` wait behind the elastic-job
        gate), otherwise ``desired``."""
        desired = self.desired
        a = self.admission
        if a is None or not a.admitted or not a.elastic or a.growing_to is None:
            return desired
        assert self.spec is not None
        return max(desired, min(self.spec.workers.replicas, a.growing_to))

    @property
    def generation(self) -> Any:
        return self.meta.get("generation")

    @property
    def plan(self) -> StatusPlan | None:
        return self.parts["plan"]

    @property
    def ack(self) -> PlanAck:
        return self.parts["ack"]

    @property
    def abort(self) -> PlanAbort:
        return self.parts["abort"]

    @property
    def world(self) -> CommittedWorld | None:
        return self.parts["world"]

    @property
    def standby(self) -> StandbyPods:
        return self.parts["standby"]

    @property
    def speeds(self) -> Mapping[str, float]:
        return self.parts["telemetry"].speeds


def _read_spec(raw: Any, policy: JobPolicy) -> tuple[JobSpec | None, tuple[Exception, str] | None]:
    try:
        spec = read_spec(raw)
    except ConfigError as e:
        return None, (e, "InvalidSpec")
    problem = refusal(raw or {}, policy)
    return (None, (problem, "RefusedByOperator")) if problem is not None else (spec, None)


def observe(job: dict[str, Any], pods: list[dict[str, Any]], nodes: Mapping[str, Signal | None],
            now: datetime, node_labels: Mapping[str, Mapping[str, str]], scale_up_checked: Hashable | None,
            policy: JobPolicy, admission: Admission | None = None) -> Observation:
    """Read everything a pass decides over, once."""
    meta = job.get("metadata") or {}
    status: dict[str, Any] = dict(job.get("status") or {})
    spec, problem = _read_spec(job.get("spec"), policy)
    parts: dict[str, Any] = {}
    invalid: dict[str, str] = {}
    for part, (read, default) in _PARTS.items():
        try:  # (not read at all while the spec is unreadable: nothing is decided over them)
            parts[part] = read(status) if spec is not None else default
        except InvalidStatus as e:
            parts[part], invalid[part] = default, str(e)
    records = tracking.tracking_of(status)
    workers: tuple[Worker, ...] = ()
    if spec is not None and parts["finished"] is None:
        workers = tuple(observe_workers(pods, nodes, node_labels, spec.elasticity.act_on, now,
                                        spec.elasticity.debounce_seconds))
    counted = set(records[tracking.COUNTED])
    crashed = tuple(w for w in workers if w.dead and not w.deleting and w.signal is not None
                    and w.signal.kind == Cause.POD_FAILED and w.signal.failure and w.uid not in counted)
    plan = parts["plan"]
    return Observation(
        job=job, meta=meta, name=meta.get("name", ""), status=status, pods=pods, nodes=nodes,
        node_labels=node_labels, now=now, scale_up_checked=scale_up_checked, policy=policy, spec=spec,
        problem=problem, parts=parts, invalid=invalid,
        last_generation=plan.generation if plan else _generation_of(status.get("plan")),
        tracking=records, workers=workers, by_name={w.name: w for w in workers}, crashed=crashed,
        pod_failures=status_count(status.get("podFailures")), admission=admission)


@dataclass
class Outputs:
    """What a pass builds: the ``Decision`` (status patch, pods, events), the conditions and the
    history it writes into the status, and two notes a later phase reads."""

    decision: Decision
    conditions: list[dict[str, Any]]
    history: list[dict[str, Any]]
    config_error: dict[str, Any] | None = None  # tracking.configError as this pass leaves it
    resume_reason: str = "WithinPodFailureBudget"  # of a Failed condition cleared in this pass

    @classmethod
    def start(cls, o: Observation) -> Outputs:
        return cls(Decision(), list(o.status.get("conditions") or []),
                   [dict(h) for h in o.status.get("history") or []])

    def event(self, kind: str, reason: str, message: str) -> None:
        self.decision.events.append((kind, reason, message))

    def requeue(self, seconds: float) -> None:
        """Look again in ``seconds`` at the latest."""
        self.decision.requeue_after = min(self.decision.requeue_after, seconds)


def part(o: Observation, out: Outputs, name: str) -> Any:
    """The status part ``name``; a malformed one is reported (an event) and read as absent."""
    if name in o.invalid:
        out.event("Warning", "InvalidStatus", f"{o.invalid[name]}; ignored")
    return o.parts[name]


def track(o: Observation, out: Outputs, key: str, value: Any) -> None:
    """Write one of ``status.tracking``'s records (a merge patch: a map merges into what this
    pass already wrote, None removes), and its old field too while the status has no
    ``tracking`` (``tracking.mirror``)."""
    st = out.decision.status
    records = st.setdefault(tracking.TRACKING, {})
    if isinstance(value, dict) and isinstance(records.get(key), dict):
        records[key] = {**records[key], **value}
    else:
        records[key] = value
    if tracking.mirror(o.status):
        st[tracking.OLD_NAME[key]] = records[key]


def cond(o: Observation, out: Outputs, ctype: str, status: bool, reason: str, message: str) -> None:
    """Set condition ``ctype``; one of ``_WARN_ON`` turning True is announced."""
    old = condition(out.conditions, ctype)
    was = bool(old and old.get("status") == "True")
    out.conditions = set_condition(out.conditions, ctype, status, reason, message, o.now,
                                   observed_generation=o.generation)
    if status and not was and ctype in _WARN_ON:
        out.event("Warning", reason, message)


def why_leaving(o: Observation, w: Worker) -> Signal | None:
    """Why worker ``w`` goes away: its own signal, or a spec that has fewer replicas."""
    if w.signal is not None:
        return w.signal
    assert o.spec is not None
    desired = o.desired
    if w.index >= desired and not (w.gated and w.index < o.growing_to):  # (gated: waits for a slice)
        if desired < o.spec.workers.replicas:  # Kueue admits fewer (a partial preemption)
            return Signal(Cause.SCALE_DOWN, f"Kueue admits {desired} of {o.spec.workers.replicas} workers",
                          None, source="workload admission")
        return Signal(Cause.SCALE_DOWN, f"scaled down to {desired} workers", None, source="spec.workers.replicas")
    return None


def why_departing(o: Observation, w: Worker) -> Signal | None:
    """Why a member leaves, as far as plans go: a member on a node that stopped answering the
    API server (not-ready, unreachable) may train on, and only the runtime's liveness judge
    says it is gone (then its world without it is recorded)."""
    why = why_leaving(o, w)
    return None if why is not None and why.kind in RUNTIME_JUDGED and not w.dead else why


def is_lost(o: Observation, pod: str) -> bool:
    """A member pod gone, or going for a reason that leaves nothing to copy from it."""
    w = o.by_name.get(pod)
    why = why_leaving(o, w) if w is not None else None
    return w is None or w.dead or (why is not None and why.kind in LOSSES)
