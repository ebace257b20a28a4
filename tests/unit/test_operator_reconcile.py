"""The operator's decision for one job, step by step, with the real planner (no cluster)."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta

import pytest

from liveshard.operator import signals
from liveshard.operator.reconcile import reconcile
from liveshard.runtime.contract.causes import Cause
from liveshard.runtime.contract.crd import LABEL_INDEX, LABEL_JOB, LABEL_ROLE
from liveshard.runtime.contract.jobspec import read_spec
from liveshard.runtime.planner.pods import Candidate, plan_for

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
SPOT = {"key": "aws-node-termination-handler/spot-itn", "value": "spot-itn-1", "effect": "NoSchedule"}


def make_job(max_workers=4, min_workers=1, gpus=2, status=None, **spec_extra):
    spec = {"model": {"preset": "gpt-125m"}, "image": "img",
            "workers": {"min": min_workers, "max": max_workers, "gpusPerWorker": gpus},
            "training": {"data": {"mock": True}, "trainIters": 1000, "globalBatch": 64}, "elasticity": {"scaleUpCooldownSeconds": 60}}
    for key, value in spec_extra.items():
        spec[key] = value
    return {"apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob",
            "metadata": {"name": "train", "namespace": "ml", "uid": "job-uid", "generation": 1,
                         "creationTimestamp": "2026-03-01T11:00:00Z", "resourceVersion": "7"},
            "spec": spec, "status": status or {}}


def make_pod(i, node=None, phase="Running", **meta):
    p = {"metadata": {"name": f"train-worker-{i}", "namespace": "ml", "uid": f"pod-{i}",
                      "labels": {LABEL_JOB: "train", LABEL_ROLE: "worker",
                                 LABEL_INDEX: str(i)}, **meta},
         "spec": {"nodeName": node if node is not None else f"node-{i}"},
         "status": {"phase": phase}}
    if phase == "Pending" and node is None:
        p["spec"] = {}
    return p


def coordinator():
    return {"metadata": {"name": "train-coordinator", "labels": {LABEL_JOB: "train",
                                                                 LABEL_ROLE: "coordinator"}}}


def healthy(n):
    return {f"node-{i}": None for i in range(n)}


def step(job, pods, nodes, now=T0, **kw):
    """Reconcile and apply the status patch to a copy of the job, as the API server would."""
    d = reconcile(job, pods, nodes, now, **kw)
    job = copy.deepcopy(job)
    merge_patch(job.setdefault("status", {}), copy.deepcopy(d.status))
    return d, job


def merge_patch(target, patch):
    """RFC 7386: dicts merge, None deletes, anything else replaces."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict):  # a new object too: its nulls are dropped
            if not isinstance(target.get(key), dict):
                target[key] = {}
            merge_patch(target[key], value)
        else:
            target[key] = value


def ack(job, gen=None):
    job = copy.deepcopy(job)
    job["status"]["appliedGeneration"] = gen or job["status"]["plan"]["generation"]
    return job


def running_job(n=4, **kw):
    """A job whose first plan over n pods has been applied."""
    job = make_job(**kw)
    pods = [make_pod(i) for i in range(n)] + [coordinator()]
    d, job = step(job, pods, healthy(n))
    assert d.status["plan"]["generation"] == 1
    d, job = step(ack(job), pods, healthy(n), T0 + timedelta(seconds=5))
    assert job["status"]["phase"] == "Running"
    return job, pods


# ---- start -----------------------------------------------------------------------------------
def test_a_new_job_gets_its_pods_and_coordinator_but_no_plan_yet():
    d, job = step(make_job(), [], {})
    assert d.create_workers == [0, 1, 2, 3]
    assert d.create_coordinator
    assert "plan" not in d.status
    assert job["status"]["phase"] == "Pending"
    assert job["status"]["selector"] == "liveshard.io/job=train,liveshard.io/role=worker"


def test_the_first_plan_waits_for_all_desired_pods_unless_the_cooldown_passed():
    job = make_job()
    job["metadata"]["creationTimestamp"] = "2026-03-01T11:59:50Z"
    pods = [make_pod(0), make_pod(1), make_pod(2, phase="Pending"), make_pod(3, phase="Pending"), coordinator()]
    d, _ = step(job, pods, healthy(4))
    assert "plan" not in d.status and 0 < d.requeue_after <= 51
    d, _ = step(job, pods, healthy(4), T0 + timedelta(seconds=61))
    plan = d.status["plan"]
    assert plan["members"] == ["train-worker-0", "train-worker-1"] and plan["generation"] == 1
    assert d.replan_reason == "initial"


