"""Kueue: a job behind a queue is a Kueue ``Workload`` that the operator owns itself. Pure.

A job labelled ``kueue.x-k8s.io/queue-name`` (as Kueue's own integrations are) is admitted by
Kueue before it runs. The operator is Kueue's integration for ``ElasticTrainingJob`` the way an
external framework is: it creates one ``Workload`` per job (owned by the job, ``controller:
true``), reads its admission, and plays the part of Kueue's Go job reconciler for it (what
``jobframework.GenericJob`` spells: ``IsSuspended``/``Suspend``, ``PodSets``,
``RunWithPodSetsInfo``, ``RestorePodSetsInfo``, ``Finished``, ``PodsReady``; ``QueuedJob`` here).

This module holds the names Kueue uses (from Kueue v0.19's ``pkg/controller/constants``,
``apis/kueue/v1beta2`` and ``pkg/workloadslicing``), the ``Workload`` builder, and the reading of
a Workload's admission into an ``Admission`` (one more input of ``reconcile``'s observation).

Elastic jobs (annotation ``kueue.x-k8s.io/elastic-job: "true"``, Kueue's
``ElasticJobsViaWorkloadSlices``): to grow, a new Workload slice annotated
``kueue.x-k8s.io/workload-slice-replacement-for: <ns>/<old>`` is created with the larger count;
once Kueue admits it, it replaces the old one (marked ``Finished`` with reason
``WorkloadSliceReplaced``). To shrink, ``podSets[].count`` of the admitted Workload is lowered
in place (only the count: Kueue's webhook lets it go down and nothing else change). New pods
wait behind the scheduling gate ``kueue.x-k8s.io/elastic-job`` until the slice that counts them
is admitted; then the operator removes it (``ungate_patch``), as Kueue's ``ElasticJobUngater``
does for Kueue's own jobs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from liveshard.operator import builders
from liveshard.runtime.contract.crd import LABEL_INDEX, LABEL_ROLE, ROLE_WORKER
from liveshard.runtime.contract.jobspec import JobSpec

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"  # the version Kueue stores (v0.19)
API_VERSION = f"{GROUP}/{VERSION}"
WORKLOADS = "workloads"
RESOURCE_FLAVORS = "resourceflavors"
WORKLOAD_PRIORITY_CLASSES = "workloadpriorityclasses"

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"  # pkg/controller/constants.QueueLabel
PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"  # .WorkloadPriorityClassLabel
ELASTIC_JOB = "kueue.x-k8s.io/elastic-job"  # pkg/constants.ElasticJobAnnotation (value "true")
ELASTIC_GATE = "kueue.x-k8s.io/elastic-job"  # v1beta2.ElasticJobSchedulingGate
REPLACEMENT_FOR = "kueue.x-k8s.io/workload-slice-replacement-for"  # workloadslicing
PODSET_LABEL = "kueue.x-k8s.io/podset"  # pkg/constants.PodSetLabel

# Workload condition types and reasons (apis/kueue/v1beta2/workload_types.go)
QUOTA_RESERVED = "QuotaReserved"
ADMITTED = "Admitted"
EVICTED = "Evicted"
FINISHED = "Finished"
PODS_READY = "PodsReady"
SLICE_REPLACED = "WorkloadSliceReplaced"

PODSET_COORDINATOR = "coordinator"
PODSET_WORKERS = "workers"


def queue_name(job: Mapping[str, Any]) -> str | None:
    return ((job.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL) or None


def elastic(job: Mapping[str, Any]) -> bool:
    return ((job.get("metadata") or {}).get("annotations") or {}).get(ELASTIC_JOB) == "true"


def suspended(job: Mapping[str, Any]) -> bool:
    return bool((job.get("spec") or {}).get("suspend"))


def managed(job: Mapping[str, Any]) -> bool:
    """Whether the job waits for admission: it names a queue or is suspended."""
    return queue_name(job) is not None or suspended(job)


_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")  # DNS-1123 subdomain
# a resource quantity as Kueue's Workload schema requires it (podSets[].template...resources)
_QUANTITY = re.compile(r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                       r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")


def workload_problem(job: Mapping[str, Any]) -> str | None:
    """Why a job labelled with a queue cannot be a Workload Kueue accepts (one line naming the
    field and the fix), or None (also for a job without a queue)."""
    labels = (job.get("metadata") or {}).get("labels") or {}
    if QUEUE_LABEL not in labels:
        return None
    for label, what in ((QUEUE_LABEL, "a LocalQueue"), (PRIORITY_CLASS_LABEL, "a WorkloadPriorityClass")):
        value = labels.get(label)
        if value is not None and not (_NAME.match(value) and len(value) <= 253):
            return (f"metadata.labels[{label}]: {value!r} cannot name {what} (a lowercase DNS subdomain): "
                    "Kueue could never admit the job's Workload")
    spec = job.get("spec") or {}
    for where, res in (("spec.template.resources", (spec.get("template") or {}).get("resources")),
                       ("spec.coordinator.resources", (spec.get("coordinator") or {}).get("resources"))):
        for kind, values in (res or {}).items() if isinstance(res, dict) else ():
            for name, q in (values or {}).items() if isinstance(values, dict) else ():
                if not _QUANTITY.match(str(q)):
                    return (f"{where}.{kind}[{name}]: {q!r} is not a resource quantity: the job's Workload "
                            "(its pod sets' requests, what Kueue counts against the quota) would be refused")
    return None


def workload_name(job_name: str, slice_index: int = 0) -> str:
    """``etj-<job>`` for the first slice, ``etj-<job>-s<i>`` for the replacements (job names are
    at most 48 characters: a valid object name)."""
    return f"etj-{job_name}" if slice_index == 0 else f"etj-{job_name}-s{slice_index}"


def _template(pod: dict[str, Any], extra_labels: Mapping[str, str]) -> dict[str, Any]:
    """The part of a pod's spec Kueue reads: the containers' resources, where it may run."""
    spec = pod["spec"]
    out: dict[str, Any] = {"containers": [{k: c[k] for k in ("name", "image", "resources") if k in c}
                                          for c in spec["containers"]]}
    for key in ("nodeSelector", "tolerations", "priorityClassName"):
        if spec.get(key):
            out[key] = json.loads(json.dumps(spec[key]))
    return {"metadata": {"labels": {**pod["metadata"].get("labels", {}), **extra_labels}}, "spec": out}


def pod_sets(job: dict[str, Any], spec: JobSpec, workers: int) -> list[dict[str, Any]]:
    """The job's pod sets: the coordinator (one pod) and ``workers`` worker pods, at least
    ``workers.min`` of them (Kueue's partial admission: ``minCount``; not for an elastic job,
    which Kueue's Workload webhook refuses it for: it grows and shrinks by slices instead)."""
    worker = builders.worker_pod(job, spec, 0)
    worker["metadata"]["labels"].pop(LABEL_INDEX, None)
    sets = [{"name": PODSET_COORDINATOR, "count": 1,
             "template": _template(builders.coordinator_pod(job, spec), {PODSET_LABEL: PODSET_COORDINATOR})},
            {"name": PODSET_WORKERS, "count": workers,
             "template": _template(worker, {PODSET_LABEL: PODSET_WORKERS})}]
    lowest = max(1, spec.workers.min)
    if lowest < workers and not elastic(job):
        sets[1]["minCount"] = lowest
    return sets


def build_workload(job: dict[str, Any], spec: JobSpec, *, workers: int | None = None, slice_index: int = 0,
                   replaces: str | None = None, priority: int | None = None) -> dict[str, Any]:
    """The Workload for ``job`` (``workers`` pods in the workers' pod set, the desired size by
    default), owned by the job; ``replaces``: the name of the slice it replaces (elastic jobs);
    ``priority``: the value of the job's WorkloadPriorityClass (Kueue requires it with the
    class's reference)."""
    meta = job["metadata"]
    count = spec.workers.replicas if workers is None else workers
    labels = dict(builders.labels(meta["name"]))
    annotations: dict[str, str] = {}
    if elastic(job):
        annotations[ELASTIC_JOB] = "true"
    if replaces:
        annotations[REPLACEMENT_FOR] = f"{meta['namespace']}/{replaces}"
    wl_meta: dict[str, Any] = {"name": workload_name(meta["name"], slice_index), "namespace": meta["namespace"],
                               "labels": labels, "ownerReferences": [builders.owner_reference(job)]}
    if annotations:
        wl_meta["annotations"] = annotations
    wl_spec: dict[str, Any] = {"podSets": pod_sets(job, spec, count), "active": not suspended(job)}
    queue = queue_name(job)
    if queue:
        wl_spec["queueName"] = queue
    wpc = ((meta.get("labels") or {}).get(PRIORITY_CLASS_LABEL))
    if wpc:
        wl_spec["priorityClassRef"] = {"group": GROUP, "kind": "WorkloadPriorityClass", "name": wpc}
        wl_spec["priority"] = int(priority or 0)
    return {"apiVersion": API_VERSION, "kind": "Workload", "metadata": wl_meta, "spec": wl_spec}


# ---- reading a Workload -----------------------------------------------------------------------
def _cond(obj: Mapping[str, Any], ctype: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == ctype), None)


