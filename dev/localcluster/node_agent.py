"""The local cluster's scheduler and kubelet: pods become local processes.

``NodeAgent`` polls the API (the official kubernetes client) and, for every pod:

* **schedules** a pending pod (one with no ``spec.schedulingGates`` left) onto a Node object that is Ready, schedulable, has no
  ``NoSchedule``/``NoExecute`` taint the pod does not tolerate, satisfies the pod's required
  node affinity, and has ``nvidia.com/gpu`` left (allocatable minus the GPUs of its pods,
  Terminating ones included), and binds it as a scheduler does (``pods/binding``: a pod's spec
  is immutable);
* **runs** its containers as processes (``liveshard ...`` runs this Python's ``liveshard``),
  with the container's environment (``fieldRef``s resolved, ``$(VAR)`` expanded in command and
  args as the kubelet does), and reports phase ``Running`` and the pod IP (127.0.0.1);
* gives a pod's volumes directories under the agent's directory (``volumes``): each
  ``emptyDir`` its own ``DIR/pods/<uid head>/<volume>``, removed with the pod, each
  ``persistentVolumeClaim`` a ``DIR/claims/<namespace>/<claim>`` its pods share; the container's
  paths under a mount (environment values, JSON ones string by string, and arguments) are
  rewritten to them (not paths under ``DIR`` itself: the host's already, such as the demo's
  checkpoints and results), and its ``/tmp`` volume is its ``TMPDIR``: a pod writes nothing
  outside ``DIR`` where it would write into its own volumes in a container;
* maps the job's coordinator Service to 127.0.0.1 and a free port per job
  (``LIVESHARD_COORDINATOR``, ``LIVESHARD_PORT``, ``LIVESHARD_BIND``);
* reports ``Succeeded``/``Failed`` when a process exits (``restartPolicy: Always`` restarts it),
  with the container's ``state.terminated`` as a kubelet writes it: exit code, reason and, under
  ``terminationMessagePolicy: FallbackToLogsOnError``, a failed container's log tail as its
  termination message;
* finishes a pod that is deleted with a grace period as its kubelet would: SIGTERM to its
  processes, SIGKILL after the grace period (at most 5 s here; to whatever the main process left
  behind once it has ended, as in a container), then deletes it again with grace
  0 (bound to its uid). Until then it stays ``Terminating`` and its name cannot be reused.
  A pod on a lost node has no kubelet: it stays ``Terminating`` until its Node object is
  deleted; then the agent removes it, as kube-controller-manager's pod garbage collector does;
* serves the containers' output for ``kubectl logs`` (``pod_log``, which the emulator asks).

Node events a cloud would cause are methods: ``taint`` (e.g. the AWS Node Termination Handler's
spot-ITN taint), ``add_node``, and ``lose_node`` (SIGKILL every process on the node and mark it
NotReady and unreachable, as the node lifecycle controller does). ``kubectl annotate node N
localcluster.liveshard.io/lose=now`` asks the agent to lose node N. Nodes created by anybody
(``kubectl apply``) are used like the agent's own.

Node conditions carry ``lastHeartbeatTime``/``lastTransitionTime`` as a kubelet and the node
lifecycle controller write them. Every ``HEARTBEAT_SECONDS`` the agent renews each node's Lease in
``kube-node-lease`` (owned by its Node, as a kubelet's), so on a real API server the node
lifecycle controller keeps the nodes Ready; a lost node's Lease is no longer renewed.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from liveshard.dev.ports import free_port
from liveshard.runtime.contract.crd import LABEL_JOB
from liveshard.runtime.contract.env import Env
from liveshard.runtime.lifeline import preexec

log = logging.getLogger("liveshard.localcluster")

LOSE_ANNOTATION = "localcluster.liveshard.io/lose"
NODE_LEASE_NAMESPACE = "kube-node-lease"
HEARTBEAT_SECONDS = 10.0  # the kubelet's lease renewal interval (leaseDurationSeconds 40)
LEASE_SECONDS = 40
SCHEDULER_NAME = "liveshard-local-scheduler"  # the events' source: the agent schedules, not kube-scheduler
SPOT_ITN_TAINT = "aws-node-termination-handler/spot-itn"
GPU = "nvidia.com/gpu"
# The longest pod /tmp directory set as TMPDIR: multiprocessing makes Unix sockets about 35 bytes
# deeper (pymp-XXXXXXXX/listener-XXXXXXXX), and a socket's path has at most 107 bytes.
SOCKET_SAFE_TMPDIR = 70


@dataclass
class PodProcess:
    namespace: str
    name: str
    uid: str
    node: str
    proc: subprocess.Popen
    restart: bool
    command: list[str]
    env: dict[str, str]
    log_path: Path
    reported: str = "Running"
    container: str = ""
    image: str = ""
    log_offset: int = 0  # where this pod's output starts in log_path
    fallback_to_logs: bool = False  # terminationMessagePolicy: FallbackToLogsOnError
    started_at: str = ""


def node_object(name: str, gpus: int, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A Node as a GPU node's kubelet and the NVIDIA device plugin would register it."""
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
            "node.kubernetes.io/instance-type": "local-cpu",
            "nvidia.com/gpu.memory": "81559", **(labels or {})}},
        "spec": {},
        "status": {
            "capacity": {"cpu": "2", "memory": "8Gi", GPU: str(gpus)},
            "allocatable": {"cpu": "2", "memory": "8Gi", GPU: str(gpus)},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "kubelet is posting ready status", "lastHeartbeatTime": _now(),
                            "lastTransitionTime": _now()}],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}],
        },
    }


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _gpus(pod: dict[str, Any]) -> int:
    total = 0
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        total += int((res.get("limits") or {}).get(GPU) or (res.get("requests") or {}).get(GPU) or 0)
    return total