def test_initial_plan_matches_the_planner_and_maps_ranks_to_pods():
    job = make_job()
    pods = [make_pod(i) for i in range(4)] + [coordinator()]
    d, job = step(job, pods, healthy(4))
    plan = d.status["plan"]
    spec = read_spec(job["spec"])
    expected = plan_for(spec, [Candidate(f"train-worker-{i}", f"node-{i}") for i in range(4)])
    assert plan["config"] == expected.config
    assert plan["members"] == list(expected.members)
    assert plan["worldSize"] == 8 == len(plan["members"]) * 2
    assert plan["gpusPerWorker"] == 2
    assert plan["microBatches"] * int(plan["config"].split("dp=")[1].split(",")[0]) == 64
    assert job["status"]["phase"] == "Pending"
    cond = {c["type"]: c for c in job["status"]["conditions"]}
    assert cond["Reconfiguring"]["status"] == "True" and cond["Ready"]["status"] == "False"
    assert d.requeue_after <= 5


def test_ack_makes_the_job_ready_and_records_the_duration():
    job, _pods = running_job()
    cond = {c["type"]: c["status"] for c in job["status"]["conditions"]}
    assert cond == {"Ready": "True", "Reconfiguring": "False", "Degraded": "False", "Suspended": "False"}
    entry = job["status"]["history"][-1]
    assert entry["outcome"] == "Applied" and entry["seconds"] == 5.0
    assert job["status"]["worldSize"] == 8


# ---- spot notice ------------------------------------------------------------------------------
def test_spot_notice_replans_without_the_pod_then_deletes_it_only_after_the_ack():
    job, pods = running_job()
    now = T0 + timedelta(seconds=30)
    nodes = healthy(4)
    nodes["node-2"] = signals.classify_node({"metadata": {"name": "node-2"}, "spec": {"taints": [SPOT]}}, now)
    d, job = step(job, pods, nodes, now)
    plan = d.status["plan"]
    assert plan["generation"] == 2
    assert "train-worker-2" not in plan["members"] and plan["leaving"] == ["train-worker-2"]
    assert plan["deadline"] == "2026-03-01T12:02:30.000000Z"  # the two-minute notice
    assert plan["reason"].startswith("spot-interruption") and "node-2" in plan["reason"]
    assert d.replan_reason == Cause.SPOT_INTERRUPTION and d.triggers == ["node-2"]
    assert d.delete_pods == [] and d.create_workers == []
    assert job["status"]["phase"] == "Reconfiguring"

    # the same view again (an operator restart, or a second wake-up) writes nothing new
    d2, job2 = step(job, pods, nodes, now + timedelta(seconds=1))
    assert d2.replan_reason is None and job2["status"]["plan"] == job["status"]["plan"]
    assert d2.delete_pods == []

    d3, job3 = step(ack(job), pods, nodes, now + timedelta(seconds=10))
    assert d3.delete_pods == ["train-worker-2"] and d3.new_failures == 0
    assert job3["status"]["phase"] == "Running" and job3["status"]["worldSize"] == plan["worldSize"]
    # once it is gone the index is recreated: capacity elsewhere can pick it up
    remaining = [p for p in pods if p["metadata"]["name"] != "train-worker-2"]
    d4, _ = step(job3, remaining, nodes, now + timedelta(seconds=11))
    assert d4.create_workers == [2]


def test_a_policy_that_ignores_cordons_keeps_the_pod():
    job, pods = running_job(elasticity={"actOn": ["spot-interruption"], "scaleUpCooldownSeconds": 60})
    nodes = healthy(4)
    nodes["node-1"] = signals.classify_node({"metadata": {}, "spec": {"unschedulable": True}}, T0)
    d, _ = step(job, pods, nodes, T0 + timedelta(seconds=20))
    assert d.replan_reason is None


