"""The operator's decision for a job behind a Kueue queue: admission as one more input of the
pure reconcile (no cluster)."""

from __future__ import annotations

import copy
from datetime import timedelta

from test_kueue_workload import FLAVORS, NOW, admit
from test_operator_reconcile import SPOT, T0, ack, coordinator, healthy, make_job, make_pod, step

from liveshard.operator import kueue, signals
from liveshard.operator.conditions import condition
from liveshard.runtime.contract.jobspec import read_spec


def queued_job(replicas=4, elastic=False, **kw):
    job = make_job(min_workers=1, max_workers=8, **kw)
    job["spec"]["workers"]["replicas"] = replicas
    job["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team-a"}
    if elastic:
        job["metadata"]["annotations"] = {kueue.ELASTIC_JOB: "true"}
    return job


def workload(job, workers=None):
    return kueue.build_workload(job, read_spec(job["spec"]), workers=workers)


def admission(job, *wls):
    return kueue.read_admission(job, list(wls), FLAVORS)


def evict(wl, reason="Preempted", message="Preempted to accommodate a workload (UID: w2) due to prioritization"):
    wl = copy.deepcopy(wl)
    wl["status"]["conditions"].append({"type": "Evicted", "status": "True", "reason": reason, "message": message,
                                       "lastTransitionTime": NOW})
    return wl


def cond_of(job, ctype):
    return condition(job["status"]["conditions"], ctype)


def test_a_queued_job_creates_its_workload_and_no_pod_until_admitted():
    job = queued_job()
    d, job = step(job, [], {}, admission=admission(job))
    assert d.workload.create is not None and d.workload.create["spec"]["queueName"] == "team-a"
    assert d.create_workers == [] and not d.create_coordinator
    assert job["status"]["phase"] == "Suspended"
    wl = workload(job)
    wl["status"] = {"conditions": [{"type": "QuotaReserved", "status": "False", "reason": "WaitingForQuota",
                                    "message": "insufficient quota for nvidia.com/gpu in flavor spot",
                                    "lastTransitionTime": NOW}]}
    d, job = step(job, [], {}, admission=admission(job, wl))
    assert d.workload.create is None and d.create_workers == [] and not d.create_coordinator
    assert cond_of(job, "Suspended")["reason"] == "WaitingForQuota"
    assert cond_of(job, "Queued")["status"] == "True"
    assert "insufficient quota" in job["status"]["message"]


def test_admitted_it_creates_its_pods_where_the_flavors_say_and_plans_as_any_job():
    job = queued_job()
    a = admission(job, admit(workload(job)))
    d, job = step(job, [], {}, admission=a)
    assert d.create_workers == [0, 1, 2, 3] and d.create_coordinator
    assert d.placements["workers"].node_selector == {"karpenter.sh/capacity-type": "spot"}
    assert cond_of(job, "Queued")["status"] == "False"
    pods = [make_pod(i) for i in range(4)] + [coordinator()]
    d, job = step(job, pods, healthy(4), admission=a)
    assert d.status["plan"]["members"] == [f"train-worker-{i}" for i in range(4)]


def test_a_partial_admission_creates_only_the_admitted_pods():
    job = queued_job()
    d, _ = step(job, [], {}, admission=admission(job, admit(workload(job), workers=2)))
    assert d.create_workers == [0, 1]


def test_a_job_without_a_queue_is_unchanged_and_spec_suspend_holds_one():
    job = make_job()
    d, _ = step(job, [], {})
    assert d.create_workers == [0, 1, 2, 3] and not d.workload
    job = make_job(suspend=True)
    a = kueue.read_admission(job, [], {})
    d, job = step(job, [], {}, admission=a)
    assert d.create_workers == [] and d.workload.create is None  # no queue: no Workload
    assert job["status"]["phase"] == "Suspended" and cond_of(job, "Suspended")["reason"] == "Suspended"


def running_queued(n=4, elastic=False):
    job = queued_job(replicas=n, elastic=elastic)
    wl = admit(workload(job))
    a = admission(job, wl)
    pods = [make_pod(i) for i in range(n)] + [coordinator()]
    _, job = step(job, pods, healthy(n), admission=a)
    _, job = step(ack(job), pods, healthy(n), T0 + timedelta(seconds=5), admission=a)
    assert job["status"]["phase"] == "Running"
    return job, wl, pods


def test_a_partial_preemption_is_a_live_shrink_not_a_restart():
    job, wl, pods = running_queued()
    a = admission(job, admit(wl, workers=2))
    d, job = step(job, pods, healthy(4), T0 + timedelta(seconds=10), admission=a)
    plan = d.status["plan"]
    assert plan["members"] == ["train-worker-0", "train-worker-1"] and plan["cause"] == "scale-down"
    assert "Kueue admits 2 of 4" in plan["reason"]
    assert d.delete_pods == [] and d.create_workers == []  # leavers go after the ack
    d, job = step(ack(job), pods, healthy(4), T0 + timedelta(seconds=15), admission=a)
    assert sorted(d.delete_pods) == ["train-worker-2", "train-worker-3"]


