"""One authority per event, in the operator's decision: a loss without notice is the runtime's
to plan; the status shows the world the runtime committed (``status.world``); a job below its
``minDataParallel`` grows back at once with the pods standing by."""

from __future__ import annotations

import copy
from dataclasses import replace
from datetime import timedelta

from test_operator_reconcile import SPOT, T0, ack, coordinator, healthy, make_job, make_pod, step

from liveshard.operator import signals
from liveshard.runtime.contract.causes import Cause
from liveshard.runtime.contract.status import CommittedWorld, StatusPlan
from liveshard.runtime.contract.times import parse_time

W = [f"train-worker-{i}" for i in range(4)]


def with_world(job, generation, members, config, plan_generation=None, cause=None, reason="", at=T0):
    """The coordinator's report of the world it committed (``kube_source``)."""
    job = copy.deepcopy(job)
    world = CommittedWorld(generation, config, tuple(members), len(members), plan_generation, cause, reason, at)
    job["status"].update(world.to_status())
    return job


def standby_job():
    """Three 1-GPU pods, minDataParallel 2: the planner trains dp=2 on two and keeps the third
    standing by (fewer GPUs are faster for this model); its first plan runs."""
    job = make_job(max_workers=3, gpus=1, parallelism={"minDataParallel": 2, "distributedOptimizer": False})
    pods = [make_pod(i) for i in range(3)] + [coordinator()]
    d, job = step(job, pods, healthy(3))
    plan = d.status["plan"]
    assert plan["members"] == W[:2] and ",dp=2," in plan["config"], plan
    assert plan["memberUids"] == {"train-worker-0": "pod-0", "train-worker-1": "pod-1"}
    job = with_world(ack(job), 0, W[:2], plan["config"], plan_generation=1)
    job["status"]["standby"] = [{"pod": W[2], "uid": "pod-2"}]  # the coordinator: its process is up
    d, job = step(job, pods, healthy(3), T0 + timedelta(seconds=5))
    assert job["status"]["phase"] == "Running" and job["status"]["worldSize"] == 2
    return job, pods


def test_a_node_lost_without_notice_is_not_planned_by_the_operator():
    job, pods = standby_job()
    nodes = healthy(3)
    del nodes["node-1"]  # kubectl delete node: its pod's process is gone
    d, after = step(job, pods, nodes, T0 + timedelta(seconds=10))
    assert d.replan_reason is None and "plan" not in d.status
    assert after["status"]["worldSize"] == 2  # what runs until the runtime says otherwise
    assert d.delete_pods == []  # a member: deleted once the world without it is recorded


def test_the_runtimes_recovery_is_the_status_and_the_standby_joins_at_once():
    """The runtime recovered to dp=1 on its own: the status shows that world (recorded as an
    observed plan, applied), and the job, below minDataParallel with a pod standing by, grows
    back in the same pass (no scale-up cooldown)."""
    job, pods = standby_job()
    nodes = healthy(3)
    del nodes["node-1"]
    config = job["status"]["plan"]["config"].replace("dp=2", "dp=1")
    job = with_world(job, 1, W[:1], config, cause=Cause.LOST_WITHOUT_NOTICE,
                     reason="lost train-worker-1/0 without notice", at=T0 + timedelta(seconds=10))
    d, after = step(job, pods, nodes, T0 + timedelta(seconds=11))
    st = after["status"]
    assert st["worldSize"] == 1  # the world that runs, at once
    observed = st["history"][-2]
    assert observed["outcome"] == "Observed" and observed["runtimeGeneration"] == 1
    assert observed["to"] == config and observed["worldSize"] == 1
    assert any(e[1] == "RuntimeReconfigured" for e in d.events)
    # the grow-back plan: dp=2 again with the standby, written now although the cooldown is 60 s
    plan = StatusPlan.from_status(st)
    assert plan.generation == observed["generation"] + 1 and plan.cause == Cause.SCALE_UP
    assert plan.members == (W[0], W[2]) and ",dp=2," in plan.config and plan.joining == (W[2],)
    assert "grow back" in plan.reason and plan.observed_world is None
    assert d.replan_reason == Cause.SCALE_UP
    assert d.delete_pods == [W[1]]  # not in the world that runs: nothing waits for it
    assert st["phase"] == "Reconfiguring"