def test_a_crashed_member_is_deleted_and_counted_as_a_failure_but_a_preempted_one_is_not():
    """A loss without notice: the runtime plans it (tests/unit/test_operator_one_authority.py);
    the operator deletes the dead pod and counts it."""
    job, pods = running_job()
    crashed = copy.deepcopy(pods)
    crashed[1]["status"] = {"phase": "Failed", "reason": "Error"}
    d, job2 = step(job, crashed, healthy(4), T0 + timedelta(seconds=20))
    assert d.replan_reason is None and "plan" not in d.status
    assert d.delete_pods == ["train-worker-1"]  # dead: nothing to copy from it
    assert d.new_failures == 1 and job2["status"]["failures"] == 1

    preempted = copy.deepcopy(pods)
    preempted[1]["status"] = {"phase": "Failed", "reason": "Shutdown",
                              "message": "Pod was terminated in response to imminent node shutdown."}
    d, job3 = step(job, preempted, healthy(4), T0 + timedelta(seconds=20))
    assert d.delete_pods == ["train-worker-1"] and d.new_failures == 0
    assert "failures" not in job3["status"]


def test_a_vanished_node_or_pod_is_the_runtimes_to_plan():
    job, pods = running_job()
    nodes = healthy(4)
    del nodes["node-3"]
    d, _ = step(job, pods, nodes, T0 + timedelta(seconds=20))
    assert d.replan_reason is None and "plan" not in d.status
    d, _ = step(job, pods[1:], healthy(4), T0 + timedelta(seconds=20))
    assert d.replan_reason is None and "plan" not in d.status
    assert d.create_workers == [0]  # a missing pod is created at once


# ---- not enough GPUs --------------------------------------------------------------------------
def test_too_few_gpus_suspends_with_the_reason_and_resumes_when_capacity_returns():
    job, pods = running_job(min_workers=3)
    nodes = healthy(4)
    for n in ("node-0", "node-1"):
        nodes[n] = signals.classify_node({"metadata": {}, "spec": {"taints": [SPOT]}}, T0)
    d, job = step(job, pods, nodes, T0 + timedelta(seconds=20))
    plan = d.status["plan"]
    assert plan["members"] == [] and plan["config"] == ""
    assert "fewer than workers.min=3" in plan["reason"]
    assert job["status"]["phase"] == "Suspended"
    cond = {c["type"]: c for c in job["status"]["conditions"]}
    assert cond["Suspended"]["status"] == "True" and cond["Suspended"]["reason"] == "BelowMinWorkers"
    assert ("Warning", "BelowMinWorkers") in {(t, r) for t, r, _ in d.events}

    # ack of the stop plan: the leavers go; replacements are created
    d, job = step(ack(job), pods, nodes, T0 + timedelta(seconds=40))
    assert sorted(d.delete_pods) == ["train-worker-0", "train-worker-1"]
    survivors = pods[2:4]
    d, job = step(job, [*survivors, coordinator()], nodes, T0 + timedelta(seconds=41))
    assert d.create_workers == [0, 1] and job["status"]["phase"] == "Suspended"
    back = [make_pod(0, node="node-5"), make_pod(1, node="node-6"), *survivors, coordinator()]
    nodes.update({"node-5": None, "node-6": None})
    d, job = step(job, back, nodes, T0 + timedelta(seconds=60))
    assert d.replan_reason == "resume" and len(d.status["plan"]["members"]) >= 3


def test_a_model_that_fits_nowhere_is_suspended_with_the_planners_reason():
    job = make_job(model={"preset": "llama3-70b"}, workers={"min": 1, "max": 1, "gpusPerWorker": 1,
                                                            "gpuMemory": "16Gi"})
    _d, job = step(job, [make_pod(0), coordinator()], healthy(1))
    assert job["status"]["phase"] == "Suspended"
    cond = {c["type"]: c for c in job["status"]["conditions"]}
    assert cond["Suspended"]["reason"] == "NoFeasiblePlan"
    assert "no feasible plan" in cond["Suspended"]["message"]


# ---- scale ------------------------------------------------------------------------------------
def test_scale_up_waits_for_the_cooldown_then_adds_the_new_pods():
    job, pods = running_job(n=2, max_workers=4)
    # the spec asks for 4 (replicas unset = max); pods 2 and 3 become Running later
    pods = [*pods, make_pod(2), make_pod(3)]
    d, _ = step(job, pods, healthy(4), T0 + timedelta(seconds=30))
    assert d.replan_reason is None and 29 < d.requeue_after < 31
    d, job2 = step(job, pods, healthy(4), T0 + timedelta(seconds=61))
    assert d.replan_reason == "scale-up"
    assert d.status["plan"]["joining"] == ["train-worker-2", "train-worker-3"]
    assert d.status["plan"]["worldSize"] == 8
    # the same candidates are not priced again while nothing changes
    d, _ = step(ack(job2), pods, healthy(4), T0 + timedelta(seconds=62), scale_up_checked=d.scale_up_key)
    assert d.replan_reason is None


