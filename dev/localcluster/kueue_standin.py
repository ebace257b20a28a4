"""A STAND-IN for Kueue's scheduler, for tests and ``local-cluster up --kueue`` only.

It is not Kueue: on a real cluster install Kueue itself (docs/deploy.md). It plays the part of
Kueue's scheduler against the stand-in CRDs (``kueue/``), writing what Kueue writes
(``status.admission``, the ``QuotaReserved``/``Admitted``/``Evicted``/``Preempted``/``Finished``
conditions), so that the operator can be exercised without it:

* **quota** per ClusterQueue: ``resourceGroups[].flavors[].resources[].nominalQuota``; a pod set
  gets the first flavor (in the ClusterQueue's order) whose quota holds all its covered
  resources; partial admission down to ``minCount``;
* **order**: by priority, then creation (BestEffortFIFO; ``StrictFIFO`` stops at the first
  Workload that does not fit);
* **preemption** by priority within the ClusterQueue (``preemption.withinClusterQueue:
  LowerPriority``): lower-priority Workloads are evicted (``Evicted`` True, reason
  ``Preempted``) until the preemptor fits. Unlike Kueue, which preempts whole Workloads, an
  elastic victim (``kueue.x-k8s.io/elastic-job``) is first *partially* preempted: its admitted
  workers' count is lowered (down to one), which Kueue's own webhook would refuse (admission is
  immutable while set): it plays the partial preemption liveshard answers with a live shrink;
* **slice replacement** (elastic jobs): a Workload annotated
  ``kueue.x-k8s.io/workload-slice-replacement-for`` is sized against the quota without the slice
  it replaces; admitted, the old slice gets ``Finished`` (reason ``WorkloadSliceReplaced``);
* **deactivation**: an admitted Workload with ``spec.active: false`` is evicted
  (``InactiveWorkload``);
* **scale-down in place**: a podSet whose ``count`` its owner lowered below the admitted count
  counts against the quota at the new count (``status.admission`` is left as written, as Kueue's
  webhook keeps it), so the quota it gave back admits the next Workload at once.

An evicted Workload keeps its quota until its owner releases it (clears ``status.admission``), as
with Kueue.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from liveshard.operator import kueue

Usage = dict[tuple[str, str], float]  # (flavor, resource) -> amount


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


_SUFFIX = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def _quantity(value: Any) -> float:
    """A Kubernetes quantity (``250m``, ``1Gi``, ``2``) as a number."""
    text = str(value).strip()
    for suffix in sorted(_SUFFIX, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * _SUFFIX[suffix]
    return float(text)


def pod_requests(template: dict[str, Any]) -> dict[str, float]:
    """One pod's requests (a limit stands for a missing request, as the API server defaults it)."""
    out: dict[str, float] = {}
    for c in (template.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        for name, q in merged.items():
            out[name] = out.get(name, 0.0) + _quantity(q)
    return out


def _set_cond(wl: dict[str, Any], ctype: str, status: bool, reason: str, message: str) -> None:
    conds = wl.setdefault("status", {}).setdefault("conditions", [])
    new = {"type": ctype, "status": "True" if status else "False", "reason": reason, "message": message,
           "lastTransitionTime": _now()}
    for i, c in enumerate(conds):
        if c.get("type") == ctype:
            if (c.get("status"), c.get("reason"), c.get("message")) != (new["status"], reason, message):
                conds[i] = new
            return
    conds.append(new)


def _key(wl: dict[str, Any]) -> str:
    return f"{wl['metadata']['namespace']}/{wl['metadata']['name']}"


@dataclass
class ClusterQueue:
    name: str
    flavors: list[tuple[str, set[str], dict[str, float]]]  # (flavor, covered resources, nominal quota)
    preempt: bool
    strict: bool
    namespaces: set[str] = field(default_factory=set)

    @classmethod
    def read(cls, obj: dict[str, Any]) -> ClusterQueue:
        spec = obj.get("spec") or {}
        flavors = []
        for group in spec.get("resourceGroups") or []:
            covered = set(group.get("coveredResources") or [])
            for f in group.get("flavors") or []:
                quota = {r["name"]: _quantity(r.get("nominalQuota", 0)) for r in f.get("resources") or []}
                flavors.append((f["name"], covered, quota))
        return cls(obj["metadata"]["name"], flavors,
                   (spec.get("preemption") or {}).get("withinClusterQueue") in ("LowerPriority",
                                                                                 "LowerOrNewerEqualPriority"),
                   spec.get("queueingStrategy") == "StrictFIFO")


class KueueStandIn:
    """One ``step()`` is one scheduling pass over every Workload; ``start()`` runs it in a thread."""

    def __init__(self, custom: Any, interval: float = 0.2) -> None:
        self.custom = custom
        self.interval = interval
        self.log: list[str] = []  # what it did, for reports and tests
        self._written: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the API ----------------------------------------------------------------------------------
    def _list(self, plural: str) -> list[dict[str, Any]]:
        return list(self.custom.list_cluster_custom_object(kueue.GROUP, kueue.VERSION, plural).get("items") or [])

    def _write_status(self, wl: dict[str, Any]) -> None:
        status = {"admission": wl["status"].get("admission"), "conditions": wl["status"]["conditions"]}
        if self._written.get(_key(wl)) == (wl["metadata"].get("resourceVersion"), status):
            return  # nothing new since this pass last wrote it
        self._written[_key(wl)] = (wl["metadata"].get("resourceVersion"), status)
        self.custom.patch_namespaced_custom_object_status(
            kueue.GROUP, kueue.VERSION, wl["metadata"]["namespace"], kueue.WORKLOADS, wl["metadata"]["name"],
            {"status": status})

    # -- a pass -----------------------------------------------------------------------------------
    def step(self) -> None:
        cqs = {o["metadata"]["name"]: ClusterQueue.read(o) for o in self._list("clusterqueues")}
        lqs = {f"{o['metadata']['namespace']}/{o['metadata']['name']}": (o.get("spec") or {}).get("clusterQueue")
               for o in self._list("localqueues")}
        wls = [w for w in self._list(kueue.WORKLOADS) if not kueue.is_true(w, kueue.FINISHED)]
        by_key = {_key(w): w for w in wls}
        for wl in wls:  # deactivated: evicted
            if (wl.get("spec") or {}).get("active") is False and kueue.has_admission(wl) \
                    and not kueue.is_true(wl, kueue.EVICTED):
                _set_cond(wl, kueue.EVICTED, True, "InactiveWorkload", "The workload is deactivated")
                self._write_status(wl)
                self.log.append(f"evicted {_key(wl)}: deactivated")
        pending = [w for w in wls if not kueue.has_admission(w) and (w.get("spec") or {}).get("active", True)]
        pending.sort(key=lambda w: (-int((w.get("spec") or {}).get("priority") or 0),
                                    w["metadata"].get("creationTimestamp") or ""))
        blocked: set[str] = set()
        for wl in pending:
            cq_name = lqs.get(f"{wl['metadata']['namespace']}/{(wl.get('spec') or {}).get('queueName')}")
            cq = cqs.get(cq_name or "")
            if cq is None:
                _set_cond(wl, kueue.QUOTA_RESERVED, False, "Inadmissible",
                          f"LocalQueue {(wl.get('spec') or {}).get('queueName')} doesn't exist or has no ClusterQueue")
                self._write_status(wl)
                continue
            if cq.name in blocked:
                continue
            replaces = (wl["metadata"].get("annotations") or {}).get(kueue.REPLACEMENT_FOR)
            old = by_key.get(replaces or "")
            admitted = [w for w in wls if kueue.has_admission(w)
                        and (w["status"]["admission"].get("clusterQueue") == cq.name) and w is not old]
            used = self._usage(admitted)
            fit = self._fit(wl, cq, used, partial=False)
            if fit is None and cq.preempt and self._preempt(wl, cq, admitted):
                continue  # admitted on a later pass, once the victims' quota is back
            fit = fit or self._fit(wl, cq, used)
            if fit is None:
                _set_cond(wl, kueue.QUOTA_RESERVED, False, "WaitingForQuota",
                          f"couldn't assign flavors to pod sets: insufficient unused quota in ClusterQueue {cq.name}")
                self._write_status(wl)
                if cq.strict:
                    blocked.add(cq.name)
                continue
            self._admit(wl, cq, fit)
            if old is not None:
                _set_cond(old, kueue.FINISHED, True, kueue.SLICE_REPLACED, f"Replaced by workload slice {_key(wl)}")
                self._write_status(old)
                self.log.append(f"replaced {_key(old)} by {_key(wl)}")
            wls = [w for w in wls if w is not old]

    def _usage(self, admitted: list[dict[str, Any]]) -> Usage:
        used: Usage = {}
        for w in admitted:
            sets = {s["name"]: s for s in (w.get("spec") or {}).get("podSets") or []}
            for a in w["status"]["admission"].get("podSetAssignments") or []:
                ps = sets.get(a["name"], {})
                per_pod = pod_requests(ps.get("template") or {})
                # a podSet scaled down in place counts at its new count (Kueue's
                # totalRequestsFromAdmission): the quota it no longer asks for is free at once
                count = min(int(a.get("count", 1)), int(ps.get("count", 1)))
                for res, flavor in (a.get("flavors") or {}).items():
                    used[(flavor, res)] = used.get((flavor, res), 0.0) + per_pod.get(res, 0.0) * count
        return used

    def _fit(self, wl: dict[str, Any], cq: ClusterQueue, used: Usage, partial: bool = True
             ) -> list[dict[str, Any]] | None:
        """Pod set assignments that fit the quota left, each pod set at its count or (``partial``,
        as Kueue's partial admission, tried after preemption) down to its minCount at the most
        that fits; None if one does not fit at all."""
        used = dict(used)
        out = []
        for ps in (wl.get("spec") or {}).get("podSets") or []:
            per_pod = pod_requests(ps.get("template") or {})
            count = int(ps.get("count", 1))
            lowest = int(ps.get("minCount") or count) if partial else count
            placed = None
            for n in range(count, lowest - 1, -1):
                for flavor, covered, quota in cq.flavors:
                    wanted = {r: q for r, q in per_pod.items() if r in covered}
                    if wanted and all(used.get((flavor, r), 0.0) + q * n <= quota.get(r, 0.0) + 1e-9
                                      for r, q in wanted.items()):
                        placed = (n, flavor, wanted)
                        break
                if placed:
                    break
            if placed is None:
                return None
            n, flavor, wanted = placed
            for r, q in wanted.items():
                used[(flavor, r)] = used.get((flavor, r), 0.0) + q * n
            out.append({"name": ps["name"], "count": n, "flavors": {r: flavor for r in wanted},
                        "resourceUsage": {r: _fmt(q * n) for r, q in wanted.items()}})
        return out

    def _preempt(self, wl: dict[str, Any], cq: ClusterQueue, admitted: list[dict[str, Any]]) -> bool:
        """Make room for all of ``wl`` by evicting (or, elastic, shrinking) lower-priority
        Workloads: False if even all of them would not make room (nothing is preempted)."""
        prio = int((wl.get("spec") or {}).get("priority") or 0)
        victims = sorted((w for w in admitted if int((w.get("spec") or {}).get("priority") or 0) < prio
                          and not kueue.is_true(w, kueue.EVICTED)),
                         key=lambda w: (int((w.get("spec") or {}).get("priority") or 0),
                                        "" if not w["metadata"].get("creationTimestamp") else
                                        w["metadata"]["creationTimestamp"]), reverse=False)
        others = [w for w in admitted if w not in victims]
        if not victims or self._fit(wl, cq, self._usage(others), partial=False) is None:
            return False
        remaining = list(admitted)
        for victim in victims:
            if self._fit(wl, cq, self._usage([w for w in remaining if not kueue.is_true(w, kueue.EVICTED)]),
                         partial=False):
                break
            if self._shrink_victim(wl, cq, victim, remaining):
                continue
            _set_cond(victim, kueue.EVICTED, True, "Preempted",
                      f"Preempted to accommodate a workload (UID: {wl['metadata'].get('uid')}) due to "
                      "prioritization in the ClusterQueue")
            _set_cond(victim, "Preempted", True, "InClusterQueue", "Preempted by a higher-priority workload")
            self._write_status(victim)
            self.log.append(f"evicted {_key(victim)} for {_key(wl)}")
        _set_cond(wl, kueue.QUOTA_RESERVED, False, "WaitingForPreemptedWorkloads",
                  "waiting for preempted workloads to release their quota")
        self._write_status(wl)
        return True

    def _shrink_victim(self, wl: dict[str, Any], cq: ClusterQueue, victim: dict[str, Any],
                       remaining: list[dict[str, Any]]) -> bool:
        """An elastic victim above its minCount: its admitted workers lowered just enough."""
        if not kueue.elastic(victim):
            return False
        sets = {s["name"]: s for s in victim["spec"]["podSets"]}
        workers = sets.get(kueue.PODSET_WORKERS)
        assignment = next((a for a in victim["status"]["admission"]["podSetAssignments"]
                           if a["name"] == kueue.PODSET_WORKERS), None)
        if workers is None or assignment is None:
            return False
        lowest = 1  # an elastic Workload has no minCount: it may run on one worker
        per_pod = pod_requests(workers.get("template") or {})
        for n in range(int(assignment["count"]) - 1, lowest - 1, -1):
            assignment["count"] = n
            assignment["resourceUsage"] = {r: _fmt(per_pod.get(r, 0.0) * n) for r in assignment.get("flavors") or {}}
            if self._fit(wl, cq, self._usage([w for w in remaining if not kueue.is_true(w, kueue.EVICTED)]),
                         partial=False):
                self._write_status(victim)
                self.log.append(f"shrank {_key(victim)} to {n} workers for {_key(wl)}")
                return True
        return False

    def _admit(self, wl: dict[str, Any], cq: ClusterQueue, assignments: list[dict[str, Any]]) -> None:
        wl.setdefault("status", {})["admission"] = {"clusterQueue": cq.name, "podSetAssignments": assignments}
        msg = f"Quota reserved in ClusterQueue {cq.name}"
        _set_cond(wl, kueue.QUOTA_RESERVED, True, "QuotaReserved", msg)
        _set_cond(wl, kueue.ADMITTED, True, "Admitted", "The workload is admitted")
        for ctype in (kueue.EVICTED, "Preempted"):
            if kueue.is_true(wl, ctype):
                _set_cond(wl, ctype, False, "QuotaReserved", "Previously: evicted; quota reserved again")
        self._write_status(wl)
        counts = ", ".join(f"{a['name']}={a['count']}" for a in assignments)
        self.log.append(f"admitted {_key(wl)} in {cq.name} ({counts})")

    # -- in a thread --------------------------------------------------------------------------------
    def start(self) -> KueueStandIn:
        self._thread = threading.Thread(target=self._run, name="kueue-standin", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.step()
            except Exception as e:  # a write raced another writer: the next pass reads again
                self.log.append(f"pass failed: {type(e).__name__}: {e}")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


CRD_DIR = Path(__file__).resolve().parent / "kueue"


def crd_paths() -> list[Path]:
    """The stand-in copies of Kueue's CRDs (Workload, ClusterQueue, LocalQueue, ResourceFlavor,
    WorkloadPriorityClass)."""
    return sorted(CRD_DIR.glob("kueue.x-k8s.io_*.yaml"))


def local_queues(custom: Any, gpus: int, namespace: str = "default") -> None:
    """The local cluster's queues: a ``spot`` flavor (its GPU nodes) with ``gpus`` GPUs of quota,
    an ``on-demand`` flavor (``control-0``: the coordinators' CPU and memory), one ClusterQueue
    ``local`` preempting by priority, a LocalQueue ``default`` and two WorkloadPriorityClasses
    (``low`` 10, ``high`` 1000)."""
    def create(plural: str, body: dict[str, Any], ns: str | None = None) -> None:
        body = {"apiVersion": f"{kueue.GROUP}/{kueue.VERSION}", **body}
        if ns:
            custom.create_namespaced_custom_object(kueue.GROUP, kueue.VERSION, ns, plural, body)
        else:
            custom.create_cluster_custom_object(kueue.GROUP, kueue.VERSION, plural, body)

    create("resourceflavors", {"kind": "ResourceFlavor", "metadata": {"name": "spot"},
                               "spec": {"nodeLabels": {"karpenter.sh/capacity-type": "spot"}}})
    create("resourceflavors", {"kind": "ResourceFlavor", "metadata": {"name": "on-demand"},
                               "spec": {"nodeLabels": {"karpenter.sh/capacity-type": "on-demand"}}})
    create("clusterqueues", {"kind": "ClusterQueue", "metadata": {"name": "local"}, "spec": {
        "namespaceSelector": {}, "preemption": {"withinClusterQueue": "LowerPriority"},
        "resourceGroups": [
            {"coveredResources": ["nvidia.com/gpu"], "flavors": [
                {"name": "spot", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": gpus}]}]},
            {"coveredResources": ["cpu", "memory"], "flavors": [
                {"name": "on-demand", "resources": [{"name": "cpu", "nominalQuota": 64},
                                                    {"name": "memory", "nominalQuota": "256Gi"}]}]}]}})
    create("localqueues", {"kind": "LocalQueue", "metadata": {"name": "default", "namespace": namespace},
                           "spec": {"clusterQueue": "local"}}, namespace)
    for name, value in (("low", 10), ("high", 1000)):
        create("workloadpriorityclasses", {"kind": "WorkloadPriorityClass", "metadata": {"name": name},
                                           "value": value})