def test_a_recorded_world_is_recorded_once_and_an_abort_of_the_regrow_waits_its_backoff():
    job, pods = standby_job()
    nodes = healthy(3)
    del nodes["node-1"]
    config = job["status"]["plan"]["config"].replace("dp=2", "dp=1")
    job = with_world(job, 1, W[:1], config, cause=Cause.LOST_WITHOUT_NOTICE)
    _, job = step(job, pods, nodes, T0 + timedelta(seconds=11))
    regrow = job["status"]["plan"]["generation"]
    job["status"]["abortedGeneration"] = regrow
    job["status"]["abortReason"] = "aborted: member train-worker-2/0 died during the transition"
    d, job = step(job, pods, nodes, T0 + timedelta(seconds=12))
    assert d.replan_reason is None and job["status"]["plan"]["generation"] == regrow  # nothing recorded again
    assert job["status"]["history"][-1]["outcome"] == "Aborted"
    d, job = step(job, pods, nodes, T0 + timedelta(seconds=45))
    assert d.replan_reason == Cause.RETRY and job["status"]["plan"]["generation"] == regrow + 1


def test_a_world_the_runtime_made_while_a_plan_is_on_its_way_shows_at_once_and_is_recorded_if_that_plan_fails():
    job, pods = standby_job()
    nodes = healthy(3)
    nodes["node-0"] = signals.classify_node({"metadata": {}, "spec": {"taints": [SPOT]}}, T0)
    _, job = step(job, pods, nodes, T0 + timedelta(seconds=10))  # the operator's plan for the notice
    spot = job["status"]["plan"]
    assert spot["cause"] == "spot-interruption" and W[0] not in spot["members"]
    # meanwhile the runtime lost train-worker-1 without notice and recovered on train-worker-0
    job = with_world(job, 1, W[:1], "tp=1,pp=1,dp=1", cause=Cause.LOST_WITHOUT_NOTICE)
    _, job = step(job, pods, nodes, T0 + timedelta(seconds=11))
    assert job["status"]["plan"]["generation"] == spot["generation"]  # the plan stays on its way
    assert job["status"]["worldSize"] == 1  # but the status says what runs
    job["status"]["abortedGeneration"] = spot["generation"]
    _, job = step(job, pods, nodes, T0 + timedelta(seconds=12))
    assert [h for h in job["status"]["history"] if h.get("outcome") == "Observed" and h["runtimeGeneration"] == 1]


def test_a_plan_not_yet_running_that_names_a_pod_lost_since_is_replaced():
    job, pods = standby_job()
    nodes = healthy(3)
    nodes["node-0"] = signals.classify_node({"metadata": {}, "spec": {"taints": [SPOT]}}, T0)
    _, job = step(job, pods, nodes, T0 + timedelta(seconds=10))
    spot = job["status"]["plan"]
    assert W[2] in spot["members"]
    failed = copy.deepcopy(pods)
    failed[2]["status"] = {"phase": "Failed", "reason": "Error"}
    d, job = step(job, failed, nodes, T0 + timedelta(seconds=11))
    assert d.replan_reason == Cause.RETRY and "lost without notice" in job["status"]["plan"]["reason"]
    assert W[2] not in job["status"]["plan"]["members"]


def test_a_member_on_a_node_that_stopped_answering_is_the_liveness_judges_to_call():
    """NotReady says nothing certain about the workers there: the member stays in the plans
    (the runtime's heartbeats decide), while a new pod there would not be added."""
    job, pods = standby_job()
    nodes = healthy(3)
    nodes["node-1"] = signals.classify_node({"metadata": {}, "status": {"conditions": [
        {"type": "Ready", "status": "Unknown", "lastTransitionTime": "2026-03-01T11:59:00Z"}]}}, T0)
    d, job = step(job, pods, nodes, T0 + timedelta(seconds=30))
    assert d.replan_reason is None and d.delete_pods == []


