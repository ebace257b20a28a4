"""Signal classification on Node and Pod objects shaped like the ones real clusters return."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta

import pytest

from liveshard.operator import signals
from liveshard.operator.signals import acts_on, classify_node, classify_pod
from liveshard.runtime.contract.causes import Cause

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
T0 = "2026-03-01T11:59:30Z"


def node(name="ip-10-0-12-34.ec2.internal", taints=(), conditions=None, labels=None, annotations=None,
         unschedulable=False):
    """A GPU node as ``kubectl get node -o json`` shows it (abridged to the fields that matter)."""
    ready = [{"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory",
              "lastHeartbeatTime": T0, "lastTransitionTime": "2026-03-01T08:00:00Z"},
             {"type": "Ready", "status": "True", "reason": "KubeletReady",
              "message": "kubelet is posting ready status", "lastHeartbeatTime": T0,
              "lastTransitionTime": "2026-03-01T08:00:00Z"}]
    obj = {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "uid": "5c1f", "resourceVersion": "812736",
                     "labels": {"kubernetes.io/arch": "amd64", "node.kubernetes.io/instance-type": "p5.48xlarge",
                                "topology.kubernetes.io/zone": "us-east-1a", "nvidia.com/gpu.count": "8",
                                "nvidia.com/gpu.memory": "81559", **(labels or {})},
                     "annotations": {"node.alpha.kubernetes.io/ttl": "0", **(annotations or {})}},
        "spec": {"providerID": "aws:///us-east-1a/i-0abc", "taints": list(taints)},
        "status": {"capacity": {"nvidia.com/gpu": "8", "cpu": "192"},
                   "conditions": conditions if conditions is not None else ready},
    }
    if unschedulable:
        obj["spec"]["unschedulable"] = True
    return obj


def pod(phase="Running", conditions=(), deletion=None, reason=None, message=None, grace=120):
    obj = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "train-worker-3", "namespace": "ml", "uid": "u-3",
                     "labels": {"liveshard.io/job": "train", "liveshard.io/role": "worker"}},
        "spec": {"nodeName": "ip-10-0-12-34.ec2.internal", "terminationGracePeriodSeconds": grace},
        "status": {"phase": phase, "conditions": [
            {"type": "Initialized", "status": "True", "lastTransitionTime": "2026-03-01T08:01:00Z"},
            {"type": "Ready", "status": "True", "lastTransitionTime": "2026-03-01T08:02:00Z"},
            *conditions]},
    }
    if deletion:
        obj["metadata"]["deletionTimestamp"] = deletion
        obj["metadata"]["deletionGracePeriodSeconds"] = grace
    if reason:
        obj["status"]["reason"] = reason
    if message:
        obj["status"]["message"] = message
    return obj


CORDON_TAINT = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule", "timeAdded": T0}


# ---- nodes: healthy ---------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [
    {},
    {"labels": {"karpenter.sh/capacity-type": "spot", "eks.amazonaws.com/capacityType": "SPOT"}},
    {"taints": [{"key": "kubernetes.azure.com/scalesetpriority", "value": "spot", "effect": "NoSchedule"}],
     "labels": {"kubernetes.azure.com/scalesetpriority": "spot"}},
    {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]},
    {"taints": [{"key": "DeletionCandidateOfClusterAutoscaler", "value": "1772366370",
                 "effect": "PreferNoSchedule"}]},
    {"labels": {"cloud.google.com/gke-spot": "true"}},
])
def test_a_healthy_node_is_not_going_away_even_on_spot_capacity(extra):
    assert classify_node(node(**extra), NOW) is None


# ---- AWS --------------------------------------------------------------------------------------
def test_nth_spot_interruption_beats_the_cordon_it_comes_with_and_has_a_two_minute_deadline():
    n = node(unschedulable=True, taints=[
        CORDON_TAINT,
        {"key": "aws-node-termination-handler/spot-itn", "value": "spot-itn-d1b2c3e4f5a6b7c8d9e0",
         "effect": "NoSchedule"},
    ])
    sig = classify_node(n, NOW)
    assert sig.kind == Cause.SPOT_INTERRUPTION
    assert sig.deadline == NOW + timedelta(minutes=2)
    assert not sig.failure and sig.preemption
    assert "aws-node-termination-handler/spot-itn" in sig.source


@pytest.mark.parametrize("event,kind", [
    ("rebalance-recommendation", Cause.REBALANCE_RECOMMENDATION),
    ("scheduled-maintenance", Cause.SCHEDULED_MAINTENANCE),
    ("asg-lifecycle-termination", Cause.SCALE_IN),
])
def test_nth_other_events(event, kind):
    sig = classify_node(node(taints=[{"key": f"aws-node-termination-handler/{event}",
                                      "value": f"{event}-8f1e2d", "effect": "NoSchedule"}]), NOW)
    assert sig.kind == kind and not sig.failure


def test_cluster_autoscaler_scale_in():
    sig = classify_node(node(taints=[{"key": "ToBeDeletedByClusterAutoscaler", "value": "1772366370",
                                      "effect": "NoSchedule"}]), NOW)
    assert sig.kind == Cause.SCALE_IN and not sig.failure


# ---- Karpenter --------------------------------------------------------------------------------
def test_karpenter_v1_disrupted_takes_its_deadline_from_the_nodeclaim_annotation():
    n = node(taints=[{"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}],
             annotations={"karpenter.sh/nodeclaim-termination-timestamp": "2026-03-01T12:10:00Z"},
             labels={"karpenter.sh/capacity-type": "spot", "karpenter.sh/nodepool": "gpu"})
    sig = classify_node(n, NOW)
    assert sig.kind == Cause.DISRUPTION
    assert sig.deadline == datetime(2026, 3, 1, 12, 10, tzinfo=UTC)
    assert not sig.failure


def test_karpenter_v0_disruption_taint():
    sig = classify_node(node(taints=[{"key": "karpenter.sh/disruption", "value": "disrupting",
                                      "effect": "NoSchedule"}]), NOW)
    assert sig.kind == Cause.DISRUPTION and sig.deadline is None
    # the same key with another value is not a disruption
    assert classify_node(node(taints=[{"key": "karpenter.sh/disruption", "value": "candidate",
                                       "effect": "NoSchedule"}]), NOW) is None


# ---- GKE --------------------------------------------------------------------------------------
def test_gke_impending_termination_has_thirty_seconds():
    n = node(name="gke-train-spot-a100-5c2f-xk2d", labels={"cloud.google.com/gke-spot": "true"},
             taints=[{"key": "cloud.google.com/impending-node-termination", "effect": "NoSchedule",
                      "timeAdded": "2026-03-01T11:59:50Z"}])
    sig = classify_node(n, NOW)
    assert sig.kind == Cause.SPOT_INTERRUPTION
    assert sig.deadline == datetime(2026, 3, 1, 12, 0, 20, tzinfo=UTC)


def test_graceful_node_shutdown_is_a_preemption_not_a_failure():
    n = node(conditions=[{"type": "Ready", "status": "False", "reason": "KubeletNotReady",
                          "message": "node is shutting down", "lastTransitionTime": "2026-03-01T11:59:55Z"}])
    sig = classify_node(n, NOW)
    assert sig.kind == Cause.SPOT_INTERRUPTION and not sig.failure


# ---- AKS --------------------------------------------------------------------------------------
@pytest.mark.parametrize("message,kind", [
    ("VM event Preempt scheduled at Sun, 01 Mar 2026 12:00:30 GMT", Cause.SPOT_INTERRUPTION),
    ("VM event Terminate scheduled", Cause.SCHEDULED_MAINTENANCE),
    ("VM event Redeploy scheduled", Cause.SCHEDULED_MAINTENANCE),
    ("VM event Freeze scheduled", None),
    ("VM event Reboot scheduled", None),
])
def test_aks_scheduled_events_from_node_problem_detector(message, kind):
    conditions = [
        {"type": "VMEventScheduled", "status": "True", "reason": "VMEventScheduled", "message": message,
         "lastTransitionTime": "2026-03-01T11:59:58Z"},
        {"type": "Ready", "status": "True", "reason": "KubeletReady", "lastTransitionTime": "2026-03-01T08:00:00Z"},
    ]
    sig = classify_node(node(name="aks-gpuspot-31415926-vmss000002", conditions=conditions), NOW)
    assert (sig.kind if sig else None) == kind


def test_aks_message_wording_variants():
    for message in ("Preemption scheduled for VM aks-gpuspot-31415926-vmss000002", "PREEMPT event scheduled"):
        conditions = [{"type": "VMEventScheduled", "status": "True", "message": message,
                       "lastTransitionTime": "2026-03-01T11:59:58Z"}]
        assert classify_node(node(conditions=conditions), NOW).kind == Cause.SPOT_INTERRUPTION
    conditions = [{"type": "VMEventScheduled", "status": "False", "message": "no VM event scheduled"}]
    assert classify_node(node(conditions=conditions), NOW) is None


def test_a_node_being_deleted_is_going_away():
    n = node(annotations={"karpenter.sh/nodeclaim-termination-timestamp": "2026-03-01T12:05:00Z"})
    n["metadata"]["deletionTimestamp"] = "2026-03-01T11:59:59Z"
    n["metadata"]["finalizers"] = ["karpenter.sh/termination"]
    sig = classify_node(n, NOW)
    assert sig.kind == Cause.DISRUPTION and sig.deadline == datetime(2026, 3, 1, 12, 5, tzinfo=UTC)


def test_aks_node_auto_drain_taint():
    sig = classify_node(node(taints=[{"key": "remediator.kubernetes.azure.com/unschedulable",
                                      "effect": "NoSchedule"}]), NOW)
    assert sig.kind == Cause.DISRUPTION


# ---- Kubernetes itself ------------------------------------------------------------------------
def test_cordon_alone():
    sig = classify_node(node(unschedulable=True, taints=[CORDON_TAINT]), NOW)
    assert sig.kind == Cause.CORDON and sig.deadline is None and not sig.failure
    assert classify_node(node(unschedulable=True), NOW).kind == Cause.CORDON


def test_not_ready_and_unreachable_are_failures_with_the_eviction_deadline():
    n = node(conditions=[{"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
                          "message": "Kubelet stopped posting node status.",
                          "lastTransitionTime": "2026-03-01T11:59:00Z"}],
             taints=[{"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule", "timeAdded": "2026-03-01T11:59:00Z"},
                     {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute", "timeAdded": "2026-03-01T11:59:05Z"}])
    sig = classify_node(n, NOW)
    assert sig.kind == Cause.UNREACHABLE and sig.failure
    assert sig.deadline == datetime(2026, 3, 1, 12, 4, tzinfo=UTC)  # Ready condition: 11:59:00 + 300 s
    n2 = node(conditions=[{"type": "Ready", "status": "False", "reason": "KubeletNotReady",
                           "message": "container runtime network not ready", "lastTransitionTime": T0}])
    assert classify_node(n2, NOW).kind == Cause.NOT_READY


def test_out_of_service_is_immediate():
    sig = classify_node(node(taints=[{"key": "node.kubernetes.io/out-of-service", "value": "nodeshutdown",
                                      "effect": "NoExecute", "timeAdded": T0}]), NOW)
    assert sig.kind == Cause.OUT_OF_SERVICE
    assert sig.deadline == datetime(2026, 3, 1, 11, 59, 30, tzinfo=UTC)


def test_the_earliest_deadline_wins_when_several_signals_stack():
    n = node(taints=[{"key": "aws-node-termination-handler/rebalance-recommendation", "effect": "NoSchedule"},
                     {"key": "karpenter.sh/disrupted", "effect": "NoSchedule"},
                     {"key": "aws-node-termination-handler/spot-itn", "effect": "NoSchedule", "timeAdded": T0}],
             annotations={"karpenter.sh/nodeclaim-termination-timestamp": "2026-03-01T12:30:00Z"})
    sig = classify_node(n, NOW)
    assert sig.kind == Cause.SPOT_INTERRUPTION
    assert sig.deadline == datetime(2026, 3, 1, 12, 1, 30, tzinfo=UTC)


def test_classification_does_not_modify_the_node():
    n = node(unschedulable=True, taints=[CORDON_TAINT])
    before = copy.deepcopy(n)
    classify_node(n, NOW)
    assert n == before


# ---- pods -------------------------------------------------------------------------------------
def test_a_running_pod_is_not_going_away():
    assert classify_pod(pod(), NOW) is None


def test_eviction_disruption_target_uses_the_deletion_timestamp():
    p = pod(conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
                         "message": "Eviction API: evicting", "lastTransitionTime": T0}],
            deletion="2026-03-01T12:01:30Z")
    sig = classify_pod(p, NOW)
    assert sig.kind == Cause.POD_DISRUPTION and not sig.failure
    assert sig.deadline == datetime(2026, 3, 1, 12, 1, 30, tzinfo=UTC)
    assert "Eviction API" in sig.reason


def test_scheduler_preemption_without_deletion_timestamp_uses_the_grace_period():
    p = pod(conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler",
                         "lastTransitionTime": T0}], grace=60)
    sig = classify_pod(p, NOW)
    assert sig.kind == Cause.POD_DISRUPTION
    assert sig.deadline == datetime(2026, 3, 1, 12, 0, 30, tzinfo=UTC)


def test_plain_deletion():
    sig = classify_pod(pod(deletion="2026-03-01T12:02:00Z"), NOW)
    assert sig.kind == Cause.POD_DELETION and not sig.failure


@pytest.mark.parametrize("reason,message,failure", [
    ("Shutdown", "Pod was terminated in response to imminent node shutdown.", False),
    ("Terminated", "Pod was terminated in response to imminent node shutdown.", False),
    ("Evicted", "The node was low on resource: memory.", False),
    (None, None, True),  # the container exited with an error
])
def test_failed_pods_count_as_failures_only_when_not_taken_away(reason, message, failure):
    sig = classify_pod(pod(phase="Failed", reason=reason, message=message), NOW)
    assert sig.kind == Cause.POD_FAILED
    assert sig.failure is failure


def test_a_failed_pod_with_a_disruption_target_is_a_preemption():
    p = pod(phase="Failed", conditions=[{"type": "DisruptionTarget", "status": "True",
                                         "reason": "DeletionByTaintManager", "lastTransitionTime": T0}])
    assert classify_pod(p, NOW).failure is False


def test_a_worker_that_exited_cleanly_is_not_a_failure():
    assert classify_pod(pod(phase="Succeeded"), NOW).failure is False


def exited(code, message=None):
    """A pod whose container exited as the kubelet reports it (no pod-level reason or message)."""
    p = pod(phase="Succeeded" if code == 0 else "Failed")
    terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}
    if message is not None:
        terminated["message"] = message
    p["status"]["containerStatuses"] = [{"name": "worker", "state": {"terminated": terminated}}]
    return p


def test_a_failed_container_says_its_exit_code_and_its_one_line():
    tail = ("[rank0] loading the tokenizer\n"
            "liveshard worker: error: spec.training.data.tokenizer: /data/tok.json does not exist (fix: ...)\n"
            "WARNING local worker 1/2 (pid 12) ended: exit code 2; 0 still running\n")
    sig = classify_pod(exited(2, tail), NOW)
    assert sig.failure and sig.exit_code == 2
    assert sig.termination == "liveshard worker: error: spec.training.data.tokenizer: /data/tok.json does not " \
                              "exist (fix: ...)"  # the runtime's error line, not the supervisor's after it
    assert sig.reason == f"worker pod failed: exit code 2: {sig.termination}"
    # no error line: the last line of the tail; no message: the exit code alone
    assert classify_pod(exited(1, "Traceback ...\n  File x\nKeyError: 'a'\n\n"), NOW).termination == "KeyError: 'a'"
    bare = classify_pod(exited(137), NOW)
    assert (bare.exit_code, bare.termination, bare.reason) == (137, "", "worker pod failed: exit code 137 (SIGKILL)")
    # a pod the kubelet stopped itself says so in the pod's own message, which comes first
    evicted = exited(137)
    evicted["status"].update(reason="Evicted", message="The node was low on resource: memory.")
    assert classify_pod(evicted, NOW).reason == "worker pod failed: The node was low on resource: memory."


def test_the_operators_pod_snapshot_keeps_how_the_container_stopped():
    from liveshard.operator.handlers.pods import snapshot

    p = exited(2, "reading\nliveshard worker: error: bad\n")
    p["status"]["containerStatuses"][0]["state"]["terminated"]["startedAt"] = T0
    snap = snapshot(p)
    assert snap["status"]["containerStatuses"] == [{"name": "worker", "state": {"terminated": {
        "exitCode": 2, "reason": "Error", "message": "reading\nliveshard worker: error: bad\n"}}}]
    assert classify_pod(snap, NOW) == classify_pod(p, NOW)


def test_a_termination_line_is_one_bounded_line():
    assert signals.termination_line("a\n  c  \n") == "c"
    assert signals.termination_line("x\nliveshard worker: error: a \t b\n") == "liveshard worker: error: a b"
    long = signals.termination_line("liveshard worker: error: " + "x" * 2000)
    assert len(long) == signals.TERMINATION_LINE_MAX and long.endswith("...")
    assert signals.termination_line("") == signals.termination_line("\n \n") == ""


# ---- policy -----------------------------------------------------------------------------------
def test_policy_filters_node_signals_but_never_pod_loss():
    cordon = classify_node(node(unschedulable=True), NOW)
    assert not acts_on(cordon, {Cause.SPOT_INTERRUPTION})
    assert acts_on(cordon, {Cause.CORDON})
    gone = classify_pod(pod(phase="Failed"), NOW)
    assert acts_on(gone, set())
    assert acts_on(signals.node_gone("n1", NOW), set())


def test_parse_time_forms():
    assert signals.parse_time("2026-03-01T12:00:00Z") == NOW
    assert signals.parse_time("2026-03-01T12:00:00.000000Z") == NOW
    assert signals.parse_time("1772366400") == NOW
    assert signals.parse_time("not a time") is None
    assert signals.parse_time(None) is None