def is_true(obj: Mapping[str, Any], ctype: str) -> bool:
    c = _cond(obj, ctype)
    return bool(c and c.get("status") == "True")


def has_admission(wl: Mapping[str, Any]) -> bool:
    """Kueue's ``IsAdmitted``: ``status.admission`` set, ``QuotaReserved`` and ``Admitted`` True."""
    return bool((wl.get("status") or {}).get("admission")) and is_true(wl, QUOTA_RESERVED) and is_true(wl, ADMITTED)


def replaced(wl: Mapping[str, Any]) -> bool:
    c = _cond(wl, FINISHED)
    return bool(c and c.get("status") == "True" and c.get("reason") == SLICE_REPLACED)


def _slice_of(wl: Mapping[str, Any]) -> int:
    name = (wl.get("metadata") or {}).get("name", "")
    head, _, tail = name.rpartition("-s")
    return int(tail) if head and tail.isdigit() else 0


def podset_count(wl: Mapping[str, Any], podset: str, *, admitted: bool = False) -> int | None:
    """A pod set's count in the spec, or (``admitted``) in ``status.admission``."""
    if admitted:
        sets = ((wl.get("status") or {}).get("admission") or {}).get("podSetAssignments") or []
    else:
        sets = (wl.get("spec") or {}).get("podSets") or []
    for s in sets:
        if s.get("name") == podset:
            return int(s.get("count", 1))
    return None


