"""The Workload builder and the reading of Kueue's admission, against Kueue's own CRD schema
(the stand-in copies in dev/localcluster/kueue/, trimmed from Kueue v0.19.2's)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from liveshard.dev.localcluster.crd_validation import CRDValidator, InvalidObject
from liveshard.operator import kueue
from liveshard.runtime.contract.jobspec import read_spec

KUEUE_CRDS = Path(__file__).parents[2] / "dev" / "localcluster" / "kueue"
NOW = "2026-03-01T12:00:00Z"


def validator(plural: str) -> CRDValidator:
    return CRDValidator(yaml.safe_load((KUEUE_CRDS / f"kueue.x-k8s.io_{plural}.yaml").read_text()))


WORKLOADS = validator("workloads")


def make_job(replicas=4, min_workers=2, labels=None, annotations=None, **spec_extra):
    spec = {"model": {"preset": "gpt-125m"}, "image": "img",
            "workers": {"min": min_workers, "max": 8, "replicas": replicas, "gpusPerWorker": 2},
            "training": {"data": {"mock": True}, "trainIters": 1000, "globalBatch": 64}, **spec_extra}
    meta = {"name": "train", "namespace": "ml", "uid": "job-uid", "generation": 1,
            "labels": {kueue.QUEUE_LABEL: "team-a", **(labels or {})}}
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob", "metadata": meta, "spec": spec}


def build(job, **kw):
    return kueue.build_workload(job, read_spec(job["spec"]), **kw)


def admit(wl, workers=None, flavor="spot"):
    wl = copy.deepcopy(wl)
    count = workers if workers is not None else kueue.podset_count(wl, kueue.PODSET_WORKERS)
    wl["status"] = {
        "admission": {"clusterQueue": "cq-a", "podSetAssignments": [
            {"name": "coordinator", "count": 1, "flavors": {"cpu": "on-demand", "memory": "on-demand"}},
            {"name": "workers", "count": count, "flavors": {"nvidia.com/gpu": flavor}}]},
        "conditions": [{"type": t, "status": "True", "reason": r, "message": "", "lastTransitionTime": NOW}
                       for t, r in (("QuotaReserved", "QuotaReserved"), ("Admitted", "Admitted"))]}
    return wl


FLAVORS = {
    "spot": {"metadata": {"name": "spot"}, "spec": {
        "nodeLabels": {"karpenter.sh/capacity-type": "spot"},
        "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]}},
    "on-demand": {"metadata": {"name": "on-demand"}, "spec": {"nodeLabels": {"karpenter.sh/capacity-type": "on-demand"}}},
}


def test_the_workload_is_owned_by_the_job_and_valid_against_kueues_schema():
    job = make_job(labels={kueue.PRIORITY_CLASS_LABEL: "high"})
    wl = build(job, priority=1000)
    assert WORKLOADS.errors(copy.deepcopy(wl)) == []
    ref, = wl["metadata"]["ownerReferences"]
    assert ref["uid"] == "job-uid" and ref["controller"] is True and ref["kind"] == "ElasticTrainingJob"
    assert wl["apiVersion"] == "kueue.x-k8s.io/v1beta2"
    assert wl["spec"]["queueName"] == "team-a"
    assert wl["spec"]["priorityClassRef"] == {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass",
                                              "name": "high"}
    assert wl["spec"]["priority"] == 1000
    coord, workers = wl["spec"]["podSets"]
    assert (coord["name"], coord["count"]) == ("coordinator", 1) and "minCount" not in coord
    assert (workers["name"], workers["count"], workers["minCount"]) == ("workers", 4, 2)
    res = workers["template"]["spec"]["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == "2"
    assert coord["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "250m"


def test_a_workload_with_every_pod_required_has_no_min_count_and_the_schema_refuses_a_bad_one():
    wl = build(make_job(replicas=2, min_workers=2))
    assert "minCount" not in wl["spec"]["podSets"][1]
    bad = copy.deepcopy(wl)
    bad["spec"]["podSets"][1]["count"] = -1
    with pytest.raises(InvalidObject, match="count"):
        WORKLOADS.validate(bad)
    bad = copy.deepcopy(wl)
    bad["spec"]["priorityClassRef"] = {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "x"}
    with pytest.raises(InvalidObject, match="priority should not be nil"):
        WORKLOADS.validate(bad)


def test_an_elastic_slice_names_the_slice_it_replaces():
    job = make_job(annotations={kueue.ELASTIC_JOB: "true"})
    wl = build(job, workers=6, slice_index=1, replaces="etj-train")
    assert WORKLOADS.errors(copy.deepcopy(wl)) == []
    assert wl["metadata"]["name"] == "etj-train-s1"
    assert "minCount" not in wl["spec"]["podSets"][1]  # Kueue: no partial admission for an elastic job
    assert wl["metadata"]["annotations"] == {kueue.ELASTIC_JOB: "true", kueue.REPLACEMENT_FOR: "ml/etj-train"}
    assert kueue.podset_count(wl, "workers") == 6


def test_admission_as_kueue_writes_it_is_valid_and_read_with_its_flavors():
    job = make_job()
    wl = admit(build(job), workers=3)
    assert WORKLOADS.errors(copy.deepcopy(wl)) == []
    a = kueue.read_admission(job, [wl], FLAVORS)
    assert a is not None and a.admitted and a.workers == 3 and a.evicted is None
    w = a.placements["workers"]
    assert w.node_selector == {"karpenter.sh/capacity-type": "spot"}
    assert w.tolerations == ({"key": "spot", "operator": "Exists", "effect": "NoSchedule"},)
    pod = kueue.place({"metadata": {}, "spec": {"tolerations": [{"key": "a"}]}}, w, gated=True)
    assert pod["spec"]["nodeSelector"] == {"karpenter.sh/capacity-type": "spot"}
    assert len(pod["spec"]["tolerations"]) == 2
    assert pod["spec"]["schedulingGates"] == [{"name": "kueue.x-k8s.io/elastic-job"}]


def test_a_job_without_a_queue_waits_for_nothing_and_one_not_admitted_says_kueues_reason():
    job = make_job()
    del job["metadata"]["labels"][kueue.QUEUE_LABEL]
    assert kueue.read_admission(job, [], FLAVORS) is None
    job = make_job()
    a = kueue.read_admission(job, [], FLAVORS)
    assert a is not None and not a.admitted and a.workload is None
    wl = build(job)
    wl["status"] = {"conditions": [{"type": "QuotaReserved", "status": "False", "reason": "WaitingForQuota",
                                    "message": "couldn't assign flavors", "lastTransitionTime": NOW}]}
    assert WORKLOADS.errors(copy.deepcopy(wl)) == []
    a = kueue.read_admission(job, [wl], FLAVORS)
    assert not a.admitted and a.waiting == ("WaitingForQuota", "couldn't assign flavors")
    other = copy.deepcopy(wl)
    other["metadata"]["ownerReferences"][0]["uid"] = "someone-else"
    assert kueue.read_admission(job, [other], FLAVORS).workload is None


def test_eviction_is_read_and_released_as_kueues_job_reconciler_does():
    job = make_job()
    wl = admit(build(job))
    wl["status"]["conditions"].append({"type": "Evicted", "status": "True", "reason": "Preempted",
                                       "message": "Preempted to accommodate a workload (UID: x)",
                                       "lastTransitionTime": NOW})
    a = kueue.read_admission(job, [wl], FLAVORS)
    assert a.admitted and a.evicted == ("Preempted", "Preempted to accommodate a workload (UID: x)")
    released = copy.deepcopy(wl)
    patch = kueue.release_patch(wl, NOW)
    released["status"]["conditions"] = patch["status"]["conditions"]
    del released["status"]["admission"]
    assert WORKLOADS.errors(copy.deepcopy(released), old=copy.deepcopy(wl)) == []
    a = kueue.read_admission(job, [released], FLAVORS)
    assert not a.admitted and a.waiting[0] == "Pending"


def test_shrinking_in_place_lowers_the_workers_count_and_the_newest_admitted_slice_runs():
    job = make_job(annotations={kueue.ELASTIC_JOB: "true"})
    old = admit(build(job))
    patch = kueue.shrink_patch(old, 1)
    assert [s["count"] for s in patch["spec"]["podSets"]] == [1, 1]
    shrunk = copy.deepcopy(old)
    shrunk["spec"].update(patch["spec"])
    assert WORKLOADS.errors(copy.deepcopy(shrunk), old=copy.deepcopy(old)) == []
    # only the count changes (Kueue's webhook keeps every other field of an admitted podSet,
    # minCount included); the admission stays as Kueue wrote it, and the quota counts the new count
    fixed = admit(build(make_job()))
    assert kueue.shrink_patch(fixed, 1)["spec"]["podSets"][1]["minCount"] == fixed["spec"]["podSets"][1]["minCount"]
    a = kueue.read_admission(job, [shrunk], FLAVORS)
    assert a.workers == 4 and a.requested == 1 and a.granted == 1
    # the stand-in, as Kueue, counts the lowered pod set's quota at its new count at once
    from liveshard.dev.localcluster.kueue_standin import KueueStandIn

    usage = KueueStandIn(None)._usage
    assert usage([old])[("spot", "nvidia.com/gpu")] == 8 and usage([shrunk])[("spot", "nvidia.com/gpu")] == 2
    new = build(job, workers=6, slice_index=1, replaces="etj-train")
    a = kueue.read_admission(job, [old, new], FLAVORS)
    assert a.workload_name == "etj-train" and a.pending_slice["metadata"]["name"] == "etj-train-s1"
    new = admit(new)
    a = kueue.read_admission(job, [old, new], FLAVORS)
    assert a.workload_name == "etj-train-s1" and a.workers == 6 and a.pending_slice is None


def test_queued_job_answers_kueues_generic_job_questions():
    job = make_job()
    spec = read_spec(job["spec"])
    waiting = kueue.QueuedJob(job, spec, admission=kueue.read_admission(job, [], FLAVORS))
    assert waiting.is_suspended() and waiting.finished() == ("", False, False)
    assert [s["name"] for s in waiting.pod_sets()] == ["coordinator", "workers"]
    a = kueue.read_admission(job, [admit(build(job), workers=2)], FLAVORS)
    running = kueue.QueuedJob(job, spec, [{"metadata": {"labels": {"liveshard.io/role": "worker"}},
                                           "status": {"phase": "Running"}}] * 2, a)
    assert not running.is_suspended() and running.pods_ready()
    assert running.pod_placement("worker").node_selector == {"karpenter.sh/capacity-type": "spot"}
    assert running.restore_pod_sets_info() and running.pod_placement("worker") == kueue.Placement()


@pytest.mark.parametrize(("labels", "spec_extra", "why"), [
    ({kueue.QUEUE_LABEL: "Team_A"}, {}, "cannot name a LocalQueue"),
    ({kueue.PRIORITY_CLASS_LABEL: "very_high"}, {}, "cannot name a WorkloadPriorityClass"),
    ({}, {"template": {"resources": {"requests": {"memory": "lots"}}}}, "is not a resource quantity"),
])
def test_the_webhook_refuses_a_queued_job_that_cannot_be_a_workload(labels, spec_extra, why):
    from liveshard.operator.admission import review
    from liveshard.operator.policy import JobPolicy

    job = make_job(labels=labels, **spec_extra)
    request = {"request": {"uid": "u", "operation": "CREATE", "object": job}}
    response = review(request, JobPolicy())["response"]
    assert not response["allowed"] and why in response["status"]["message"]
    del job["metadata"]["labels"][kueue.QUEUE_LABEL]  # without a queue: not Kueue's to admit
    job["metadata"]["labels"].pop(kueue.PRIORITY_CLASS_LABEL, None)
    if not spec_extra:
        assert review(request, JobPolicy())["response"]["allowed"]
