"""Which nodes and pods are going away, by when, and why.

Pure: takes Node and Pod objects as plain dicts (as the Kubernetes API returns them) and returns a
``Signal`` or ``None``. No kopf, no kubernetes client, no clock: ``now`` is passed in.

Sources recognised (the cloud's or tool's own names, so an operator can grep for them):

* AWS Node Termination Handler taints: ``aws-node-termination-handler/spot-itn``,
  ``/rebalance-recommendation``, ``/scheduled-maintenance``, ``/asg-lifecycle-termination``.
* Karpenter: ``karpenter.sh/disrupted`` (v1) and ``karpenter.sh/disruption=disrupting`` (v0.3x);
  the deadline comes from the node's ``karpenter.sh/nodeclaim-termination-timestamp`` annotation.
* Cluster autoscaler: ``ToBeDeletedByClusterAutoscaler``.
* GKE: ``cloud.google.com/impending-node-termination`` (spot/preemptible, 30 s notice) and the
  kubelet's graceful node shutdown (Ready=False, "node is shutting down").
* AKS: node-problem-detector's ``VMEventScheduled`` condition (Preempt/Terminate/Redeploy/...),
  node auto-drain's ``remediator.kubernetes.azure.com/unschedulable`` taint.
* Kubernetes itself: cordon (``spec.unschedulable`` / ``node.kubernetes.io/unschedulable``),
  ``node.kubernetes.io/not-ready`` / ``unreachable`` (or the Ready condition), ``out-of-service``;
  pods: the ``DisruptionTarget`` condition, a deletion timestamp, phase ``Failed``.

A signal says whether it is a *failure*. Planned removals (spot reclaim, maintenance, scale-in,
cordon, eviction, deletion, graceful node shutdown) never are: only a node that stops answering
or a worker that crashes counts against the job.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from liveshard.runtime.contract.causes import ALWAYS_ACT, WITHDRAWABLE, Cause
from liveshard.runtime.contract.times import parse_time
from liveshard.runtime.errors import exit_text

# Signal kinds are ``contract.Cause`` members (also the values of spec.elasticity.actOn).

# Notice windows the clouds document, used when the object carries no explicit time.
AWS_SPOT_NOTICE = timedelta(minutes=2)
GCP_PREEMPT_NOTICE = timedelta(seconds=30)
AZURE_NOTICE = {  # Azure scheduled events: minimum notice per event type
    "Preempt": timedelta(seconds=30),
    "Terminate": timedelta(minutes=5),
    "Redeploy": timedelta(minutes=10),
}
NOT_READY_TOLERATION = timedelta(seconds=300)  # Kubernetes' default NoExecute tolerationSeconds
POD_GRACE_DEFAULT = 30


@dataclass(frozen=True)
class Signal:
    """A node or pod is going away."""

    kind: Cause
    reason: str  # one line for events and status: what was seen
    deadline: datetime | None  # when it is expected gone; None: not announced
    failure: bool = False  # counts against the job (never for planned removals)
    source: str = ""  # the taint key / condition / field that said so
    seen: datetime | None = None  # when the operator first saw it (None: act on it at once)
    exit_code: int | None = None  # a stopped pod's container: how it exited
    termination: str = ""  # ... and the one line it left (its termination message, or its log's)

    @property
    def preemption(self) -> bool:
        return not self.failure

    def seconds_left(self, now: datetime) -> float | None:
        return None if self.deadline is None else (self.deadline - now).total_seconds()

    def settling(self, now: datetime, debounce_seconds: float) -> float:
        """Seconds before a withdrawable signal counts (0: it counts now)."""
        if self.kind not in WITHDRAWABLE or self.seen is None or debounce_seconds <= 0:
            return 0.0
        return max(0.0, debounce_seconds - (now - self.seen).total_seconds())


def most_pressing(signals: list[Signal]) -> Signal | None:
    """The most pressing signal: an announced deadline beats none, earlier beats later."""
    if not signals:
        return None
    far = datetime.max.replace(tzinfo=UTC)
    return min(signals, key=lambda s: (s.deadline is None, s.deadline or far, s.failure))


# ---- nodes ------------------------------------------------------------------------------------
_NTH = "aws-node-termination-handler/"


def classify_node(node: dict[str, Any], now: datetime) -> Signal | None:
    """Is this node going away? The most pressing of everything it says, or None."""
    meta = node.get("metadata") or {}
    spec = node.get("spec") or {}
    status = node.get("status") or {}
    annotations = meta.get("annotations") or {}
    found: list[Signal] = []

    for taint in spec.get("taints") or []:
        sig = _classify_taint(taint, annotations, now)
        if sig is not None:
            found.append(sig)

    if meta.get("deletionTimestamp"):
        # The Node object itself is being deleted (Karpenter's termination finalizer drains it).
        deadline = parse_time(annotations.get("karpenter.sh/nodeclaim-termination-timestamp"))
        found.append(Signal(Cause.DISRUPTION, "node is being deleted", deadline, source="metadata.deletionTimestamp"))

    if spec.get("unschedulable") and not any(s.kind == Cause.CORDON for s in found):
        found.append(Signal(Cause.CORDON, "node cordoned (spec.unschedulable)", None, source="spec.unschedulable"))

    for cond in status.get("conditions") or []:
        sig = _classify_node_condition(cond, now)
        if sig is not None:
            found.append(sig)

    # A cordon usually accompanies a stronger signal (NTH and drains cordon too): report the
    # stronger one, and the cordon only when it is all there is.
    strong = [s for s in found if s.kind != Cause.CORDON]
    return most_pressing(strong) or most_pressing(found)


def _classify_taint(taint: dict[str, Any], annotations: dict[str, str], now: datetime) -> Signal | None:
    key = taint.get("key") or ""
    value = taint.get("value") or ""
    added = parse_time(taint.get("timeAdded")) or now
    src = f"taint {key}" + (f"={value}" if value else "") + f":{taint.get('effect', '')}"

    if key.startswith(_NTH):
        event = key[len(_NTH):]
        if event == "spot-itn":
            return Signal(Cause.SPOT_INTERRUPTION, "AWS spot interruption notice (node termination handler)",
                          added + AWS_SPOT_NOTICE, source=src)
        if event == "rebalance-recommendation":
            return Signal(Cause.REBALANCE_RECOMMENDATION, "AWS EC2 rebalance recommendation: elevated "
                          "interruption risk (node termination handler)", None, source=src)
        if event == "scheduled-maintenance":
            return Signal(Cause.SCHEDULED_MAINTENANCE, "AWS scheduled maintenance event (node termination "
                          "handler)", None, source=src)
        if event == "asg-lifecycle-termination":
            return Signal(Cause.SCALE_IN, "AWS Auto Scaling group is terminating the instance (node "
                          "termination handler)", None, source=src)
        return None
    if key == "karpenter.sh/disrupted" or (key == "karpenter.sh/disruption" and value == "disrupting"):
        deadline = parse_time(annotations.get("karpenter.sh/nodeclaim-termination-timestamp"))
        return Signal(Cause.DISRUPTION, "Karpenter is disrupting the node (consolidation, drift, expiry or "
                      "spot interruption)", deadline, source=src)
    if key == "ToBeDeletedByClusterAutoscaler":
        return Signal(Cause.SCALE_IN, "cluster autoscaler is removing the node", None, source=src)
    if key == "cloud.google.com/impending-node-termination":
        return Signal(Cause.SPOT_INTERRUPTION, "GKE node is being preempted (impending termination)",
                      added + GCP_PREEMPT_NOTICE, source=src)
    if key == "remediator.kubernetes.azure.com/unschedulable":
        return Signal(Cause.DISRUPTION, "AKS node auto-drain is draining the node for a scheduled event",
                      None, source=src)
    if key == "node.kubernetes.io/unschedulable":
        return Signal(Cause.CORDON, "node cordoned", None, source=src)
    if key == "node.kubernetes.io/out-of-service":
        return Signal(Cause.OUT_OF_SERVICE, "node marked out-of-service: its pods are being force-deleted",
                      added, source=src)
    if key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
        kind = Cause.NOT_READY if key.endswith("not-ready") else Cause.UNREACHABLE
        # Only the NoExecute taint evicts, after the default toleration; NoSchedule alone is
        # the node lifecycle controller's first step and carries no eviction time.
        deadline = added + NOT_READY_TOLERATION if taint.get("effect") == "NoExecute" else None
        return Signal(kind, f"node is {kind.replace('-', ' ')}", deadline, failure=True, source=src)
    return None


_SHUTDOWN = re.compile(r"shutting down|shutdown", re.IGNORECASE)
_AZURE_EVENT = re.compile(r"\b(preempt|terminat|redeploy|reboot|freez)", re.IGNORECASE)
_AZURE_NAMES = {"preempt": "Preempt", "terminat": "Terminate", "redeploy": "Redeploy", "reboot": "Reboot",
                "freez": "Freeze"}


def _classify_node_condition(cond: dict[str, Any], now: datetime) -> Signal | None:
    ctype = cond.get("type")
    status = cond.get("status")
    since = parse_time(cond.get("lastTransitionTime")) or now
    message = cond.get("message") or ""
    if ctype == "Ready" and status in ("False", "Unknown"):
        if _SHUTDOWN.search(message) or _SHUTDOWN.search(cond.get("reason") or ""):
            # Graceful node shutdown (GKE spot/preemptible, any kubelet with shutdownGracePeriod).
            return Signal(Cause.SPOT_INTERRUPTION, "node is shutting down (kubelet graceful node shutdown)",
                          since + GCP_PREEMPT_NOTICE, source="condition Ready")
        kind = Cause.UNREACHABLE if status == "Unknown" else Cause.NOT_READY
        return Signal(kind, f"node is {kind.replace('-', ' ')} (condition Ready={status})",
                      since + NOT_READY_TOLERATION, failure=True, source="condition Ready")
    if ctype == "VMEventScheduled" and status == "True":
        match = _AZURE_EVENT.search(message) or _AZURE_EVENT.search(cond.get("reason") or "")
        event = _AZURE_NAMES[match.group(1).lower()] if match else ""
        if event == "Preempt":
            return Signal(Cause.SPOT_INTERRUPTION, "Azure spot eviction scheduled (VMEventScheduled: Preempt)",
                          since + AZURE_NOTICE["Preempt"], source="condition VMEventScheduled")
        if event in ("Terminate", "Redeploy"):
            return Signal(Cause.SCHEDULED_MAINTENANCE, f"Azure scheduled event: {event}",
                          since + AZURE_NOTICE[event], source="condition VMEventScheduled")
        # Reboot and Freeze pause the VM briefly; the node comes back with its pods.
        return None
    return None


# ---- pods -------------------------------------------------------------------------------------
# DisruptionTarget reasons (Kubernetes >= 1.26) and pod failure reasons that mean "taken away",
# not "crashed".
_DISRUPTION_REASONS = {
    "PreemptionByScheduler": "preempted by the scheduler for a higher-priority pod",
    "DeletionByTaintManager": "evicted by the taint manager (NoExecute taint on its node)",
    "EvictionByEvictionAPI": "evicted through the Eviction API (drain)",
    "DeletionByPodGC": "deleted by pod garbage collection (its node is gone)",
    "TerminationByKubelet": "terminated by the kubelet (node pressure or node shutdown)",
}
_PLANNED_FAILURE_REASONS = {"Evicted", "Shutdown", "NodeShutdown", "Terminated", "Preempting",
                            "NodeAffinity", "OutOfnvidia.com/gpu", "UnexpectedAdmissionError"}


def classify_pod(pod: dict[str, Any], now: datetime) -> Signal | None:
    """Is this pod going away (or gone)? Failed pods are gone; the rest have a deadline."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    phase = status.get("phase")
    grace = spec.get("terminationGracePeriodSeconds")
    grace = POD_GRACE_DEFAULT if grace is None else int(grace)

    disruption = next((c for c in status.get("conditions") or []
                       if c.get("type") == "DisruptionTarget" and c.get("status") == "True"), None)

    if phase in ("Failed", "Succeeded"):
        reason = status.get("reason") or ""
        # A clean exit (a leaver after commit) or a removal the cluster made is not a crash.
        planned = phase == "Succeeded" or disruption is not None or reason in _PLANNED_FAILURE_REASONS
        code, line = container_exit(pod)
        # The kubelet says why in the pod's message only when it stopped the pod itself (an
        # eviction, a node shutdown); a container that exited says it in its own state.
        # ``exit code 2: <its error line>``, ``exit code 137 (SIGKILL)``: how it ended, in words
        exited = "" if code is None else exit_text(code) + (f": {line}" if line else "")
        text = status.get("message") or exited or reason or "no reason given"
        return Signal(Cause.POD_FAILED, f"worker pod {phase.lower()}: {text}", now,
                      failure=not planned, source=f"status.phase={phase}", exit_code=code, termination=line)
    if disruption is not None:
        reason = disruption.get("reason") or ""
        since = parse_time(disruption.get("lastTransitionTime")) or now
        deadline = parse_time(meta.get("deletionTimestamp")) or since + timedelta(seconds=grace)
        return Signal(Cause.POD_DISRUPTION, "worker pod " + _DISRUPTION_REASONS.get(reason, f"disrupted ({reason})"),
                      deadline, source=f"condition DisruptionTarget/{reason}")
    if meta.get("deletionTimestamp"):
        # The API sets deletionTimestamp to the moment the grace period ends.
        deadline = parse_time(meta["deletionTimestamp"]) or now
        return Signal(Cause.POD_DELETION, "worker pod is being deleted", deadline, source="metadata.deletionTimestamp")
    return None