def _ready(node: dict[str, Any]) -> bool:
    conds = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def _tolerated(taint: dict[str, Any], tolerations: list[dict[str, Any]]) -> bool:
    for t in tolerations:
        if t.get("operator") == "Exists" and not t.get("key"):
            return True
        if t.get("key") == taint.get("key") and (t.get("operator") == "Exists" or t.get("value") == taint.get("value")) \
                and (not t.get("effect") or t.get("effect") == taint.get("effect")):
            return True
    return False


def _expression_holds(expr: dict[str, Any], labels: dict[str, str]) -> bool:
    key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
    if op == "In":
        return labels.get(key) in values
    if op == "NotIn":
        return labels.get(key) not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    return True  # Gt/Lt: not used by liveshard's pods


def unfit(pod: dict[str, Any], node: dict[str, Any], used_gpus: int) -> str | None:
    """Why the scheduler would not put this pod on this node, in kube-scheduler's words (None:
    it fits). GPUs, readiness, cordon, taints, node selector, required node affinity."""
    spec = pod.get("spec") or {}
    if node["metadata"].get("deletionTimestamp"):
        return "node(s) were being deleted"
    if (node.get("spec") or {}).get("unschedulable"):
        return "node(s) were unschedulable"
    if not _ready(node):
        return "node(s) had untolerated taint {node.kubernetes.io/not-ready: }"
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerated(taint, spec.get("tolerations") or []):
            return f"node(s) had untolerated taint {{{taint.get('key')}: {taint.get('value') or ''}}}"
    labels = node["metadata"].get("labels") or {}
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = required.get("nodeSelectorTerms") or []
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()) or (
            terms and not any(all(_expression_holds(e, labels) for e in t.get("matchExpressions") or [])
                              for t in terms)):
        return "node(s) didn't match Pod's node affinity/selector"
    allocatable = int(((node.get("status") or {}).get("allocatable") or {}).get(GPU) or 0)
    return None if _gpus(pod) <= allocatable - used_gpus else f"Insufficient {GPU}"


def fits(pod: dict[str, Any], node: dict[str, Any], used_gpus: int) -> bool:
    """Would the scheduler put this pod on this node?"""
    return unfit(pod, node, used_gpus) is None


