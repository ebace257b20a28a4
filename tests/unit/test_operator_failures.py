"""Failure paths of the operator's decision: worker pods that crash (back-off, the job's budget
for them) and jobs the operator refuses (hostPath checkpoints). Pure, with the real planner."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
from test_operator_reconcile import T0, coordinator, healthy, make_job, make_pod, running_job, step

from liveshard.operator.policy import JobPolicy
from liveshard.operator.reconcile import (
    POD_BACKOFF_BASE_SECONDS,
    POD_BACKOFF_MAX_SECONDS,
    pod_backoff_seconds,
)
from liveshard.runtime.contract.times import parse_time


def crash(pods, i, uid=None):
    pods = copy.deepcopy(pods)
    pods[i]["status"] = {"phase": "Failed", "reason": "Error", "message": "exit code 1"}
    if uid:
        pods[i]["metadata"]["uid"] = uid
    return pods


def without(pods, name):
    return [p for p in pods if p["metadata"]["name"] != name]


def conditions(job):
    return {c["type"]: c for c in job["status"]["conditions"]}


def with_budget(job, limit):
    job = copy.deepcopy(job)
    job["spec"]["elasticity"]["maxPodFailures"] = limit
    return job


def test_backoff_doubles_from_ten_seconds_and_is_capped():
    assert [pod_backoff_seconds(n) for n in (1, 2, 3, 4)] == [10, 20, 40, 80]
    assert pod_backoff_seconds(50) == POD_BACKOFF_MAX_SECONDS == 300
    assert POD_BACKOFF_BASE_SECONDS == 10


def test_a_crashed_pod_is_counted_and_replaced_only_after_its_backoff():
    job, pods = running_job()
    t1 = T0 + timedelta(seconds=20)
    d, job = step(job, crash(pods, 1), healthy(4), t1)
    assert d.delete_pods == ["train-worker-1"] and job["status"]["podFailures"] == 1
    assert parse_time(job["status"]["podBackoff"]["train-worker-1"]) == t1 + timedelta(seconds=10)
    assert ("Warning", "WorkerFailed") in {(k, r) for k, r, _ in d.events}
    gone = without(pods, "train-worker-1")
    # the pod is gone: not re-created during the back-off, and the loop comes back when it ends
    d, job = step(job, gone, healthy(4), t1 + timedelta(seconds=4))
    assert d.create_workers == [] and d.requeue_after <= 6.1
    d, job = step(job, gone, healthy(4), t1 + timedelta(seconds=10))
    assert d.create_workers == [1]
    assert "train-worker-1" not in job["status"].get("podBackoff", {})  # the entry is removed once passed
    # a second crash waits twice as long; the count carries on
    t2 = t1 + timedelta(seconds=60)
    replaced = [*gone, make_pod(1)]
    d, job = step(job, crash(replaced, -1, uid="pod-1b"), healthy(4), t2)
    assert job["status"]["podFailures"] == 2
    assert parse_time(job["status"]["podBackoff"]["train-worker-1"]) == t2 + timedelta(seconds=20)


def test_a_preempted_pod_is_neither_counted_nor_held_back():
    job, pods = running_job()
    preempted = copy.deepcopy(pods)
    preempted[1]["status"] = {"phase": "Failed", "reason": "Shutdown",
                              "message": "Pod was terminated in response to imminent node shutdown."}
    d, job = step(with_budget(job, 0), preempted, healthy(4), T0 + timedelta(seconds=20))
    assert d.delete_pods == ["train-worker-1"] and "podFailures" not in job["status"]
    assert "podBackoff" not in job["status"] and job["status"]["phase"] != "Failed"
    d, _ = step(job, without(pods, "train-worker-1"), healthy(4), T0 + timedelta(seconds=21))
    assert d.create_workers == [1]


def test_more_failures_than_the_budget_fail_the_job_and_release_its_pods():
    job, pods = running_job()
    job = with_budget(job, 1)
    t1 = T0 + timedelta(seconds=20)
    _, job = step(job, crash(pods, 1), healthy(4), t1)
    assert job["status"]["podFailures"] == 1 and job["status"]["phase"] != "Failed"  # within the budget

    t2 = t1 + timedelta(seconds=30)
    pods2 = crash(without(pods, "train-worker-1"), 0)  # another pod crashes: 2 > 1
    d, job = step(job, pods2, healthy(4), t2)
    st = job["status"]
    assert st["phase"] == "Failed" and st["podFailures"] == 2
    assert "maxPodFailures=1" in st["message"] and "raise maxPodFailures" in st["message"]
    cond = conditions(job)
    assert cond["Failed"]["status"] == "True" and cond["Failed"]["reason"] == "PodFailureBudgetExceeded"
    assert cond["Ready"]["status"] == "False"
    [event] = [e for e in d.events if e[1] == "PodFailureBudgetExceeded"]
    assert event[0] == "Warning" and "train-worker-0" in event[2]
    # running workers and the coordinator are deleted (GPUs released); the failed pod stays for its logs
    assert sorted(d.delete_pods) == ["train-coordinator", "train-worker-2", "train-worker-3"]
    assert not d.create_workers and not d.create_coordinator and d.replan_reason is None

    # later passes (or a restarted operator reading the status) stay Failed, quietly, creating nothing
    d, job = step(job, [pods2[0]], healthy(4), t2 + timedelta(minutes=10))
    assert job["status"]["phase"] == "Failed" and not d.events
    assert not d.create_workers and not d.create_coordinator and d.delete_pods == []

    # raising the budget resumes the job: pods come back, the Failed condition is cleared
    d, job = step(with_budget(job, 5), [pods2[0]], healthy(4), t2 + timedelta(minutes=11))
    assert job["status"]["phase"] != "Failed" and conditions(job)["Failed"]["status"] == "False"
    assert d.create_coordinator and d.delete_pods == ["train-worker-0"]


def test_the_count_survives_an_operator_restart():
    """Everything is in the status: a new operator reading it fails the job at the same count."""
    job, pods = running_job()
    job = with_budget(job, 0)
    job["status"].update(podFailures=0)
    _, job = step(job, crash(pods, 2), healthy(4), T0 + timedelta(seconds=20))
    assert job["status"]["phase"] == "Failed" and job["status"]["podFailures"] == 1
    assert job["status"]["countedFailures"] == ["pod-2"] and job["status"]["failures"] == 1
    # the same failed pod seen again is not counted twice
    _, again = step(job, crash(pods, 2), healthy(4), T0 + timedelta(seconds=40))
    assert again["status"]["podFailures"] == 1


def test_statuses_of_the_failure_paths_fit_the_crd_schema(crd_validator):
    job, pods = running_job()
    job = with_budget(job, 1)
    states = []
    _, job = step(job, crash(pods, 1), healthy(4), T0 + timedelta(seconds=20))
    states.append(job)
    _, job = step(job, without(pods, "train-worker-1"), healthy(4), T0 + timedelta(seconds=40))
    states.append(job)
    _, job = step(job, crash(without(pods, "train-worker-1"), 0), healthy(4), T0 + timedelta(seconds=50))
    states.append(job)
    assert job["status"]["phase"] == "Failed"
    for state in states:
        assert crd_validator.errors(crd_validator.default(state)) == []


# ---- what the operator refuses ---------------------------------------------------------------
HOST_PATH = {"path": "/ckpt", "volume": {"hostPath": {"path": "/mnt/ckpt", "type": "DirectoryOrCreate"}}}


def test_a_host_path_checkpoint_is_refused_with_the_fix_and_nothing_is_created():
    job = make_job(checkpoint=HOST_PATH)
    d, job = step(job, [], {})
    st = job["status"]
    assert st["phase"] == "Failed" and st["message"].startswith("spec.checkpoint.volume.hostPath:")
    assert "--allow-host-path-checkpoints" in st["message"] and "operator.allowHostPathCheckpoints" in st["message"]
    assert conditions(job)["Ready"]["reason"] == "RefusedByOperator"
    assert d.spec is None and not d.create_workers and not d.create_coordinator
    assert [r for _, r, _ in d.events] == ["RefusedByOperator"]
    d, _ = step(job, [], {})
    assert not d.events  # said once


@pytest.mark.parametrize("volume", [{"persistentVolumeClaim": {"claimName": "ckpt"}}, {"emptyDir": {}}])
def test_other_checkpoint_volumes_and_an_allowing_operator_start_the_job(volume):
    d, _ = step(make_job(checkpoint={"path": "/ckpt", "volume": volume}), [], {})
    assert d.create_workers == [0, 1, 2, 3] and d.create_coordinator
    d, job = step(make_job(checkpoint=HOST_PATH), [], {}, policy=JobPolicy(allow_host_path_checkpoints=True))
    assert d.create_workers == [0, 1, 2, 3] and job["status"]["phase"] == "Pending"


def test_a_refused_job_starts_once_the_operator_allows_it():
    _, job = step(make_job(checkpoint=HOST_PATH), [], {})
    assert job["status"]["phase"] == "Failed"
    pods = [make_pod(i) for i in range(4)] + [coordinator()]
    _, job = step(job, pods, healthy(4), policy=JobPolicy(allow_host_path_checkpoints=True))
    assert job["status"]["plan"]["generation"] == 1 and job["status"]["phase"] == "Pending"