def test_scaling_down_through_replicas_removes_the_highest_indices():
    job, pods = running_job()
    job["spec"]["workers"]["replicas"] = 2
    job["metadata"]["generation"] = 2
    d, job = step(job, pods, healthy(4), T0 + timedelta(seconds=30))
    assert d.replan_reason == "scale-down"
    assert set(d.status["plan"]["leaving"]) == {"train-worker-2", "train-worker-3"}
    assert d.delete_pods == []
    d, job = step(ack(job), pods, healthy(4), T0 + timedelta(seconds=40))
    assert sorted(d.delete_pods) == ["train-worker-2", "train-worker-3"]
    assert job["status"]["observedGeneration"] == 2


def test_an_invalid_spec_fails_the_job_with_the_field_named():
    job = make_job(parallelism={"ep": [2]})
    d, job = step(job, [], {})
    assert job["status"]["phase"] == "Failed"
    assert job["status"]["message"].startswith("spec.parallelism.ep:")
    assert d.create_workers == [] and not d.create_coordinator
    assert ("Warning", "InvalidSpec") in {(t, r) for t, r, _ in d.events}


def test_a_stopped_coordinator_is_replaced():
    job, pods = running_job()
    evicted = coordinator()
    evicted["status"] = {"phase": "Failed", "reason": "Evicted"}
    d, _ = step(job, [*pods[:-1], evicted], healthy(4), T0 + timedelta(seconds=20))
    assert d.delete_pods == ["train-coordinator"] and not d.create_coordinator
    assert d.replan_reason is None  # training does not depend on it between reconfigurations
    d, _ = step(job, pods[:-1], healthy(4), T0 + timedelta(seconds=21))
    assert d.create_coordinator


def test_an_unacked_plan_past_its_deadline_degrades_the_job():
    job, pods = running_job()
    nodes = healthy(4)
    nodes["node-0"] = signals.classify_node({"metadata": {}, "spec": {"taints": [SPOT]}}, T0)
    _, job = step(job, pods, nodes, T0 + timedelta(seconds=10))
    _, job = step(job, pods, nodes, T0 + timedelta(minutes=3))
    cond = {c["type"]: c for c in job["status"]["conditions"]}
    assert cond["Degraded"]["status"] == "True" and cond["Degraded"]["reason"] == "AckDeadlineExceeded"


def test_an_aborted_plan_is_retried_after_a_backoff():
    job, pods = running_job()
    nodes = healthy(4)
    nodes["node-0"] = signals.classify_node({"metadata": {}, "spec": {"taints": [SPOT]}}, T0)
    d, job = step(job, pods, nodes, T0 + timedelta(seconds=10))
    gen = job["status"]["plan"]["generation"]
    job["status"]["abortedGeneration"] = gen
    job["status"]["abortReason"] = "transfer checksum mismatch"
    d, job = step(job, pods, nodes, T0 + timedelta(seconds=11))
    assert d.replan_reason is None
    assert job["status"]["history"][-1]["outcome"] == "Aborted"
    assert {c["type"]: c["reason"] for c in job["status"]["conditions"]}["Degraded"] == "ReconfigurationAborted"
    d, job = step(job, pods, nodes, T0 + timedelta(seconds=45))
    assert d.replan_reason == "retry" and job["status"]["plan"]["generation"] == gen + 1


def test_every_status_the_decision_writes_fits_the_crd_schema(crd_validator):
    """A real API server prunes or rejects status fields the CRD does not declare."""
    validator = crd_validator
    job, pods = running_job(min_workers=3)
    crashed = copy.deepcopy(pods)
    crashed[0]["status"] = {"phase": "Failed", "reason": "Error"}
    nodes = healthy(4)
    nodes["node-1"] = signals.classify_node({"metadata": {}, "spec": {"taints": [SPOT]}}, T0)
    states = [job]
    _, job = step(job, crashed, nodes, T0 + timedelta(seconds=20))  # stop plan, a failure counted
    states.append(job)
    job["status"]["abortedGeneration"] = job["status"]["plan"]["generation"]
    _, job = step(job, crashed, nodes, T0 + timedelta(seconds=21))
    states.append(job)
    for state in states:
        assert validator.errors(validator.default(state)) == []
    assert job["status"]["failures"] == 1 and job["status"]["tracking"]["countedPods"] == ["pod-0"]