def unschedulable_message(pod: dict[str, Any], nodes: dict[str, dict[str, Any]], used: dict[str, int]) -> str:
    """kube-scheduler's FailedScheduling message: ``0/3 nodes are available: 1 node(s) were
    unschedulable, 2 Insufficient nvidia.com/gpu.``"""
    counts: dict[str, int] = {}
    for name, node in nodes.items():
        why = unfit(pod, node, used.get(name, 0))
        if why is not None:
            counts[why] = counts.get(why, 0) + 1
    reasons = ", ".join(f"{n} {why}" for why, n in sorted(counts.items()))
    return f"0/{len(nodes)} nodes are available: {reasons}." if reasons else f"0/{len(nodes)} nodes are available."


# The kubelet's FallbackToLogsOnError: the last 80 lines or 2048 bytes of the log, whichever is less.
TERMINATION_LOG_LINES = 80
TERMINATION_LOG_BYTES = 2048


def log_tail(path: Path, start: int = 0) -> str:
    """A failed container's termination message under ``FallbackToLogsOnError``: the end of its
    log (from ``start``, where this container's output begins in the file)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            f.seek(max(start, end - TERMINATION_LOG_BYTES))
            data = f.read()
    except OSError:
        return ""
    lines = data.decode(errors="replace").splitlines(keepends=True)
    return "".join(lines[-TERMINATION_LOG_LINES:])


def translate(value: str, mounts: dict[str, str], keep: str = "") -> str:
    """``value`` with a path under one of ``mounts`` (``{mountPath: host directory}``, the
    longest mount path first) rewritten to the host directory; a JSON object or list string by
    string. A path under ``keep`` (the agent's own directory) is a host path already and stays:
    the local cluster's jobs name their checkpoints and results there (``sample_job``, the
    demo), and under a pod's ``/tmp`` mount (the agent's directory in the system's /tmp) they
    would land in the pod's emptyDir, not shared and removed with the pod."""
    if not mounts:
        return value
    if value[:1] in "{[":
        try:
            data = json.loads(value)
        except ValueError:
            pass
        else:
            return json.dumps(_translate_json(data, mounts, keep), sort_keys=True)
    if keep and (value == keep or value.startswith(keep.rstrip("/") + "/")):
        return value
    for path in sorted(mounts, key=len, reverse=True):
        if value == path or value.startswith(path.rstrip("/") + "/"):
            return mounts[path] + value[len(path):]
    return value


def _translate_json(data: Any, mounts: dict[str, str], keep: str = "") -> Any:
    if isinstance(data, str):
        return translate(data, mounts, keep) if data[:1] not in "{[" else data
    if isinstance(data, list):
        return [_translate_json(v, mounts, keep) for v in data]
    if isinstance(data, dict):
        return {k: _translate_json(v, mounts, keep) for k, v in data.items()}
    return data


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion in command and args (``$$`` escapes)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