def test_a_coordinator_that_reports_the_operators_plan_changes_nothing():
    """A restarted coordinator's report has no planGeneration for the world it adopted: a world
    that is the current plan is not recorded again."""
    job, pods = standby_job()
    plan = job["status"]["plan"]
    job = with_world(job, 0, plan["members"], plan["config"])
    d, after = step(job, pods, healthy(3), T0 + timedelta(seconds=20))
    assert "plan" not in d.status and after["status"]["worldSize"] == 2


def test_an_observed_world_keeps_its_commit_time():
    job, pods = standby_job()
    nodes = healthy(3)
    del nodes["node-1"]
    at = T0 + timedelta(seconds=9)
    job = with_world(job, 1, W[:1], "tp=1,pp=1,dp=1", cause=Cause.LOST_WITHOUT_NOTICE, at=at)
    _, job = step(job, [*pods[:1], *pods[2:]], nodes, T0 + timedelta(seconds=20))
    observed = job["status"]["history"][-2]
    assert parse_time(observed["appliedAt"]) == at and observed["seconds"] == 0.0


def test_a_pod_the_runtime_left_out_is_not_taken_back_while_its_nodes_signal_settles():
    """The node went unreachable (its processes died): the runtime recovered without the pod at
    once, while the node's withdrawable signal still settles (debounce). The grow-back must not
    name that pod (the same pod, by uid): only the one standing by."""
    job = make_job(max_workers=4, gpus=1, parallelism={"minDataParallel": 2, "distributedOptimizer": False},
                   training={"data": {"mock": True}, "trainIters": 1000, "globalBatch": 48})
    pods = [make_pod(i) for i in range(4)] + [coordinator()]
    d, job = step(job, pods, healthy(4))
    first = d.status["plan"]
    job = with_world(ack(job), 0, first["members"], first["config"], plan_generation=1)
    _, job = step(job, pods, healthy(4), T0 + timedelta(seconds=5))
    members = first["members"]
    lost = members[-1]
    survivors = members[:-1]
    nodes = healthy(4)
    node = f"node-{lost.rsplit('-', 1)[1]}"
    nodes[node] = signals.classify_node({"metadata": {}, "status": {"conditions": [
        {"type": "Ready", "status": "Unknown", "lastTransitionTime": "2026-03-01T12:00:09Z"}]}},
        T0 + timedelta(seconds=10))
    nodes[node] = replace(nodes[node], seen=T0 + timedelta(seconds=10))  # first seen now: it settles
    job = with_world(job, 1, survivors, first["config"].replace(f"dp={len(members)}", f"dp={len(survivors)}"),
                     cause=Cause.LOST_WITHOUT_NOTICE)
    _, job = step(job, pods, nodes, T0 + timedelta(seconds=11))  # the signal settles for 5 s more
    plan = job["status"]["plan"]
    assert lost not in plan["members"]


def test_a_world_the_straggler_policy_made_is_recorded_and_not_undone():
    """The runtime's straggler policy moved a slow pod out of the world: that world is recorded
    too (the status shows what runs), but it is no loss to grow back from, and the operator does
    not take the pod the policy left out back into its next plan."""
    job = make_job(max_workers=4, gpus=1, elasticity={"scaleUpCooldownSeconds": 0})
    pods = [make_pod(i) for i in range(4)] + [coordinator()]
    d, job = step(job, pods, healthy(4))
    first = d.status["plan"]
    assert len(first["members"]) == 4
    job = with_world(ack(job), 0, first["members"], first["config"], plan_generation=1)
    _, job = step(job, pods, healthy(4), T0 + timedelta(seconds=5))
    slow = first["members"][-1]
    job = with_world(job, 1, first["members"][:3], first["config"].replace("dp=4", "dp=3"), cause=Cause.STRAGGLER,
                     reason=f"straggler: {slow}/0 at 0.4 of the median")
    d, job = step(job, pods, healthy(4), T0 + timedelta(seconds=60))
    plan = StatusPlan.from_status(job["status"])
    assert plan.observed_world == 1 and plan.cause == Cause.STRAGGLER and plan.leaving == (slow,)
    assert d.replan_reason is None and slow not in plan.members
    d, _ = step(job, pods, healthy(4), T0 + timedelta(seconds=120))
    assert d.replan_reason is None