def test_an_edit_that_changes_the_planners_answer_replans_and_one_that_does_not_only_observes():
    job, pods = running_job()
    assert "tp=1," in job["status"]["plan"]["config"]
    edited = copy.deepcopy(job)
    edited["spec"]["parallelism"] = {"tp": [2]}
    edited["metadata"]["generation"] = 2
    d, edited = step(edited, pods, healthy(4), T0 + timedelta(seconds=20))
    assert d.replan_reason == "spec-changed" and d.status["plan"]["config"].startswith("tp=2,")
    assert edited["status"]["observedGeneration"] == 2

    same = copy.deepcopy(job)
    same["spec"]["elasticity"]["reconfigurationTimeoutSeconds"] = 600
    same["metadata"]["generation"] = 2
    d, same = step(same, pods, healthy(4), T0 + timedelta(seconds=20))
    assert d.replan_reason is None and same["status"]["observedGeneration"] == 2


def test_a_status_plan_it_cannot_read_is_reported_and_replaced_under_a_newer_generation():
    job, pods = running_job()
    generation = job["status"]["plan"]["generation"]
    job["status"]["plan"]["config"] = "tp=banana"
    d = reconcile(job, pods, healthy(4), T0 + timedelta(seconds=600))
    assert any(e[1] == "InvalidStatus" and "status.plan.config" in e[2] for e in d.events)
    assert d.status["plan"]["generation"] == generation + 1 and d.status["plan"]["config"].startswith("tp=")