class NodeAgent:
    def __init__(self, api: Any, workdir: str | Path, period: float = 0.25,
                 kubeconfig: str | Path | None = None, own_nodes_only: bool = False) -> None:
        """``own_nodes_only``: a cluster with kubelets of its own (a real API server): schedule,
        run and heartbeat only on the nodes this agent added, and run only liveshard's pods there
        (a DaemonSet's pod bound to one is left alone: its image is not run here)."""
        import kubernetes.client

        self.core = kubernetes.client.CoreV1Api(api)
        self.dir = Path(workdir)
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        self.kubeconfig = str(kubeconfig) if kubeconfig else None
        self.period = period
        self.procs: dict[tuple[str, str], PodProcess] = {}
        self.ports: dict[tuple[str, str], int] = {}  # (namespace, job) -> coordinator port
        self.lost: set[str] = set()
        self.starts: dict[str, int] = {}  # pod name -> processes started for it (restarts show here)
        # (namespace, pod) -> (uid, log file, where this pod's output starts in it)
        self.logs: dict[tuple[str, str], tuple[str, Path, int]] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.coordination = kubernetes.client.CoordinationV1Api(api)
        self.own_nodes_only = own_nodes_only
        self.unschedulable: dict[str, str] = {}  # pod uid -> the FailedScheduling message posted
        self.owned: set[str] = set()  # nodes this agent added
        self._beat_at = 0.0  # time.monotonic() of the last lease renewal

    # ---- nodes: what a cloud does ------------------------------------------------------------
    def add_node(self, name: str, gpus: int = 1, labels: dict[str, str] | None = None) -> None:
        from kubernetes.client.rest import ApiException

        node = node_object(name, gpus, labels)
        try:
            self.core.create_node(node)
        except ApiException as e:
            if e.status != 409:
                raise
            # a node of an agent that did not stop cleanly (a real server keeps it): take it over
            self.core.patch_node(name, {"metadata": {"labels": node["metadata"]["labels"]}})
        self.owned.add(name)
        # status is written through its subresource, as a kubelet registering the node does
        self.core.patch_node_status(name, {"status": node["status"]})

    def taint(self, node: str, key: str = SPOT_ITN_TAINT, value: str = "spot-itn", effect: str = "NoSchedule") -> None:
        taints = list(self.core.read_node(node).spec.taints or [])
        body = [t.to_dict() if hasattr(t, "to_dict") else t for t in taints]
        body = [{k: v for k, v in t.items() if v is not None} for t in body]
        body.append({"key": key, "value": value, "effect": effect})
        self.core.patch_node(node, {"spec": {"taints": body}})

    def lose_node(self, node: str) -> list[str]:
        """The node disappears without notice: its processes die at once, and after that the
        node lifecycle controller marks it NotReady and unreachable. Returns the pods that died."""
        with self._lock:
            self.lost.add(node)
            victims = [p for p in self.procs.values() if p.node == node]
            for p in victims:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.proc.pid, signal.SIGKILL)
            for p in victims:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.proc.wait(timeout=10)
        # as the node lifecycle controller writes it: the transition is now (a condition written
        # without lastTransitionTime keeps the old one on a real server)
        self.core.patch_node_status(node, {"status": {"conditions": [
            {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
             "message": "Kubelet stopped posting node status.", "lastHeartbeatTime": _now(),
             "lastTransitionTime": _now()}]}})
        node_obj = self.core.read_node(node)
        taints = [{k: v for k, v in t.to_dict().items() if v is not None} for t in (node_obj.spec.taints or [])]
        taints.append({"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"})
        self.core.patch_node(node, {"spec": {"taints": taints}})
        return [p.name for p in victims]

    # ---- the loop ----------------------------------------------------------------------------
    def start(self) -> NodeAgent:
        self._thread = threading.Thread(target=self._loop, name="node-agent", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        with self._lock:
            for p in self.procs.values():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.proc.pid, signal.SIGKILL)
            for p in self.procs.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.proc.wait(timeout=10)
            self.procs.clear()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception as e:  # the API may be briefly unavailable; try again
                log.warning("node agent: %s", e)
            self._stop.wait(self.period)

    def sync(self) -> None:
        api = self.core.api_client
        nodes = {n["metadata"]["name"]: n for n in api.sanitize_for_serialization(self.core.list_node()).get("items", [])}
        pods = api.sanitize_for_serialization(self.core.list_pod_for_all_namespaces()).get("items", [])
        if self.own_nodes_only:  # the rest are real kubelets' nodes and pods
            gone = self.owned - set(nodes)
            nodes = {n: node for n, node in nodes.items() if n in self.owned}
            pods = [p for p in pods if LABEL_JOB in (p["metadata"].get("labels") or {})
                    and (p.get("spec") or {}).get("nodeName") in (None, *nodes, *gone)]
        for name, node in nodes.items():
            if (node["metadata"].get("annotations") or {}).get(LOSE_ANNOTATION) and name not in self.lost:
                log.info("losing node %s (annotation)", name)
                self.lose_node(name)
        if time.monotonic() - self._beat_at >= HEARTBEAT_SECONDS:
            self._beat_at = time.monotonic()
            self.renew_leases({n: node for n, node in nodes.items() if n not in self.lost})
        live = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods}
        with self._lock:
            for key, proc in list(self.procs.items()):
                pod = live.get(key)
                if pod is None or pod["metadata"].get("uid") != proc.uid or pod["metadata"].get("deletionTimestamp"):
                    grace = (pod or {}).get("metadata", {}).get("deletionGracePeriodSeconds")
                    gone = self.procs.pop(key)
                    self._kill(gone, 5.0 if grace is None else min(5.0, float(grace)))
                    # its emptyDirs go with it, as a kubelet removes them
                    shutil.rmtree(self.pod_dir(gone.namespace, gone.name, gone.uid), ignore_errors=True)
        for pod in live.values():
            node = (pod.get("spec") or {}).get("nodeName")
            if node and node not in nodes:
                self._finish(pod, f"its node {node} is gone")  # the pod garbage collector
            elif pod["metadata"].get("deletionTimestamp") and node and node not in self.lost:
                self._finish(pod, "its processes ended")  # the kubelet, once the containers are gone
        used: dict[str, int] = {}
        for p in pods:
            node = (p.get("spec") or {}).get("nodeName")
            if node and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                used[node] = used.get(node, 0) + _gpus(p)
        for key, pod in sorted(live.items()):
            if pod["metadata"].get("deletionTimestamp"):
                continue
            node = (pod.get("spec") or {}).get("nodeName")
            if not node and (pod.get("spec") or {}).get("schedulingGates"):
                continue  # not ready for scheduling until its gates are removed (the API server refuses a binding)
            if not node:
                node = next((n for n in sorted(nodes) if fits(pod, nodes[n], used.get(n, 0))), None)
                if node is None:  # stays Pending, as on a full cluster, and says why
                    self._failed_scheduling(pod, unschedulable_message(pod, nodes, used))
                    continue
                if not self._bind(pod, node):
                    continue
                used[node] = used.get(node, 0) + _gpus(pod)
                pod["spec"]["nodeName"] = node
            if node in self.lost or node not in nodes:
                continue
            with self._lock:
                proc = self.procs.get(key)
            phase = (pod.get("status") or {}).get("phase")
            if proc is None and phase in (None, "Pending"):
                self._start(pod, node)
            elif proc is not None and proc.proc.poll() is not None:
                self._exited(proc)

    def _failed_scheduling(self, pod: dict[str, Any], message: str) -> None:
        """A FailedScheduling Warning event on the pod, as the scheduler posts one (again only
        when the reason changes)."""
        meta = pod["metadata"]
        uid = meta.get("uid", "")
        if self.unschedulable.get(uid) == message:
            return
        self.unschedulable[uid] = message
        now = _now()
        with contextlib.suppress(Exception):  # an event is advice: never stop scheduling for it
            self.core.create_namespaced_event(meta["namespace"], {
                "apiVersion": "v1", "kind": "Event",
                "metadata": {"name": f"{meta['name']}.{os.urandom(8).hex()}", "namespace": meta["namespace"]},
                "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                                   "namespace": meta["namespace"], "uid": uid},
                "reason": "FailedScheduling", "message": message, "type": "Warning",
                "source": {"component": SCHEDULER_NAME}, "reportingComponent": SCHEDULER_NAME,
                "firstTimestamp": now, "lastTimestamp": now, "count": 1})

    def renew_leases(self, nodes: dict[str, dict[str, Any]]) -> None:
        """Each node's heartbeat, as its kubelet sends it: the Lease ``kube-node-lease/<node>``
        with this renewTime (created, owned by the Node, the first time)."""
        from kubernetes.client.rest import ApiException

        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        for name, node in nodes.items():
            try:
                self.coordination.patch_namespaced_lease(name, NODE_LEASE_NAMESPACE, {"spec": {"renewTime": now}})
            except ApiException as e:
                if e.status != 404:
                    raise
                meta = node["metadata"]
                self.coordination.create_namespaced_lease(NODE_LEASE_NAMESPACE, {
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": name, "namespace": NODE_LEASE_NAMESPACE, "ownerReferences": [
                        {"apiVersion": "v1", "kind": "Node", "name": name, "uid": meta.get("uid")}]},
                    "spec": {"holderIdentity": name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": now}})

    def _bind(self, pod: dict[str, Any], node: str) -> bool:
        """Bind as a scheduler does; False if the pod changed meanwhile (bound, deleted)."""
        from kubernetes.client.rest import ApiException

        meta = pod["metadata"]
        try:
            # the server answers a Status, which the client cannot read as a V1Binding
            self.core.create_namespaced_pod_binding(meta["name"], meta["namespace"], {
                "apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"], "uid": meta.get("uid")},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}}, _preload_content=False)
            return True
        except ApiException as e:
            if e.status in (404, 409):
                return False
            raise

    def _finish(self, pod: dict[str, Any], why: str) -> None:
        """Delete a pod for good (grace 0), and only this incarnation of it (uid precondition)."""
        from kubernetes.client.rest import ApiException

        meta = pod["metadata"]
        try:
            self.core.delete_namespaced_pod(meta["name"], meta["namespace"], body={
                "gracePeriodSeconds": 0, "preconditions": {"uid": meta.get("uid")}})
            log.info("pod %s/%s finished: %s", meta["namespace"], meta["name"], why)
        except ApiException as e:
            if e.status not in (404, 409):  # gone already, or a new pod of that name
                raise

    def pod_log(self, namespace: str, name: str, uid: str, container: str) -> tuple[Path, int] | None:
        """Where a pod's output is (file, offset where it starts), for ``kubectl logs``; None
        while no process was started for this pod (uid)."""
        found = self.logs.get((namespace, name))
        return (found[1], found[2]) if found is not None and found[0] == uid else None

    # ---- volumes -----------------------------------------------------------------------------
    def pod_dir(self, namespace: str, name: str, uid: str) -> Path:
        """Where a pod's own volumes (its emptyDirs) are, as under a kubelet's pods/<uid>: short
        (the head of its uid), since a Unix socket's path under them has at most 107 bytes."""
        return self.dir / "pods" / (uid[:8] or f"{namespace}_{name}")

    def volumes(self, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        """The container's mounts as host directories, ``{mountPath: directory}``: an ``emptyDir``
        is a directory of the pod's own (removed with the pod), a ``persistentVolumeClaim`` one
        directory per claim, shared by the pods that mount it and kept, both under the agent's
        directory; a ``hostPath`` is that path. A container sees them through its paths: every
        environment value and argument under a mount path is rewritten to the directory (values
        that are JSON, such as the job's training spec, string by string). Memory-backed
        emptyDirs (``/dev/shm``) and other kinds are the host's own."""
        meta = pod["metadata"]
        by_name = {v.get("name"): v for v in pod["spec"].get("volumes") or []}
        out: dict[str, str] = {}
        for mount in container.get("volumeMounts") or []:
            volume, path = by_name.get(mount.get("name")) or {}, mount.get("mountPath")
            if not path:
                continue
            empty, claim, host = volume.get("emptyDir"), volume.get("persistentVolumeClaim"), volume.get("hostPath")
            if isinstance(empty, dict) and empty.get("medium") != "Memory":
                where = self.pod_dir(meta["namespace"], meta["name"], meta.get("uid", "")) / mount["name"]
            elif isinstance(claim, dict) and claim.get("claimName"):
                where = self.dir / "claims" / meta["namespace"] / claim["claimName"]
            elif isinstance(host, dict) and host.get("path"):
                where = Path(host["path"])
            else:
                continue
            where.mkdir(parents=True, exist_ok=True)
            out[path.rstrip("/") or "/"] = str(where)
        return out

    # ---- processes ---------------------------------------------------------------------------
    def coordinator_port(self, namespace: str, job: str) -> int:
        with self._lock:
            key = (namespace, job)
            if key not in self.ports:
                self.ports[key] = free_port()
            return self.ports[key]

    def secret_value(self, namespace: str, name: str, key: str) -> str:
        """A key of a Secret, as the kubelet hands it to a container (raises if it is missing,
        as a kubelet refuses to start the container)."""
        secret = self.core.read_namespaced_secret(name, namespace)
        data = secret.data or {}
        if key in data:
            return base64.b64decode(data[key]).decode()
        if key in (secret.string_data or {}):
            return secret.string_data[key]
        raise KeyError(f"secret {namespace}/{name} has no key {key!r}")

    def _env(self, pod: dict[str, Any], container: dict[str, Any], node: str) -> dict[str, str]:
        meta = pod["metadata"]
        fields = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
                  "metadata.uid": meta.get("uid", ""), "spec.nodeName": node, "status.podIP": "127.0.0.1",
                  "status.hostIP": "127.0.0.1", "spec.serviceAccountName": (pod["spec"].get("serviceAccountName") or "")}
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        for e in container.get("env") or []:
            if "value" in e:
                env[e["name"]] = expand(str(e["value"]), env)
            elif ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath") in fields:
                env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
            elif (e.get("valueFrom") or {}).get("secretKeyRef"):
                ref = e["valueFrom"]["secretKeyRef"]
                env[e["name"]] = self.secret_value(meta["namespace"], ref["name"], ref["key"])
        job = env.get(Env.JOB) or (meta.get("labels") or {}).get(LABEL_JOB)
        if job:
            # The coordinator Service resolves to this machine: one loopback port per job.
            port = self.coordinator_port(meta["namespace"], job)
            env[Env.COORDINATOR] = f"127.0.0.1:{port}"
            env[Env.PORT] = str(port)
            env[Env.BIND] = "127.0.0.1"
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        if self.kubeconfig:
            env["KUBECONFIG"] = self.kubeconfig  # stands in for the pod's service-account token
        return env

    def _start(self, pod: dict[str, Any], node: str) -> None:
        meta = pod["metadata"]
        container = pod["spec"]["containers"][0]  # liveshard's pods have one container
        env = self._env(pod, container, node)
        argv = [expand(a, env) for a in [*(container.get("command") or []), *(container.get("args") or [])]]
        mounts = self.volumes(pod, container)
        own = {e.get("name") for e in container.get("env") or []}  # not the host's own environment
        keep = str(self.dir.resolve())  # paths the job names in the agent's directory are the host's
        env = {k: translate(v, mounts, keep) if k in own else v for k, v in env.items()}
        argv = [translate(a, mounts, keep) for a in argv]
        if "/tmp" in mounts and len(mounts["/tmp"]) <= SOCKET_SAFE_TMPDIR:
            env["TMPDIR"] = mounts["/tmp"]  # what /tmp is inside the container: Python's tempfile goes there
        elif "/tmp" in mounts:
            log.info("pod %s/%s: %s is too long a path for the Unix sockets made under TMPDIR: the "
                     "system's temporary directory stands in for its /tmp", meta["namespace"], meta["name"], mounts["/tmp"])
        if not argv:
            self._set_phase(meta["namespace"], meta["name"], "Failed", "no command: images are not run here")
            return
        if argv[0] == "liveshard":
            argv = [sys.executable, "-m", "liveshard.runtime.cli", *argv[1:]]
        log_path = self.dir / "logs" / f"{meta['namespace']}_{meta['name']}.log"
        # one file per pod name (a recreated pod appends): kubectl logs reads from this offset
        offset = log_path.stat().st_size if log_path.exists() else 0
        proc = self._spawn(argv, env, log_path)
        self.logs[(meta["namespace"], meta["name"])] = (meta.get("uid", ""), log_path, offset)
        self.starts[meta["name"]] = self.starts.get(meta["name"], 0) + 1
        restart = pod["spec"].get("restartPolicy", "Always") == "Always"
        with self._lock:
            self.procs[(meta["namespace"], meta["name"])] = PodProcess(
                meta["namespace"], meta["name"], meta.get("uid", ""), node, proc, restart, argv, env, log_path,
                container=container["name"], image=container.get("image", ""), log_offset=offset,
                fallback_to_logs=container.get("terminationMessagePolicy") == "FallbackToLogsOnError",
                started_at=_now())
        self.core.patch_namespaced_pod_status(meta["name"], meta["namespace"], {"status": {
            "phase": "Running", "podIP": "127.0.0.1", "hostIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": container["name"], "ready": True, "restartCount": 0,
                                   "image": container.get("image", ""), "imageID": "",
                                   "containerID": f"local://{proc.pid}", "state": {"running": {}}}]}})
        log.info("pod %s/%s on %s: pid %d", meta["namespace"], meta["name"], node, proc.pid)

    @staticmethod
    def _spawn(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
        with open(log_path, "ab") as out:
            # own process group: killing a pod kills everything it started; and SIGKILLed by the
            # kernel if the agent's process dies (lifeline: started from the agent's thread,
            # which runs until every pod is stopped anyway)
            return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=preexec())

    def _exited(self, p: PodProcess) -> None:
        code = p.proc.returncode
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a container's processes end with it
            os.killpg(p.proc.pid, signal.SIGKILL)
        if p.restart:
            log.info("pod %s/%s exited with %s: restarting", p.namespace, p.name, code)
            p.proc = self._spawn(p.command, p.env, p.log_path)
            self.starts[p.name] = self.starts.get(p.name, 0) + 1
            return
        phase = "Succeeded" if code == 0 else "Failed"
        if p.reported != phase:
            p.reported = phase
            self._set_status(p.namespace, p.name, {"phase": phase, "conditions": [
                {"type": "Ready", "status": "False", "reason": "PodCompleted"}],
                "containerStatuses": [self._terminated(p, code)]})

    def _terminated(self, p: PodProcess, code: int) -> dict[str, Any]:
        """The container's status once its process ended, as a kubelet writes it: the exit code
        (128 + N for death by signal N), ``Completed`` or ``Error``, and with
        ``FallbackToLogsOnError`` a failed container's log tail as its termination message."""
        exit_code = 128 - code if code < 0 else code
        terminated: dict[str, Any] = {"exitCode": exit_code, "reason": "Completed" if code == 0 else "Error",
                                      "startedAt": p.started_at, "finishedAt": _now(),
                                      "containerID": f"local://{p.proc.pid}"}
        if code < 0:
            terminated["signal"] = -code
        if code != 0 and p.fallback_to_logs:
            tail = log_tail(p.log_path, p.log_offset)
            if tail:
                terminated["message"] = tail
        return {"name": p.container, "ready": False, "restartCount": 0, "image": p.image, "imageID": "",
                "containerID": f"local://{p.proc.pid}", "state": {"terminated": terminated}}

    def _set_phase(self, namespace: str, name: str, phase: str, message: str) -> None:
        self._set_status(namespace, name, {"phase": phase, "message": message})

    def _set_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):  # the pod may be gone already
            self.core.patch_namespaced_pod_status(name, namespace, {"status": status})

    @staticmethod
    def _kill(p: PodProcess, grace: float = 5.0) -> None:
        if p.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.proc.pid, signal.SIGTERM)
            try:
                p.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.proc.pid, signal.SIGKILL)
                p.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # what it started ends with it, as in a container
            os.killpg(p.proc.pid, signal.SIGKILL)
        log.info("pod %s/%s deleted: process %d ended (%s)", p.namespace, p.name, p.proc.pid, p.proc.returncode)

    def processes(self) -> dict[str, int]:
        """Pod name -> pid of its running process (for reports)."""
        with self._lock:
            return {f"{p.namespace}/{p.name}": p.proc.pid for p in self.procs.values() if p.proc.poll() is None}
