"""Failure paths of the operator's decision: worker pods that crash (back-off, the job's budget
for them) and jobs the operator refuses (hostPath checkpoints). Pure, with the real planner."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
from test_operator_reconcile import T0, ack, coordinator, healthy, make_job, make_pod, running_job, step

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
    assert parse_time(job["status"]["tracking"]["recreateAfter"]["train-worker-1"]) == t1 + timedelta(seconds=10)
    assert ("Warning", "WorkerFailed") in {(k, r) for k, r, _ in d.events}
    gone = without(pods, "train-worker-1")
    # the pod is gone: not re-created during the back-off, and the loop comes back when it ends
    d, job = step(job, gone, healthy(4), t1 + timedelta(seconds=4))
    assert d.create_workers == [] and d.requeue_after <= 6.1
    d, job = step(job, gone, healthy(4), t1 + timedelta(seconds=10))
    assert d.create_workers == [1]
    assert "train-worker-1" not in job["status"]["tracking"].get("recreateAfter", {})  # the entry is removed once passed
    # a second crash waits twice as long; the count carries on
    t2 = t1 + timedelta(seconds=60)
    replaced = [*gone, make_pod(1)]
    d, job = step(job, crash(replaced, -1, uid="pod-1b"), healthy(4), t2)
    assert job["status"]["podFailures"] == 2
    assert parse_time(job["status"]["tracking"]["recreateAfter"]["train-worker-1"]) == t2 + timedelta(seconds=20)


def test_an_older_operators_top_level_records_are_read_and_moved_into_tracking():
    """Operators before 0.3 kept the records at the top of the status: a job they tracked keeps
    its back-off and its counted pods; the records are copied into tracking, and the old fields
    removed once tracking came back from the server."""
    from liveshard.runtime.contract.times import iso

    job, pods = running_job()
    t1 = T0 + timedelta(seconds=20)
    failed = crash(pods, 1, uid="pod-1-old")
    job = copy.deepcopy(job)
    job["status"].update(podFailures=1, failures=1, countedFailures=["pod-1-old"],
                         podBackoff={"train-worker-1": iso(t1 + timedelta(seconds=10))},
                         configError={"message": "x", "count": 1, "generation": job["metadata"]["generation"]})
    d, after = step(job, failed, healthy(4), t1)
    assert after["status"]["podFailures"] == 1  # already counted: not again
    records = after["status"]["tracking"]
    assert records["countedPods"] == ["pod-1-old"]
    assert parse_time(records["recreateAfter"]["train-worker-1"]) == t1 + timedelta(seconds=10)
    assert after["status"]["countedFailures"] == ["pod-1-old"]  # kept until tracking is stored
    d, after = step(after, without(pods, "train-worker-1"), healthy(4), t1 + timedelta(seconds=5))
    assert d.create_workers == []  # the older operator's back-off still holds
    assert d.status["countedFailures"] is None and d.status["podBackoff"] is None
    assert not {"countedFailures", "podBackoff", "configError"} & set(after["status"])
    d, after = step(after, without(pods, "train-worker-1"), healthy(4), t1 + timedelta(seconds=10))
    assert d.create_workers == [1] and "countedFailures" not in d.status


def test_records_survive_a_crd_that_prunes_tracking():
    """An old CRD (Helm installs crds/ only on the first install) has no status.tracking: the
    server drops it from every write. The records written beside it in the old fields keep a
    kept failed pod from being counted again and keep its back-off."""
    job, pods = running_job()
    job = with_budget(job, 0)  # the first crash fails the job: the failed pod is kept for its logs
    t1 = T0 + timedelta(seconds=20)
    failed = crash(pods, 1, uid="kept")
    for k in range(3):
        _, job = step(job, failed, healthy(4), t1 + timedelta(seconds=k))
        job["status"].pop("tracking", None)  # pruned by the old schema
        assert job["status"]["podFailures"] == 1 and job["status"]["countedFailures"] == ["kept"], k
    assert job["status"]["phase"] == "Failed"


def test_a_preempted_pod_is_neither_counted_nor_held_back():
    job, pods = running_job()
    preempted = copy.deepcopy(pods)
    preempted[1]["status"] = {"phase": "Failed", "reason": "Shutdown",
                              "message": "Pod was terminated in response to imminent node shutdown."}
    d, job = step(with_budget(job, 0), preempted, healthy(4), T0 + timedelta(seconds=20))
    assert d.delete_pods == ["train-worker-1"] and "podFailures" not in job["status"]
    assert not job["status"].get("tracking", {}).get("recreateAfter") and job["status"]["phase"] != "Failed"
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
    assert job["status"]["tracking"]["countedPods"] == ["pod-2"] and job["status"]["failures"] == 1
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


# ---- a configuration error: the same bad input from every worker pod ---------------------------
BAD_INPUT = "liveshard worker: error: spec.training.data.path: /opt/liveshard/corpus does not exist"


def exit_2(pods, *indices, line=BAD_INPUT, code=2, uid_suffix=""):
    """Worker pods whose container exited as the kubelet reports it: the log's tail (an earlier
    line first) as the termination message."""
    pods = copy.deepcopy(pods)
    for i in indices:
        p = next(p for p in pods if p["metadata"]["name"] == f"train-worker-{i}")
        p["metadata"]["uid"] += uid_suffix
        p["status"] = {"phase": "Failed", "containerStatuses": [{"name": "worker", "state": {"terminated": {
            "exitCode": code, "reason": "Error", "message": f"reading the spec\n{line}\n"}}}]}
    return pods


def started_job(n=4, **kw):
    """A job whose pods run and whose first plan the runtime has not applied yet."""
    job = make_job(**kw)
    pods = [make_pod(i) for i in range(n)] + [coordinator()]
    _, job = step(job, pods, healthy(n))
    assert job["status"]["plan"]["generation"] == 1 and "appliedGeneration" not in job["status"]
    return job, pods


def test_every_worker_exiting_on_the_same_bad_input_fails_the_job_with_their_message(crd_validator):
    job, pods = started_job()
    failed = exit_2(pods, 0, 1, 2, 3)
    d, job = step(job, failed, healthy(4), T0 + timedelta(seconds=20))
    st = job["status"]
    assert st["phase"] == "Failed" and st["message"].startswith(BAD_INPUT)
    assert "exited 2" in st["message"] and "spec" in st["message"]
    assert st["tracking"]["configError"] == {"message": BAD_INPUT, "count": 4, "generation": 1}
    cond = conditions(job)
    assert (cond["Failed"]["status"], cond["Failed"]["reason"]) == ("True", "WorkerConfigError")
    assert cond["Ready"]["status"] == "False"
    [event] = [e for e in d.events if e[1] == "WorkerConfigError"]
    assert event[0] == "Warning" and event[2].startswith(BAD_INPUT)
    # nothing is created; the coordinator goes; the failed pods stay for their logs
    assert d.delete_pods == ["train-coordinator"] and not d.create_workers and not d.create_coordinator
    assert st["podFailures"] == 4 and sorted(st["tracking"]["countedPods"]) == [f"pod-{i}" for i in range(4)]
    assert crd_validator.errors(crd_validator.default(job)) == []

    # later passes (a restarted operator too) stay Failed, quietly, creating nothing
    d, job = step(job, failed[:4], healthy(4), T0 + timedelta(minutes=10))
    assert job["status"]["phase"] == "Failed" and not d.events and not d.create_workers and not d.create_coordinator
    assert job["status"]["message"].startswith(BAD_INPUT)

    # a new spec resumes the job: the failed pods are replaced, the Failed condition cleared
    fixed = copy.deepcopy(job)
    fixed["metadata"]["generation"] = 2
    d, job = step(fixed, failed[:4], healthy(4), T0 + timedelta(minutes=11))
    assert job["status"]["phase"] != "Failed" and not job["status"].get("tracking", {}).get("configError")
    assert (conditions(job)["Failed"]["status"], conditions(job)["Failed"]["reason"]) == ("False", "SpecChanged")
    assert sorted(d.delete_pods) == [f"train-worker-{i}" for i in range(4)] and d.create_coordinator
    d, job = step(job, [], healthy(4), T0 + timedelta(minutes=11, seconds=1))
    assert d.create_workers == [0, 1, 2, 3]


def test_a_lone_worker_fails_the_job_on_its_third_identical_bad_input():
    """One pod, re-created after each back-off: its first two exits are ordinary failures (with
    its line in the event); the third with the same line fails the job. A different line starts
    the count again."""
    job, pods = started_job(n=1, max_workers=1)
    t = T0 + timedelta(seconds=20)
    for attempt, line in enumerate([BAD_INPUT, "liveshard worker: error: other", BAD_INPUT, BAD_INPUT], 1):
        d, job = step(job, exit_2(pods, 0, line=line, uid_suffix=f"-{attempt}"), healthy(1), t)
        assert job["status"]["phase"] != "Failed"
        [event] = [e for e in d.events if e[1] == "WorkerFailed"]
        assert f"exit code 2: {line}" in event[2]
        t += timedelta(minutes=5)  # past the back-off: the pod is re-created
        d, job = step(job, [coordinator()], healthy(1), t)
        assert d.create_workers == [0]
    assert job["status"]["tracking"]["configError"]["count"] == 2
    d, job = step(job, exit_2(pods, 0, uid_suffix="-5"), healthy(1), t + timedelta(seconds=5))
    assert job["status"]["phase"] == "Failed" and job["status"]["message"].startswith(BAD_INPUT)
    assert "3 times in a row" in job["status"]["message"]


def test_other_exit_codes_and_a_training_job_keep_the_ordinary_recovery():
    # exit 1 (it ran and failed) from every pod: failures with back-off, never a configuration error
    job, pods = started_job()
    d, job = step(job, exit_2(pods, 0, 1, 2, 3, code=1), healthy(4), T0 + timedelta(seconds=20))
    assert job["status"]["phase"] != "Failed" and not job["status"].get("tracking", {}).get("configError")
    assert job["status"]["podFailures"] == 4 and len(job["status"]["tracking"]["recreateAfter"]) == 4
    # a job that trains: one pod's bad input (its node, its mount) is that pod's failure
    job, pods = running_job()
    for attempt in range(4):
        failed = exit_2(pods, 3, uid_suffix=f"-{attempt}")
        d, job = step(job, failed, healthy(4), T0 + timedelta(minutes=10 * (attempt + 1)))
        assert job["status"]["phase"] != "Failed" and not job["status"].get("tracking", {}).get("configError")
        assert "train-worker-3" in d.delete_pods


def test_a_count_short_of_the_limit_is_cleared_once_the_job_trains():
    job, pods = started_job()
    _, job = step(job, exit_2(pods, 3), healthy(4), T0 + timedelta(seconds=20))
    assert job["status"]["tracking"]["configError"]["count"] == 1
    # the other three train (the plan over them is applied): the count is dropped
    _, job = step(job, without(pods, "train-worker-3"), healthy(4), T0 + timedelta(seconds=30))
    _, job = step(ack(job), without(pods, "train-worker-3"), healthy(4), T0 + timedelta(seconds=40))
    assert job["status"]["phase"] == "Running" and not job["status"].get("tracking", {}).get("configError")
