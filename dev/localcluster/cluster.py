"""A whole Kubernetes cluster on this machine, for the demo, e2e tests and trying kubectl.

* the API emulator (``emulator.KubeEmulator``) on a free loopback port, in a thread of this
  process, with the ElasticTrainingJob CRD registered; its kubeconfig is written to
  ``DIR/kubeconfig``;
* the real operator: ``liveshard operator --server URL`` as a process (log ``DIR/logs/operator.log``),
  serving its validating admission webhook on a loopback port with a self-signed certificate
  (``DIR/webhook/``), registered as a ValidatingWebhookConfiguration by URL, so ``kubectl apply``
  is answered as on a cluster with the Helm chart (refusals, deprecation warnings);
* the node agent (``node_agent.NodeAgent``), in a thread: fake GPU nodes, pods as processes;
* with ``kueue=True``: Kueue's CRDs (stand-in copies) and a stand-in for Kueue's scheduler
  (``kueue_standin.KueueStandIn``) in a thread, with a ClusterQueue ``local`` (the GPU nodes'
  GPUs as quota) and a LocalQueue ``default``.

Nodes: ``control-0`` (on-demand, no GPU: where the coordinator goes) and ``gpu-0 ..
gpu-{N-1}`` labelled as Karpenter spot capacity with ``gpus_per_node`` ``nvidia.com/gpu`` each.

``LocalCluster(dir, kubeconfig=FILE)`` uses a real API server instead of the emulator: the CRD is
created there if missing, the operator runs here with that kubeconfig, and the node agent adds its
nodes (prefixed ``liveshard-local-``) and plays scheduler and kubelet for them only (liveshard's
pods become processes on this machine); its nodes are deleted when it stops (after a crash, the
next start takes them over). The admission webhook is not registered (the server cannot call
back into this machine). The cluster's own scheduler may place other workloads on these nodes:
they stay Pending, as nothing but liveshard's pods is run here.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

from liveshard.dev import tls
from liveshard.dev.localcluster import kueue_standin
from liveshard.dev.localcluster.emulator import KubeEmulator
from liveshard.dev.localcluster.node_agent import NodeAgent
from liveshard.dev.ports import free_port
from liveshard.runtime.lifeline import preexec

log = logging.getLogger("liveshard.dev.localcluster")
WEBHOOK_CONFIGURATION = "liveshard-local"

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
                 operator_args: tuple[str, ...] = (), kubeconfig: str | Path | None = None,
                 operator: bool = True, kueue: bool = False) -> None:
        """``kubeconfig``: a real API server's (see the module doc); ``operator=False``: the
        operator runs elsewhere (e.g. installed with the Helm chart); ``kueue``: Kueue's CRDs
        (stand-in copies) and the stand-in for Kueue's scheduler (``kueue_standin.py``), with
        the queues of ``kueue_standin.local_queues`` (the emulator only)."""
        self.dir = Path(workdir).resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "logs").mkdir(exist_ok=True)
        self.nodes = nodes
        self.gpus_per_node = gpus_per_node
        self.operator_args = operator_args
        self.attached = kubeconfig is not None
        self.kueue = kueue and not self.attached
        extra = kueue_standin.crd_paths() if self.kueue else []
        self.kube = None if self.attached else KubeEmulator(crds=[crd_path(), *extra])
        self.standin: kueue_standin.KueueStandIn | None = None
        self.kubeconfig = Path(kubeconfig).resolve() if kubeconfig is not None else self.dir / "kubeconfig"
        self.run_operator = operator
        self.node_prefix = "liveshard-local-" if self.attached else ""
        self.operator: subprocess.Popen | None = None
        self.webhook = False  # the operator's admission webhook is registered (start)
        self.agent: NodeAgent | None = None
        self.api: Any = None

    @property
    def server(self) -> str:
        return self.api.configuration.host if self.api is not None else ""

    def start(self) -> LocalCluster:
        if self.kube is not None:
            self.kube.start()
            self.kube.write_kubeconfig(self.kubeconfig)
            self.api = self.kube.api_client()
        else:
            from kubernetes import config

            self.api = config.new_client_from_config(str(self.kubeconfig))
            self._ensure_crd()
        self.agent = NodeAgent(self.api, self.dir, kubeconfig=self.kubeconfig, own_nodes_only=self.attached)
        if self.kube is not None:
            self.kube.emulator.pod_logs = self.agent.pod_log  # kubectl logs reads the agent's files
        self.agent.add_node(self.node_name("control-0"), gpus=0, labels={"karpenter.sh/capacity-type": "on-demand"})
        for i in range(self.nodes):
            self.add_gpu_node(self.node_name(f"gpu-{i}"))
        self.agent.start()
        if self.kueue:
            from kubernetes import client

            custom = client.CustomObjectsApi(self.api)
            kueue_standin.local_queues(custom, self.nodes * self.gpus_per_node)
            self.standin = kueue_standin.KueueStandIn(custom, interval=0.5).start()
        if self.run_operator:
            webhook = self._webhook_args() if self.kube is not None else []
            self.webhook = bool(webhook)
            target = ["--server", self.kube.url] if self.kube is not None else ["--kubeconfig", str(self.kubeconfig)]
            with open(self.dir / "logs" / "operator.log", "ab") as out:
                self.operator = subprocess.Popen(
                    [sys.executable, "-m", "liveshard.runtime.cli", "operator", *target,
                     "--metrics-port", "0", "--liveness", "", *webhook, *self.operator_args],
                    stdout=out, stderr=subprocess.STDOUT, preexec_fn=preexec())  # ends with this process
        return self

    def node_name(self, name: str) -> str:
        return f"{self.node_prefix}{name}"

    def _ensure_crd(self) -> None:
        """Create the ElasticTrainingJob CRD on the attached server unless it is there."""
        import yaml
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        crd = yaml.safe_load(crd_path().read_text())
        try:
            client.ApiextensionsV1Api(self.api).create_custom_resource_definition(crd)
            log.info("local cluster: created the CRD %s", crd["metadata"]["name"])
        except ApiException as e:
            if e.status != 409:
                raise

    def _webhook_args(self) -> list[str]:
        """A certificate for 127.0.0.1, a free port, and the webhook configuration that sends the
        API's reviews of jobs there (failurePolicy Ignore, as the chart's default: while the
        operator starts, requests pass). No certificate tooling: no webhook (a log line)."""
        from kubernetes import client

        from liveshard.operator.admission import REVIEW_PATH
        from liveshard.runtime.contract.crd import GROUP, PLURAL, VERSION

        try:
            cert, key = tls.self_signed(self.dir / "webhook", hosts=("127.0.0.1",), days=30)
        except tls.TLSUnavailable as e:
            log.warning("local cluster: no admission webhook (%s)", e)
            return []
        port = free_port()
        hook = {"name": "validate.elastictrainingjobs.liveshard.io", "admissionReviewVersions": ["v1"],
                "sideEffects": "None", "failurePolicy": "Ignore", "timeoutSeconds": 10,
                "clientConfig": {"url": f"https://127.0.0.1:{port}{REVIEW_PATH}",
                                 "caBundle": base64.b64encode(cert.read_bytes()).decode()},
                "rules": [{"apiGroups": [GROUP], "apiVersions": [VERSION], "resources": [PLURAL],
                           "operations": ["CREATE", "UPDATE"], "scope": "Namespaced"}]}
        client.AdmissionregistrationV1Api(self.api).create_validating_webhook_configuration(
            {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
             "metadata": {"name": WEBHOOK_CONFIGURATION}, "webhooks": [hook]})
        return ["--webhook-port", str(port), "--webhook-address", "127.0.0.1",
                "--webhook-cert-file", str(cert), "--webhook-key-file", str(key)]

    def add_gpu_node(self, name: str) -> None:
        assert self.agent is not None
        self.agent.add_node(name, gpus=self.gpus_per_node, labels={"karpenter.sh/capacity-type": "spot"})

    def operator_alive(self) -> bool:
        if not self.run_operator:
            return True  # it runs elsewhere
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
        if self.standin is not None:
            self.standin.stop()
        if self.agent is not None:
            self.agent.stop()
            if self.attached:  # a real server keeps what it is given: take the fake nodes back
                from kubernetes import client

                for name in sorted(self.agent.owned):
                    with contextlib.suppress(Exception):
                        client.CoreV1Api(self.api).delete_node(name)
        if self.kube is not None:
            with contextlib.suppress(Exception):
                self.kube.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