@dataclass(frozen=True)
class Placement:
    """Where a pod set's pods go, from the flavors Kueue assigned (``RunWithPodSetsInfo``)."""

    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class Admission:
    """A queued job's admission as one pass reads it (``reconcile``'s input).

    ``workload``: the job's current Workload (None: not created yet); ``admitted``: it runs
    (Kueue's ``IsAdmitted``); ``workers``: how many worker pods it may run (the admitted count;
    0 while not admitted); ``evicted``: the ``Evicted`` condition's (reason, message) while True;
    ``waiting``: Kueue's (reason, message) for a Workload not admitted (its ``QuotaReserved``
    condition); ``placements``: per pod set, from the admitted flavors; ``pending_slice``: a
    replacement slice not admitted yet (elastic growth under way); ``held``: the user's
    ``spec.suspend``."""

    queue: str | None
    workload: Mapping[str, Any] | None
    admitted: bool
    workers: int
    evicted: tuple[str, str] | None = None
    waiting: tuple[str, str] = ("Pending", "")
    placements: Mapping[str, Placement] = field(default_factory=dict)
    pending_slice: Mapping[str, Any] | None = None
    held: bool = False
    elastic: bool = False
    priority: int | None = None  # the value of the job's WorkloadPriorityClass (read by the caller)

    @property
    def workload_name(self) -> str | None:
        return (self.workload or {}).get("metadata", {}).get("name")

    @property
    def requested(self) -> int | None:
        """The workers' count the current Workload asks for."""
        return podset_count(self.workload, PODSET_WORKERS) if self.workload else None

    @property
    def granted(self) -> int:
        """The worker pods the admission lets run now: the admitted count, or the Workload's
        count once lowered in place below it (Kueue counts the quota of a scaled-down podSet at
        its new count, and its elastic-job ungater lets at most that many pods run)."""
        if not self.admitted:
            return 0
        return min(self.workers, self.requested if self.requested is not None else self.workers)

    @property
    def growing_to(self) -> int | None:
        """The workers' count of a replacement slice not admitted yet (None: none pending)."""
        return podset_count(self.pending_slice, PODSET_WORKERS) if self.pending_slice else None


