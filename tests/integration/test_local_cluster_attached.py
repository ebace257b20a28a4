"""``LocalCluster(kubeconfig=...)``: the node agent and the operator against an API server that is
not the emulator's own (here a second emulator stands in for a real cluster with kubelets)."""

from __future__ import annotations

import time

import kubernetes.client as k8s
import pytest

from liveshard.dev.localcluster.cluster import LocalCluster, crd_path
from liveshard.dev.localcluster.emulator import KubeEmulator, run_pod
from liveshard.runtime.contract.crd import LABEL_JOB

pytestmark = pytest.mark.slow


def wait_for(check, timeout: float = 20.0, what: str = "it"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def pod(name: str, labels: dict, node: str | None = None) -> dict:
    spec = {"containers": [{"name": "c", "image": "busybox", "command": ["sh", "-c", "sleep 60"]}],
            "restartPolicy": "Never"}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": spec}


def test_attached_to_another_api_server_the_agent_keeps_to_its_own_nodes_and_liveshards_pods(tmp_path):
    with KubeEmulator() as server:  # no CRD yet, as on a fresh cluster
        kubeconfig = server.write_kubeconfig(tmp_path / "real.kubeconfig")
        core = k8s.CoreV1Api(server.api_client())
        # the cluster's own node, with a kubelet of its own and a pod bound to it
        core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "real-node"}})
        core.create_namespaced_pod("default", pod("kube-proxy-x", {"app": "proxy"}))
        run_pod(core, "default", "kube-proxy-x", "real-node")
        cluster = LocalCluster(tmp_path / "lc", nodes=1, kubeconfig=kubeconfig, operator=False).start()
        try:
            assert cluster.server == server.url and cluster.kubeconfig == kubeconfig.resolve()
            k8s.ApiextensionsV1Api(server.api_client()).read_custom_resource_definition(
                "elastictrainingjobs.liveshard.io")  # created on the server
            assert crd_path().exists()
            nodes = {n.metadata.name for n in core.list_node().items}
            assert nodes == {"real-node", "liveshard-local-control-0", "liveshard-local-gpu-0"}
            # a liveshard pod is scheduled onto the agent's nodes and run here; a DaemonSet's pod
            # bound to one of them is left alone; the real node's pod is not the agent's business
            core.create_namespaced_pod("default", pod("ours", {LABEL_JOB: "j"}))
            core.create_namespaced_pod("default", pod("ds-pod", {"app": "ds"}, node="liveshard-local-gpu-0"))
            ours = wait_for(lambda: (p := core.read_namespaced_pod("ours", "default")).status.phase == "Running" and p,
                            what="our pod running")
            assert ours.spec.node_name.startswith("liveshard-local-")
            time.sleep(1.0)
            assert core.read_namespaced_pod("ds-pod", "default").status.phase == "Pending"
            real = core.read_namespaced_pod("kube-proxy-x", "default")
            assert real.status.phase == "Running" and real.metadata.deletion_timestamp is None
            lease = k8s.CoordinationV1Api(server.api_client()).read_namespaced_lease(
                "liveshard-local-gpu-0", "kube-node-lease")
            assert lease.spec.holder_identity == "liveshard-local-gpu-0"
            with pytest.raises(k8s.exceptions.ApiException):
                k8s.CoordinationV1Api(server.api_client()).read_namespaced_lease("real-node", "kube-node-lease")
        finally:
            cluster.stop()
        # its nodes are taken back; the cluster's own stays
        assert {n.metadata.name for n in core.list_node().items} == {"real-node"}
        assert core.read_namespaced_pod("kube-proxy-x", "default").status.phase == "Running"