# The runtime's commands report bad input as one line, ``liveshard COMMAND: error: ...``, as the
# last thing they print (runtime/cli.py); other lines (warnings, a supervisor's log) may follow
# it in a log's tail when several processes share a pod.
_ERROR_LINE = re.compile(r"^liveshard( [\w-]+)?: error: ")
TERMINATION_LINE_MAX = 500


def termination_line(message: str) -> str:
    """The one line that says why a container stopped, from its termination message: the
    runtime's own error line if there is one, else the last line (a log's tail with
    ``terminationMessagePolicy: FallbackToLogsOnError``)."""
    lines = [" ".join(line.split()) for line in (message or "").splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        return ""
    line = next((x for x in reversed(lines) if _ERROR_LINE.match(x)), lines[-1])
    return line if len(line) <= TERMINATION_LINE_MAX else line[:TERMINATION_LINE_MAX - 3] + "..."


def container_exit(pod: dict[str, Any]) -> tuple[int | None, str]:
    """How a stopped pod's container exited: (exit code, its one line), from
    ``status.containerStatuses[].state.terminated`` as the kubelet writes it; the first that
    failed, else the first that stopped; (None, "") when none says."""
    stopped = [((c.get("state") or {}).get("terminated") or {}) for c in
               (pod.get("status") or {}).get("containerStatuses") or []]
    stopped = [t for t in stopped if t.get("exitCode") is not None]
    if not stopped:
        return None, ""
    first = next((t for t in stopped if t.get("exitCode") != 0), stopped[0])
    try:
        code = int(first["exitCode"])
    except (TypeError, ValueError):
        return None, ""
    return code, termination_line(str(first.get("message") or ""))


def node_gone(node_name: str, now: datetime) -> Signal:
    return Signal(Cause.NODE_GONE, f"node {node_name} no longer exists", now, source="node deleted")


def acts_on(signal: Signal, act_on: frozenset[str] | set[str] | tuple[str, ...]) -> bool:
    """Whether a job whose policy lists ``act_on`` should move its workers off for ``signal``."""
    return signal.kind in ALWAYS_ACT or signal.kind in act_on


__all__ = [
    "Signal",
    "acts_on",
    "classify_node",
    "classify_pod",
    "container_exit",
    "most_pressing",
    "node_gone",
    "parse_time",
    "termination_line",
]