def _placement(assignment: Mapping[str, Any], flavors: Mapping[str, Mapping[str, Any]]) -> Placement:
    selector: dict[str, str] = {}
    tolerations: list[Mapping[str, Any]] = []
    for name in dict.fromkeys((assignment.get("flavors") or {}).values()):
        spec = (flavors.get(name) or {}).get("spec") or {}
        selector.update(spec.get("nodeLabels") or {})
        tolerations.extend(t for t in spec.get("tolerations") or [] if t not in tolerations)
    return Placement(selector, tuple(tolerations))


def read_admission(job: Mapping[str, Any], workloads: Iterable[Mapping[str, Any]],
                   flavors: Mapping[str, Mapping[str, Any]]) -> Admission | None:
    """The job's admission from its Workloads (those it owns) and the ResourceFlavors by name;
    None for a job that waits for no admission (no queue, not suspended)."""
    if not managed(job):
        return None
    uid = (job.get("metadata") or {}).get("uid")
    mine = [w for w in workloads if any(r.get("uid") == uid and r.get("controller")
                                        for r in (w.get("metadata") or {}).get("ownerReferences") or [])
            and not (w.get("metadata") or {}).get("deletionTimestamp") and not replaced(w)]
    mine.sort(key=_slice_of)
    admitted_wls = [w for w in mine if has_admission(w)]
    # the newest admitted slice runs; a newer one not admitted yet is a growth under way
    current = admitted_wls[-1] if admitted_wls else (mine[0] if mine else None)
    newer = [w for w in mine if current is not None and _slice_of(w) > _slice_of(current)]
    held = suspended(job)
    queue = queue_name(job)
    if current is None:
        return Admission(queue, None, False, 0, held=held, elastic=elastic(job),
                         waiting=("Suspended", "spec.suspend is true") if held else
                         ("Pending", f"waiting for a Workload in queue {queue}"))
    ev = _cond(current, EVICTED)
    evicted = (ev.get("reason") or EVICTED, ev.get("message") or "") if ev and ev.get("status") == "True" else None
    admitted = has_admission(current) and not held
    qr = _cond(current, QUOTA_RESERVED) or {}
    waiting = (qr.get("reason") or "Pending", qr.get("message") or "waiting for quota")
    if held:
        waiting = ("Suspended", "spec.suspend is true")
    placements: dict[str, Placement] = {}
    workers = 0
    if admitted:
        for a in ((current.get("status") or {}).get("admission") or {}).get("podSetAssignments") or []:
            placements[a.get("name", "")] = _placement(a, flavors)
        workers = podset_count(current, PODSET_WORKERS, admitted=True) or 0
    return Admission(queue, current, admitted, workers, evicted, waiting, placements,
                     newer[-1] if newer else None, held, elastic(job))