def test_an_eviction_checkpoints_stops_releases_every_pod_and_the_quota_then_resumes():
    job, wl, pods = running_queued()
    evicted = evict(wl)
    t = T0 + timedelta(seconds=10)
    d, job = step(job, pods, healthy(4), t, admission=admission(job, evicted))
    plan = d.status["plan"]
    assert plan["members"] == [] and plan["cause"] == "queue-eviction"  # the runtime checkpoints and stops
    assert d.delete_pods == [] and not d.workload.release
    assert job["status"]["phase"] == "Suspended" and cond_of(job, "Suspended")["reason"] == "Preempted"
    # acked (the checkpoint is saved): every pod goes, the coordinator too
    d, job = step(ack(job), pods, healthy(4), t + timedelta(seconds=5), admission=admission(job, evicted))
    assert sorted(d.delete_pods) == ["train-coordinator"] + [f"train-worker-{i}" for i in range(4)]
    # no pod left: the quota goes back to the queue
    d, job = step(job, [], {}, t + timedelta(seconds=10), admission=admission(job, evicted))
    assert d.workload.release == "etj-train" and d.create_workers == []
    released = copy.deepcopy(evicted)
    released["status"].update(kueue.release_patch(evicted, NOW)["status"])
    del released["status"]["admission"]
    d, job = step(job, [], {}, t + timedelta(seconds=11), admission=admission(job, released))
    assert not d.workload and d.create_workers == [] and job["status"]["phase"] == "Suspended"
    # re-admitted: pods again, and a resume from the checkpoint
    again = admit(released)
    d, job = step(job, [], {}, t + timedelta(seconds=20), admission=admission(job, again))
    assert d.create_workers == [0, 1, 2, 3] and d.create_coordinator
    d, job = step(job, pods, healthy(4), t + timedelta(seconds=30), admission=admission(job, again))
    assert d.status["plan"]["cause"] == "resume" and len(d.status["plan"]["members"]) == 4


def test_an_unanswered_eviction_releases_the_pods_after_the_grace():
    job, wl, pods = running_queued()
    t = T0 + timedelta(seconds=10)
    d, job = step(job, pods, healthy(4), t, admission=admission(job, evict(wl)))
    assert d.delete_pods == [] and d.requeue_after <= 30
    d, job = step(job, pods, healthy(4), t + timedelta(seconds=121), admission=admission(job, evict(wl)))
    assert len(d.delete_pods) == 5


def test_an_elastic_job_shrinks_its_workload_in_place_and_grows_by_a_replacement_slice():
    job, wl, pods = running_queued(elastic=True)
    down = copy.deepcopy(job)
    down["spec"]["workers"]["replicas"] = 2
    down["metadata"]["generation"] = 2
    d, _ = step(down, pods, healthy(4), T0 + timedelta(seconds=10), admission=admission(down, wl))
    assert d.workload.shrink == ("etj-train", 2)
    up = copy.deepcopy(job)
    up["spec"]["workers"]["replicas"] = 6
    up["metadata"]["generation"] = 2
    d, _ = step(up, pods, healthy(4), T0 + timedelta(seconds=10), admission=admission(up, wl))
    new = d.workload.create
    assert new["metadata"]["name"] == "etj-train-s1" and kueue.podset_count(new, "workers") == 6
    assert new["metadata"]["annotations"][kueue.REPLACEMENT_FOR] == "ml/etj-train"
    assert d.create_workers == []  # no pod beyond what is admitted
    # the slice is pending: asked once; the growth's pods are created behind the elastic-job gate
    d, _ = step(up, pods, healthy(4), T0 + timedelta(seconds=11), admission=admission(up, wl, new))
    assert d.workload.create is None
    assert d.create_workers == [4, 5] and d.gated_workers == [4, 5]


def gated_pod(i):
    pod = make_pod(i, phase="Pending")
    pod["spec"]["schedulingGates"] = [{"name": kueue.ELASTIC_GATE}]
    return pod


