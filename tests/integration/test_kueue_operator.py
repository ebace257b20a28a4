"""The real operator (kopf, in a thread) and the stand-in for Kueue's scheduler
(dev/localcluster/kueue_standin.py) against the API emulator with Kueue's CRDs (stand-in copies):
two teams' queues on one spot pool; team A's elastic job waits, is admitted onto a flavor, is
partially preempted by team B's higher-priority job (a live shrink, its Workload lowered in
place), and grows back by a replacement slice when the quota frees, its new pods gated by Kueue's
elastic-job scheduling gate until the slice is admitted."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_operator_emulator import NS, Cluster, Kubelet, Operator, wait_for

from liveshard.dev.localcluster.emulator import KubeEmulator
from liveshard.dev.localcluster.kueue_standin import KueueStandIn
from liveshard.operator import kueue
from liveshard.runtime.contract.crd import GROUP, PLURAL, VERSION

KUEUE_CRDS = sorted((Path(__file__).parents[2] / "dev" / "localcluster" / "kueue").glob("*.yaml"))


@pytest.fixture(scope="module")
def kueue_cluster(crd_path):
    with KubeEmulator(crds=[crd_path, *KUEUE_CRDS]) as kube:
        operator = Operator(kube.url).start()
        cluster = Cluster(kube)
        standin = KueueStandIn(cluster.custom, interval=0.1).start()
        with Kubelet(kube):
            yield cluster, standin
        standin.stop()
        operator.stop()


def create(cluster: Cluster, plural: str, body: dict, namespace: str | None = None) -> None:
    body = {"apiVersion": f"{kueue.GROUP}/{kueue.VERSION}", **body}
    if namespace:
        cluster.custom.create_namespaced_custom_object(kueue.GROUP, kueue.VERSION, namespace, plural, body)
    else:
        cluster.custom.create_cluster_custom_object(kueue.GROUP, kueue.VERSION, plural, body)


def setup_queues(cluster: Cluster) -> None:
    create(cluster, "resourceflavors", {"kind": "ResourceFlavor", "metadata": {"name": "spot"}, "spec": {
        "nodeLabels": {"pool": "spot"}, "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]}})
    create(cluster, "resourceflavors", {"kind": "ResourceFlavor", "metadata": {"name": "on-demand"},
                                        "spec": {"nodeLabels": {"pool": "on-demand"}}})
    create(cluster, "clusterqueues", {"kind": "ClusterQueue", "metadata": {"name": "gpus"}, "spec": {
        "namespaceSelector": {}, "preemption": {"withinClusterQueue": "LowerPriority"},
        "resourceGroups": [
            {"coveredResources": ["nvidia.com/gpu"], "flavors": [
                {"name": "spot", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": 8}]}]},
            {"coveredResources": ["cpu", "memory"], "flavors": [
                {"name": "on-demand", "resources": [{"name": "cpu", "nominalQuota": 4},
                                                    {"name": "memory", "nominalQuota": "16Gi"}]}]}]}})
    for team in ("team-a", "team-b"):  # two teams' queues on one spot pool
        create(cluster, "localqueues", {"kind": "LocalQueue", "metadata": {"name": team, "namespace": NS},
                                        "spec": {"clusterQueue": "gpus"}}, NS)
    create(cluster, "workloadpriorityclasses", {"kind": "WorkloadPriorityClass", "metadata": {"name": "urgent"},
                                                "value": 1000})


def create_job(cluster: Cluster, name: str, replicas: int, labels: dict, annotations: dict | None = None) -> None:
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ElasticTrainingJob",
            "metadata": {"name": name, "namespace": NS, "labels": labels, "annotations": annotations or {}},
            "spec": {"model": {"preset": "gpt-125m"}, "image": "ghcr.io/example/train:1",
                     "workers": {"min": 1, "max": 4, "replicas": replicas, "gpusPerWorker": 2},
                     "training": {"data": {"mock": True}, "trainIters": 1000, "globalBatch": 64},
                     "elasticity": {"scaleUpCooldownSeconds": 1}}}
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, body)


def acked_plan(cluster: Cluster, job: str, members: int) -> dict:
    def check():
        st = cluster.status(job)
        plan = st.get("plan")
        if plan and st.get("appliedGeneration", 0) < plan["generation"]:
            cluster.ack(job)
            return None
        return plan if plan and len(plan["members"]) == members and st.get("phase") == "Running" else None
    return wait_for(check, timeout=30, what=f"{job} running on {members} pods")


def test_queued_admitted_partially_preempted_and_grown_back(kueue_cluster):
    cluster, standin = kueue_cluster
    nodes = [f"gpu-{i}" for i in range(8)]
    cluster.add_nodes(*nodes)
    # queued before its queue exists: no pod, the job shows Kueue's reason
    create_job(cluster, "elastic", 4, {kueue.QUEUE_LABEL: "team-a"}, {kueue.ELASTIC_JOB: "true"})
    status = wait_for(lambda: (st := cluster.status("elastic")).get("phase") == "Suspended"
                      and "Inadmissible" in str(st.get("conditions")) and st, what="a queued job")
    assert cluster.pods("elastic") == {}
    assert "queued in team-a" in status["message"]
    setup_queues(cluster)
    # admitted: its pods, on the admitted flavors
    workers = wait_for(lambda: len(w := cluster.workers("elastic")) == 4 and w, timeout=20, what="admitted pods")
    pod = workers["elastic-worker-0"]
    assert pod.spec.node_selector == {"pool": "spot"}
    assert any(t.key == "spot" for t in pod.spec.tolerations)
    assert cluster.pods("elastic")["elastic-coordinator"].spec.node_selector == {"pool": "on-demand"}
    cluster.schedule("elastic", nodes)
    before = acked_plan(cluster, "elastic", 4)
    # a higher-priority job needs 4 of the 8 GPUs: the elastic job is shrunk live, not restarted
    create_job(cluster, "urgent", 2, {kueue.QUEUE_LABEL: "team-b", kueue.PRIORITY_CLASS_LABEL: "urgent"})
    shrunk = acked_plan(cluster, "elastic", 2)
    assert shrunk["cause"] == "scale-down" and shrunk["generation"] > before["generation"]
    wait_for(lambda: len(_ungated(cluster, "elastic")) == 2, what="released pods")
    wait_for(lambda: len(cluster.workers("urgent")) == 2, timeout=20, what="the urgent job's pods")
    wl = cluster.custom.get_namespaced_custom_object(kueue.GROUP, kueue.VERSION, NS, kueue.WORKLOADS, "etj-urgent")
    assert wl["spec"]["priority"] == 1000
    # the elastic job gave the quota it no longer uses back, and asks for a slice to grow back
    wait_for(lambda: _workers_count(cluster, "etj-elastic") == 2, what="the Workload shrunk in place")
    wait_for(lambda: _exists(cluster, "etj-elastic-s1"), what="a replacement slice")
    # the growth's pods wait behind Kueue's elastic-job gate: the API server refuses to bind them
    gated = wait_for(lambda: len(w := cluster.workers("elastic")) == 4 and sorted(set(w) - set(_ungated(
        cluster, "elastic"))), what="gated pods of the slice asked for")
    assert gated == ["elastic-worker-2", "elastic-worker-3"]
    assert cluster.workers("elastic")["elastic-worker-2"].spec.scheduling_gates[0].name == kueue.ELASTIC_GATE
    # the urgent job ends: the slice is admitted, the gates go and the job grows back live
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "urgent")
    wait_for(lambda: not _exists(cluster, "etj-urgent"), what="the urgent job's Workload collected with it")
    wait_for(lambda: len(_ungated(cluster, "elastic")) == 4, timeout=20, what="pods of the grown slice ungated")
    cluster.schedule("elastic", nodes)
    grown = acked_plan(cluster, "elastic", 4)
    assert grown["cause"] == "scale-up"
    assert any("replaced default/etj-elastic by default/etj-elastic-s1" in line for line in standin.log)


def _ungated(cluster: Cluster, job: str) -> dict:
    return {n: p for n, p in cluster.workers(job).items() if not p.spec.scheduling_gates}


def _workers_count(cluster: Cluster, name: str) -> int | None:
    try:
        wl = cluster.custom.get_namespaced_custom_object(kueue.GROUP, kueue.VERSION, NS, kueue.WORKLOADS, name)
    except Exception:
        return None
    return kueue.podset_count(wl, kueue.PODSET_WORKERS)


def _exists(cluster: Cluster, name: str) -> bool:
    return _workers_count(cluster, name) is not None
