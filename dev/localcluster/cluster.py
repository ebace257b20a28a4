"""A whole Kubernetes cluster on this machine, for the demo, e2e tests and trying kubectl.

* the API emulator (``emulator.KubeEmulator``) on a free loopback port, in a thread of this
  process, with the ElasticTrainingJob CRD registered; its kubeconfig is written to
  ``DIR/kubeconfig``;
* the real operator: ``liveshard operator --server URL`` as a process (log ``DIR/logs/operator.log``);
* the node agent (``node_agent.NodeAgent``), in a thread: fake GPU nodes, pods as processes.

Nodes: ``control-0`` (on-demand, no GPU: where the coordinator goes) and ``gpu-0 ..
gpu-{N-1}`` labelled as Karpenter spot capacity with ``gpus_per_node`` ``nvidia.com/gpu`` each.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Any

from liveshard.dev.localcluster.emulator import KubeEmulator
from liveshard.dev.localcluster.node_agent import NodeAgent

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "elastictrainingjob.yaml"


def crd_path() -> Path:
    if CRD_PATH.exists():
        return CRD_PATH
    # an installed wheel: the CRD is not package data; look next to the working directory
    local = Path.cwd() / "crds" / "elastictrainingjob.yaml"
    if local.exists():
        return local
    from liveshard.runtime.errors import ConfigError

    raise ConfigError("crds/elastictrainingjob.yaml", "the CRD file was not found",
                      "run from the liveshard source tree")


class LocalCluster:
    def __init__(self, workdir: str | Path, nodes: int = 4, gpus_per_node: int = 1,
                 operator_args: tuple[str, ...] = ()) -> None:
        self.dir = Path(workdir).resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "logs").mkdir(exist_ok=True)
        self.nodes = nodes
        self.gpus_per_node = gpus_per_node
        self.operator_args = operator_args
        self.kube = KubeEmulator(crds=[crd_path()])
        self.kubeconfig = self.dir / "kubeconfig"
        self.operator: subprocess.Popen | None = None
        self.agent: NodeAgent | None = None
        self.api: Any = None

    def start(self) -> LocalCluster:
        self.kube.start()
        self.kube.write_kubeconfig(self.kubeconfig)
        self.api = self.kube.api_client()
        self.agent = NodeAgent(self.api, self.dir, kubeconfig=self.kubeconfig)
        self.kube.emulator.pod_logs = self.agent.pod_log  # kubectl logs reads the agent's files
        self.agent.add_node("control-0", gpus=0, labels={"karpenter.sh/capacity-type": "on-demand"})
        for i in range(self.nodes):
            self.add_gpu_node(f"gpu-{i}")
        self.agent.start()
        with open(self.dir / "logs" / "operator.log", "ab") as out:
            self.operator = subprocess.Popen(
                [sys.executable, "-m", "liveshard.runtime.cli", "operator", "--server", self.kube.url,
                 "--metrics-port", "0", "--liveness", "", *self.operator_args],
                stdout=out, stderr=subprocess.STDOUT)
        return self

    def add_gpu_node(self, name: str) -> None:
        assert self.agent is not None
        self.agent.add_node(name, gpus=self.gpus_per_node, labels={"karpenter.sh/capacity-type": "spot"})

    def operator_alive(self) -> bool:
        return self.operator is not None and self.operator.poll() is None

    def stop_operator(self) -> None:
        """End the operator process (SIGTERM, then SIGKILL after 15 s); the cluster stays up."""
        if self.operator is not None and self.operator.poll() is None:
            self.operator.terminate()
            try:
                self.operator.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.operator.kill()
                self.operator.wait(timeout=10)

    def stop(self) -> None:
        self.stop_operator()
        if self.agent is not None:
            self.agent.stop()
        with contextlib.suppress(Exception):
            self.kube.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