def test_an_elastic_growth_waits_gated_until_its_slice_is_admitted_then_the_gates_go():
    job, wl, pods = running_queued(elastic=True)
    up = copy.deepcopy(job)
    up["spec"]["workers"]["replicas"] = 6
    up["metadata"]["generation"] = 2
    new = kueue.build_workload(up, read_spec(up["spec"]), workers=6, slice_index=1, replaces="etj-train")
    d, up = step(up, pods, healthy(4), T0 + timedelta(seconds=10), admission=admission(up, wl, new))
    assert d.gated_workers == [4, 5] and d.ungate_pods == []
    built = kueue.place(make_pod(4), kueue.Placement(), gated=True)
    assert built["spec"]["schedulingGates"] == [{"name": "kueue.x-k8s.io/elastic-job"}] and kueue.gated(built)
    # gated and pending: not leavers, not re-created, not ungated, not in a plan
    grown = [*pods, gated_pod(4), gated_pod(5)]
    d, up = step(up, grown, healthy(4), T0 + timedelta(seconds=11), admission=admission(up, wl, new))
    assert d.create_workers == [] and d.delete_pods == [] and d.ungate_pods == []
    assert "plan" not in d.status or len(d.status["plan"]["members"]) == 4
    # the slice admitted (the old one replaced): the gates go, lowest index first
    d, up = step(up, grown, healthy(4), T0 + timedelta(seconds=12), admission=admission(up, wl, admit(new)))
    assert d.ungate_pods == ["train-worker-4", "train-worker-5"] and d.create_workers == []
    # admitted for one more only: one gate goes, the other pod waits
    d, _ = step(up, grown, healthy(4), T0 + timedelta(seconds=13), admission=admission(up, admit(new, workers=5)))
    assert d.ungate_pods == ["train-worker-4"]
    # a job that is not elastic never gates its pods
    plain, wl2, pods2 = running_queued()
    d, _ = step(plain, pods2[1:], healthy(4), T0 + timedelta(seconds=10), admission=admission(plain, wl2))
    assert d.create_workers == [0] and d.gated_workers == []


def test_a_node_leaving_an_elastic_job_lowers_its_workload_in_place_once_the_leave_is_acked():
    job, wl, pods = running_queued(elastic=True)
    t = T0 + timedelta(seconds=10)
    gone = healthy(4)  # node-1 has a spot notice
    gone["node-1"] = signals.classify_node({"metadata": {"name": "node-1"}, "spec": {"taints": [SPOT]}}, t)
    d, job = step(job, pods, gone, t, admission=admission(job, wl))
    assert d.status["plan"]["members"] == ["train-worker-0", "train-worker-2", "train-worker-3"]
    assert not d.workload.shrink  # until the runtime acks the world without it
    d, job = step(ack(job), pods, gone, t + timedelta(seconds=5), admission=admission(job, wl))
    assert d.delete_pods == ["train-worker-1"] and d.workload.shrink == ("etj-train", 3)
    assert any(r == "WorkloadShrunk" and "train-worker-1 left" in m for _, r, m in d.events)
    # lowered (the admission as Kueue wrote it): the pod that replaces it waits gated, and a
    # replacement slice asks for the quota back
    shrunk = copy.deepcopy(wl)
    shrunk["spec"].update(kueue.shrink_patch(wl, 3)["spec"])
    rest = [p for p in pods if p["metadata"]["name"] != "train-worker-1"]
    d, job = step(job, rest, gone, t + timedelta(seconds=6), admission=admission(job, shrunk))
    assert d.create_workers == [1] and d.gated_workers == [1] and d.workload.shrink is None
    assert kueue.podset_count(d.workload.create, "workers") == 4
    # a job that is not elastic keeps its Workload as admitted
    plain, wl2, pods2 = running_queued()
    d, plain = step(plain, pods2, gone, t, admission=admission(plain, wl2))
    d, _ = step(ack(plain), pods2, gone, t + timedelta(seconds=5), admission=admission(plain, wl2))
    assert d.delete_pods == ["train-worker-1"] and not d.workload.shrink


def test_an_elastic_job_admitted_fewer_gives_the_rest_back_then_asks_for_a_slice():
    job, wl, pods = running_queued(elastic=True)
    partial = admit(wl, workers=2)
    d, job = step(job, pods, healthy(4), T0 + timedelta(seconds=10), admission=admission(job, partial))
    assert d.workload.shrink == ("etj-train", 2) and d.status["plan"]["members"] == ["train-worker-0",
                                                                                    "train-worker-1"]
    shrunk = copy.deepcopy(partial)
    shrunk["spec"].update(kueue.shrink_patch(partial, 2)["spec"])
    d, job = step(ack(job), pods, healthy(4), T0 + timedelta(seconds=15), admission=admission(job, shrunk))
    assert d.workload.create["metadata"]["annotations"][kueue.REPLACEMENT_FOR] == "ml/etj-train"
    assert kueue.podset_count(d.workload.create, "workers") == 4


def test_a_succeeded_job_marks_its_workload_finished():
    job, wl, pods = running_queued()
    job["status"].update(finishedAt="2026-03-01T12:10:00Z", finishedStep=1000, finalCheckpoint="/ckpt/step-1000")
    d, _ = step(job, pods, healthy(4), T0 + timedelta(seconds=20), admission=admission(job, wl))
    assert d.workload.finish == "etj-train"
    done = copy.deepcopy(wl)
    done["status"].update(kueue.finish_patch(wl, NOW, "the job succeeded")["status"])
    assert kueue.is_true(done, "Finished")
    d, _ = step(job, pods, healthy(4), T0 + timedelta(seconds=21), admission=admission(job, done))
    assert d.workload.finish is None