# ---- what the decision asks of Kueue's objects --------------------------------------------------
@dataclass
class WorkloadChange:
    """What a pass does to the job's Workloads: one to create, a count to lower in place
    (``(name, workers)``), an eviction to acknowledge once the job's pods are gone (Kueue's
    ``UnsetQuotaReservationWithCondition``: ``status.admission`` cleared, ``QuotaReserved``
    False), ``spec.active`` to follow ``spec.suspend``."""

    create: dict[str, Any] | None = None
    shrink: tuple[str, int] | None = None
    release: str | None = None
    active: tuple[str, bool] | None = None  # spec.active to write (spec.suspend edited)
    finish: str | None = None  # the job succeeded: Finished, so its quota goes back

    def __bool__(self) -> bool:
        return any(x is not None for x in (self.create, self.shrink, self.release, self.active, self.finish))


def release_patch(wl: Mapping[str, Any], now_iso: str) -> dict[str, Any]:
    """The status patch that hands an evicted Workload's quota back (what Kueue's job reconciler
    writes once the job has stopped): admission cleared, ``QuotaReserved``/``Admitted`` False
    with the eviction's message, so Kueue queues it again."""
    ev = _cond(wl, EVICTED) or {}
    message = ev.get("message") or "the job was stopped"
    gen = (wl.get("metadata") or {}).get("generation")
    conds = [dict(c) for c in (wl.get("status") or {}).get("conditions") or []
             if c.get("type") not in (QUOTA_RESERVED, ADMITTED)]
    for ctype, reason in ((QUOTA_RESERVED, "Pending"), (ADMITTED, "NoReservation")):
        c = {"type": ctype, "status": "False", "reason": reason, "message": message, "lastTransitionTime": now_iso}
        if gen is not None:
            c["observedGeneration"] = gen
        conds.append(c)
    return {"status": {"admission": None, "conditions": conds}}


def finish_patch(wl: Mapping[str, Any], now_iso: str, message: str) -> dict[str, Any]:
    """``Finished`` True (reason ``Succeeded``), as Kueue's job reconciler marks a finished job's
    Workload: Kueue stops counting its quota."""
    conds = [dict(c) for c in (wl.get("status") or {}).get("conditions") or [] if c.get("type") != FINISHED]
    conds.append({"type": FINISHED, "status": "True", "reason": "Succeeded", "message": message,
                  "lastTransitionTime": now_iso})
    return {"status": {"conditions": conds}}


def shrink_patch(wl: Mapping[str, Any], workers: int) -> dict[str, Any]:
    """Lower the workers' pod set count in place (a JSON merge patch replaces the whole list).
    Only the count changes: Kueue's Workload webhook (``validateImmutablePodSet``) lets an
    admitted Workload's ``podSets[].count`` go down and nothing else in them change (an elastic
    Workload has no ``minCount``); ``status.admission`` stays as Kueue wrote it, and Kueue counts
    the podSet's quota at the lower count from then on."""
    sets = [dict(s) for s in (wl.get("spec") or {}).get("podSets") or []]
    for s in sets:
        if s.get("name") == PODSET_WORKERS:
            s["count"] = min(int(s.get("count", 1)), workers)
    return {"spec": {"podSets": sets}}