def test_a_plan_never_answered_is_replaced_once_another_world_is_possible():
    job = make_job()
    pods = [make_pod(i) for i in range(3)] + [coordinator()]
    _, job = step(job, pods, healthy(4))
    first = job["status"]["plan"]
    assert first["generation"] == 1 and len(first["members"]) == 3
    # reconfigurationTimeoutSeconds, then the time a live coordinator takes at most to answer
    overdue = T0 + timedelta(seconds=300 + 4 * 120 + 60 + 1)
    # the same pods: planning again would give the same world; the job says it is stuck
    _, job = step(job, pods, healthy(4), overdue)
    assert job["status"]["plan"]["generation"] == 1
    degraded = next(c for c in job["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "AckDeadlineExceeded"
    # a fourth pod runs now: a different world, planned anew
    _, job = step(job, [*pods, make_pod(3)], healthy(4), overdue + timedelta(seconds=1))
    plan = job["status"]["plan"]
    assert plan["generation"] == 2 and plan["cause"] == "retry" and len(plan["members"]) == 4
    assert "not applied by its deadline" in plan["reason"]
    # while a live coordinator may still answer (it aborts the plan itself when its pods are not
    # up by the deadline), nothing is replanned: the answer is the runtime's
    for seconds in (300 + 30, 300 + 61, 300 + 4 * 120 + 59):
        _, job2 = step(make_job(), pods, healthy(4))
        _, job2 = step(job2, [*pods, make_pod(3)], healthy(4), T0 + timedelta(seconds=seconds))
        assert job2["status"]["plan"]["generation"] == 1, seconds


def test_a_withdrawable_signal_counts_only_once_it_has_held_for_the_debounce_time():
    from dataclasses import replace

    job, pods = running_job()
    now = T0 + timedelta(seconds=30)
    cordon = replace(signals.classify_node({"metadata": {"name": "node-2"}, "spec": {"unschedulable": True}}, now),
                     seen=now)
    assert cordon.kind == Cause.CORDON
    nodes = {**healthy(4), "node-2": cordon}
    d, held = step(job, pods, nodes, now + timedelta(seconds=2))  # a blip so far: nothing moves
    assert held["status"]["plan"]["generation"] == 1 and not d.delete_pods
    assert 2.9 < d.requeue_after <= 3.2  # looked at again when the 5 s have passed
    d, moved = step(job, pods, nodes, now + timedelta(seconds=6))
    assert moved["status"]["plan"]["generation"] == 2 and moved["status"]["plan"]["cause"] == "cordon"
    # a spot interruption is a hard deadline: it acts at once
    spot = replace(signals.classify_node({"metadata": {"name": "node-2"}, "spec": {"taints": [SPOT]}}, now),
                   seen=now)
    _, at_once = step(job, pods, {**healthy(4), "node-2": spot}, now)
    assert at_once["status"]["plan"]["generation"] == 2


def test_a_job_that_reached_train_iters_succeeds_and_is_never_restarted():
    """The coordinator wrote finishedAt (the final checkpoint is complete): the phase is
    Succeeded, nothing is planned or created, the coordinator pod (restartPolicy Always) is
    deleted, the workers (exited 0) stay; an operator restart reads the same status."""
    from liveshard.runtime.contract.status import Finished

    done = Finished(T0, 1000, "/ckpt/step00001000").to_status()
    job = make_job(status={"phase": "Running", "plan": {"generation": 1, "config": "tp=1,pp=1,dp=4", "members":
                                                        [f"train-worker-{i}" for i in range(2)], "gpusPerWorker": 2,
                                                        "worldSize": 4}, "appliedGeneration": 1, **done})
    pods = [make_pod(i, phase="Succeeded") for i in range(2)] + [coordinator()]
    d, job = step(job, pods, healthy(2))
    assert job["status"]["phase"] == "Succeeded" and "/ckpt/step00001000" in job["status"]["message"]
    assert d.delete_pods == ["train-coordinator"] and not d.create_workers and not d.create_coordinator
    assert ("Normal", "Succeeded") in {(k, r) for k, r, _ in d.events}
    conds = {c["type"]: c["status"] for c in job["status"]["conditions"]}
    assert conds["Succeeded"] == "True" and conds["Ready"] == "False"
    # a later pass (or a restarted operator) with no pods left: still Succeeded, nothing created, no new event
    d2, job = step(job, [], healthy(2))
    assert job["status"]["phase"] == "Succeeded" and not d2.create_workers and not d2.create_coordinator
    assert not d2.events


def test_nothing_of_a_succeeded_job_keeps_running_or_pending():
    """A worker pod re-created while the run ended (its predecessor exited 0 before the job's
    status said Succeeded) would hold a GPU, or wait for one, forever: a pending one is deleted
    with the coordinator at once, a running one once the members have had their time to exit by
    themselves; those that exited stay for their logs; none is created, now or later."""
    from liveshard.operator.endings import FINISHED_WORKER_GRACE_SECONDS
    from liveshard.runtime.contract.status import Finished

    job, pods = running_job()
    end = T0 + timedelta(minutes=5)
    job["status"].update(Finished(end, 1000, "/ckpt/step00001000").to_status())
    pods = [make_pod(0, phase="Succeeded"), make_pod(1, phase="Failed"), make_pod(2),
            make_pod(3, phase="Pending"), coordinator()]
    d, job = step(job, pods, healthy(4), end + timedelta(seconds=5))
    assert job["status"]["phase"] == "Succeeded"
    assert sorted(d.delete_pods) == ["train-coordinator", "train-worker-3"]
    assert d.requeue_after == pytest.approx(FINISHED_WORKER_GRACE_SECONDS - 5 + 0.1)
    d, job = step(job, pods[:3], healthy(4), end + timedelta(seconds=FINISHED_WORKER_GRACE_SECONDS))
    assert d.delete_pods == ["train-worker-2"] and not d.create_workers and not d.create_coordinator
    # pods already being deleted are not deleted again; the exited ones stay
    going = [pods[0], pods[1], make_pod(2, deletionTimestamp="2026-03-01T12:06:00Z")]
    d, job = step(job, going, healthy(4), end + timedelta(minutes=1))
    assert d.delete_pods == [] and not d.create_workers and not d.create_coordinator


def test_a_run_the_runtime_cannot_continue_fails_the_job_and_releases_its_pods(crd_validator):
    """The coordinator reported a terminal failure (state lost with no copy and no checkpoint):
    the job is Failed with the runtime's reason, its pods are deleted, nothing is re-created,
    and a later pass does not repeat the event."""
    from liveshard.runtime.contract.status import RuntimeFailure

    job, pods = running_job()
    job["status"].update(RuntimeFailure("NoSurvivingCopy", "train-worker-1/0 held the only copy",
                                        T0).to_status())
    d, job = step(job, pods, healthy(4), T0 + timedelta(seconds=30))
    assert job["status"]["phase"] == "Failed" and "only copy" in job["status"]["message"]
    assert set(d.delete_pods) == {*(f"train-worker-{i}" for i in range(4)), "train-coordinator"}
    assert not d.create_workers and not d.create_coordinator
    assert ("Warning", "NoSurvivingCopy") in {(k, r) for k, r, _ in d.events}
    conds = {c["type"]: (c["status"], c["reason"]) for c in job["status"]["conditions"]}
    assert conds["Failed"] == ("True", "NoSurvivingCopy") and conds["Ready"][0] == "False"
    assert crd_validator.errors(crd_validator.default(job)) == []
    d2, job = step(job, [], healthy(4), T0 + timedelta(seconds=40))
    assert job["status"]["phase"] == "Failed" and not d2.events and not d2.create_workers


def test_checkpoint_failures_and_an_unusable_directory_are_conditions_not_a_stopped_job(crd_validator):
    from liveshard.runtime.contract.status import CheckpointReport

    job, pods = running_job()
    failing = CheckpointReport(latest_path="/ckpt/step00000004", latest_step=4, failed_saves=1,
                               last_failure="step 6: No space left on device", failed_step=6, failed_at=T0,
                               unavailable=None)
    merge_patch(job["status"], failing.to_status())  # as the coordinator patches it
    d, job = step(job, pods, healthy(4), T0 + timedelta(seconds=30))
    conds = {c["type"]: c for c in job["status"]["conditions"]}
    assert conds["CheckpointFailing"]["status"] == "True" and "No space left" in conds["CheckpointFailing"]["message"]
    assert ("Warning", "SaveFailed") in {(k, r) for k, r, _ in d.events}
    assert job["status"]["phase"] == "Running"  # training goes on
    assert crd_validator.errors(crd_validator.default(job)) == []
    recovered = CheckpointReport(latest_path="/ckpt/step00000008", latest_step=8, failed_saves=1,
                                 last_failure="step 6: No space left on device", failed_step=6, failed_at=T0)
    merge_patch(job["status"], recovered.to_status())
    d, job = step(job, pods, healthy(4), T0 + timedelta(seconds=60))
    conds = {c["type"]: c for c in job["status"]["conditions"]}
    assert conds["CheckpointFailing"]["status"] == "False" and "step 8" in conds["CheckpointFailing"]["message"]
    merge_patch(job["status"], CheckpointReport(unavailable="/ckpt: read-only file system").to_status())
    d, job = step(job, pods, healthy(4), T0 + timedelta(seconds=90))
    conds = {c["type"]: c for c in job["status"]["conditions"]}
    assert conds["CheckpointUnavailable"]["status"] == "True" and "read-only" in conds["CheckpointUnavailable"]["message"]


def test_each_straggler_switch_is_one_event(crd_validator):
    from liveshard.runtime.contract.status import AdaptiveReport

    job, pods = running_job()
    decision = {"decisions": [{"switch": True, "kind": "layers", "config": "tp=1,pp=2,dp=2,ep=1,layers=1+3",
                               "step": 12, "time": 1700000100.0, "predictedStepSeconds": 0.2,
                               "predictedStepSecondsAfter": 0.15, "measuredStepSeconds": 0.21,
                               "switchCostSeconds": 0.3, "horizonSteps": 200, "stragglers": ["job-worker-1/0"],
                               "reason": "layers: predicted 0.2 -> 0.15 s/step"}], "enabled": True, "switches": 1}
    merge_patch(job["status"], AdaptiveReport.from_coordinator(decision).to_status())  # as the coordinator patches it
    d, job = step(job, pods, healthy(4), T0 + timedelta(seconds=30))
    events = [(k, r, m) for k, r, m in d.events if r == "StragglerReplan"]
    assert len(events) == 1 and "layers=1+3" in events[0][2] and "job-worker-1/0" in events[0][2]
    assert job["status"]["adaptive"]["switches"] == 1 and job["status"]["adaptive"]["announcedAt"]
    assert crd_validator.errors(crd_validator.default(job)) == []
    d, job = step(job, pods, healthy(4), T0 + timedelta(seconds=60))
    assert not [e for e in d.events if e[1] == "StragglerReplan"]  # announced once


def test_a_notice_already_past_gets_the_reconfiguration_timeout_not_a_past_deadline():
    """A spot notice first seen after its deadline (the operator was down): the plan without the
    pod must not carry a deadline already reached (the ack would be overdue at once): it gets
    spec.elasticity.reconfigurationTimeoutSeconds, as a plan with no notice does."""
    from liveshard.runtime.contract.times import iso, parse_time

    job, pods = running_job()
    t1 = T0 + timedelta(seconds=30)
    nodes = healthy(4)
    old = {**SPOT, "timeAdded": iso(t1 - timedelta(minutes=3))}
    nodes["node-1"] = signals.classify_node({"metadata": {}, "spec": {"taints": [old]}}, t1)
    d, job = step(job, pods, nodes, t1)
    plan = d.status["plan"]
    assert "train-worker-1" not in plan["members"]
    timeout = job["spec"]["elasticity"].get("reconfigurationTimeoutSeconds", 300)
    assert parse_time(plan["deadline"]) == t1 + timedelta(seconds=timeout)
    # a notice with time left keeps its own deadline
    job2, pods2 = running_job()
    nodes["node-1"] = signals.classify_node({"metadata": {}, "spec": {"taints": [{**SPOT, "timeAdded": iso(t1)}]}}, t1)
    d, _ = step(job2, pods2, nodes, t1)
    assert parse_time(d.status["plan"]["deadline"]) == t1 + timedelta(minutes=2)


def test_workers_the_planner_leaves_standing_by_are_not_a_degraded_job():
    """Every desired pod runs and the plan uses fewer (the planner's choice, its explanation
    says why): Degraded stays False (StandbyByChoice). Pods missing: Degraded BelowDesiredSize."""
    job, pods = running_job()
    chosen = copy.deepcopy(job)
    chosen["status"]["plan"]["members"] = job["status"]["plan"]["members"][:2]
    chosen["status"]["plan"]["explanation"] = ["x", "2 of 4 GPUs standby: fewer GPUs are faster"]
    _, after = step(chosen, pods, healthy(4), T0 + timedelta(seconds=10))
    assert after["status"]["plan"]["generation"] == job["status"]["plan"]["generation"]  # no new plan
    degraded = {c["type"]: c for c in after["status"]["conditions"]}["Degraded"]
    assert degraded["status"] == "False" and degraded["reason"] == "StandbyByChoice", degraded
    assert "fewer GPUs are faster" in degraded["message"]
    _, after = step(chosen, [*pods[:2], coordinator()], healthy(4), T0 + timedelta(seconds=10))
    assert after["status"]["phase"] == "Running"
    degraded = {c["type"]: c for c in after["status"]["conditions"]}["Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == "BelowDesiredSize", degraded


@pytest.mark.parametrize("up", [False, True])
def test_a_notice_plan_names_no_pod_still_starting_but_takes_a_standby_that_is_up(up):
    """A pod outside the world whose process has not registered yet (a recreated one imports for
    tens of seconds) would hold a notice's switch until it registered: the plan names the
    members and the pods the runtime reports up (status.standby, matched by uid), and the
    starting pod joins later by a scale-up."""
    job, pods = running_job(3)
    recreated = make_pod(3, uid="pod-3-new")
    pods = [*pods, recreated]
    now = T0 + timedelta(seconds=30)
    nodes = healthy(4)
    if up:
        job["status"]["standby"] = [{"pod": "train-worker-3", "uid": "pod-3-new"}]
    else:  # an earlier pod of the same name was up: its uid does not make this one up
        job["status"]["standby"] = [{"pod": "train-worker-3", "uid": "pod-3"}]
    nodes["node-1"] = signals.classify_node({"metadata": {"name": "node-1"}, "spec": {"taints": [SPOT]}}, now)
    d, job = step(job, pods, nodes, now)
    plan = d.status["plan"]
    assert plan["leaving"] == ["train-worker-1"] and plan["deadline"] is not None
    assert ("train-worker-3" in plan["members"]) is up, plan["members"]
    if not up:  # once acked, the starting pod is a scale-up candidate like any other
        assert set(plan["members"]) == {"train-worker-0", "train-worker-2"}