def ungate_patch(pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The JSON patch that removes the elastic-job gate from ``pod`` (what Kueue's
    ``ElasticJobUngater`` does with ``utilpod.Ungate``), other gates kept; it fails (422) if the
    pod's gates changed since it was read."""
    gates = list((pod.get("spec") or {}).get("schedulingGates") or [])
    left = [g for g in gates if g.get("name") != ELASTIC_GATE]
    ops: list[dict[str, Any]] = [{"op": "test", "path": "/spec/schedulingGates", "value": gates}]
    ops.append({"op": "replace", "path": "/spec/schedulingGates", "value": left} if left
               else {"op": "remove", "path": "/spec/schedulingGates"})
    return ops


def gated(pod: Mapping[str, Any]) -> bool:
    """Whether ``pod`` waits behind the elastic-job scheduling gate."""
    return any(g.get("name") == ELASTIC_GATE for g in (pod.get("spec") or {}).get("schedulingGates") or [])


# ---- GenericJob ---------------------------------------------------------------------------------
class GenericJob(Protocol):
    """What Kueue's ``jobframework.GenericJob`` asks of an integration, in Python."""

    def is_suspended(self) -> bool: ...
    def suspend(self) -> None: ...
    def pod_sets(self) -> list[dict[str, Any]]: ...
    def run_with_pod_sets_info(self, info: Mapping[str, Placement]) -> None: ...
    def restore_pod_sets_info(self) -> bool: ...
    def finished(self) -> tuple[str, bool, bool]: ...
    def pods_ready(self) -> bool: ...


class QueuedJob:
    """An ``ElasticTrainingJob`` as Kueue's integration sees it: a view over the job, its spec
    and its pods (the operator's reconcile does the acting; this answers Kueue's questions).

    ``is_suspended``: it runs no pods until admitted; ``suspend``/``run_with_pod_sets_info``
    record the admission's placements that the job's pods get (``pod_placement``);
    ``restore_pod_sets_info``: forget them (an eviction); ``finished``: (message, success,
    finished) from the status; ``pods_ready``: every pod the admission counts runs."""

    def __init__(self, job: dict[str, Any], spec: JobSpec, pods: Iterable[Mapping[str, Any]] = (),
                 admission: Admission | None = None) -> None:
        self.job, self.spec, self.pods = job, spec, list(pods)
        self.admission = admission
        self.placements: dict[str, Placement] = dict(admission.placements) if admission and admission.admitted else {}

    def is_suspended(self) -> bool:
        return self.admission is not None and not self.admission.admitted

    def suspend(self) -> None:
        self.placements = {}

    def pod_sets(self) -> list[dict[str, Any]]:
        return pod_sets(self.job, self.spec, self.spec.workers.replicas)

    def run_with_pod_sets_info(self, info: Mapping[str, Placement]) -> None:
        self.placements = dict(info)

    def restore_pod_sets_info(self) -> bool:
        changed = bool(self.placements)
        self.placements = {}
        return changed

    def finished(self) -> tuple[str, bool, bool]:
        status = self.job.get("status") or {}
        phase = status.get("phase")
        if phase in ("Succeeded", "Failed"):
            return status.get("message") or phase, phase == "Succeeded", True
        return "", False, False

    def pods_ready(self) -> bool:
        running = [p for p in self.pods if (p.get("status") or {}).get("phase") == "Running"
                   and ((p.get("metadata") or {}).get("labels") or {}).get(LABEL_ROLE) == ROLE_WORKER]
        want = self.admission.workers if self.admission else self.spec.workers.replicas
        return len(running) >= want

    def pod_placement(self, role: str) -> Placement:
        return self.placements.get(PODSET_WORKERS if role == ROLE_WORKER else PODSET_COORDINATOR, Placement())


def place(pod: dict[str, Any], placement: Placement, gated: bool = False) -> dict[str, Any]:
    """``pod`` with an admission's node selector and tolerations (``RunWithPodSetsInfo``), and,
    ``gated``, behind the elastic-job scheduling gate (a pod of a slice not admitted yet)."""
    spec = pod["spec"]
    if placement.node_selector:
        spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **placement.node_selector}
    if placement.tolerations:
        have = list(spec.get("tolerations") or [])
        spec["tolerations"] = have + [dict(t) for t in placement.tolerations if t not in have]
    if gated and not any(g.get("name") == ELASTIC_GATE for g in spec.get("schedulingGates") or []):
        spec["schedulingGates"] = [*(spec.get("schedulingGates") or []), {"name": ELASTIC_GATE}]
    return pod
