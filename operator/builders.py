"""The Kubernetes objects a job owns, as plain dicts: worker pods, the coordinator pod, the
headless Service, NetworkPolicies, the coordinator's ServiceAccount/Role/RoleBinding and the
workers' ServiceAccount (bound to nothing).

Pure: the handlers create these; tests inspect them. Every object carries the job's labels and
an owner reference to the job, so deleting the job removes them all.
"""

from __future__ import annotations

import json
from typing import Any

from liveshard.operator.policy import DNS_ANY, DNS_PORT, KUBE_DNS_LABELS, Egress
from liveshard.runtime.contract.crd import (
    API_VERSION,
    DEFAULT_COORDINATOR_PORT,
    DEFAULT_METRICS_PORT,
    GROUP,
    KIND,
    LABEL_INDEX,
    LABEL_JOB,
    LABEL_ROLE,
    PLURAL,
    ROLE_COORDINATOR,
    ROLE_WORKER,
)
from liveshard.runtime.contract.env import Env
from liveshard.runtime.contract.jobspec import JobSpec
from liveshard.runtime.contract.keys import INCARNATION_ENV, SECRET_ENV
from liveshard.runtime.contract.training import TRAINING_ENV

# The coordinator must outlive spot capacity: keep it off nodes any major provider labels spot.
SPOT_LABELS = (
    ("karpenter.sh/capacity-type", "spot"),
    ("eks.amazonaws.com/capacityType", "SPOT"),
    ("cloud.google.com/gke-spot", "true"),
    ("cloud.google.com/gke-preemptible", "true"),
    ("kubernetes.azure.com/scalesetpriority", "spot"),
)


def worker_name(job: str, index: int) -> str:
    return f"{job}-worker-{index}"


def coordinator_name(job: str) -> str:
    return f"{job}-coordinator"


def service_name(job: str) -> str:
    return job


def coordinator_account_name(job: str) -> str:
    """The coordinator's ServiceAccount, and its Role and RoleBinding (it reads the job and
    writes its status)."""
    return f"{job}-coordinator"


def worker_account_name(job: str) -> str:
    """The workers' ServiceAccount: bound to no Role, and its token is never mounted."""
    return f"{job}-worker"


def secret_name(job: str) -> str:
    return f"{job}-liveshard"


SECRET_KEY = "store-token"  # the key of the job's Secret that holds its store's HMAC secret


def worker_selector(job: str) -> str:
    """The scale subresource's label selector (status.selector)."""
    return f"{LABEL_JOB}={job},{LABEL_ROLE}={ROLE_WORKER}"


def coordinator_address(job: str, namespace: str, port: int) -> str:
    return f"{coordinator_name(job)}.{service_name(job)}.{namespace}.svc:{port}"


def labels(job: str, role: str | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": "liveshard", "app.kubernetes.io/instance": job,
           "app.kubernetes.io/managed-by": "liveshard-operator", LABEL_JOB: job}
    if role:
        out[LABEL_ROLE] = role
        out["app.kubernetes.io/component"] = role
    return out


def owner_reference(job: dict[str, Any]) -> dict[str, Any]:
    meta = job["metadata"]
    return {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def _meta(job: dict[str, Any], name: str, role: str | None = None,
          extra_labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name, "namespace": job["metadata"]["namespace"],
        "labels": {**(extra_labels or {}), **labels(job["metadata"]["name"], role)},
        "ownerReferences": [owner_reference(job)],
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def _env(job: dict[str, Any], spec: JobSpec, role: str) -> list[dict[str, Any]]:
    name, ns = job["metadata"]["name"], job["metadata"]["namespace"]
    raw = spec.raw
    port = (raw.get("coordinator") or {}).get("port", DEFAULT_COORDINATOR_PORT)
    env = [
        {"name": Env.JOB, "value": name},
        {"name": Env.NAMESPACE, "value": ns},
        {"name": Env.ROLE, "value": role},
        {"name": Env.POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        # which pod of that name: a worker registers with it, so that a plan is handed on only
        # once the pod it names has registered (not a deleted predecessor of the same name)
        {"name": Env.POD_UID, "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {"name": Env.NODE_NAME, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": Env.COORDINATOR, "value": coordinator_address(name, ns, port)},
        {"name": Env.GPUS_PER_WORKER, "value": str(spec.workers.gpus_per_worker)},
        {"name": Env.MODEL, "value": json.dumps(spec.model.to_dict(), sort_keys=True)},
        # spec.training, every default spelled out: the workers' one source of what to train
        {"name": TRAINING_ENV, "value": spec.training.to_json()},
        {"name": Env.CHECKPOINT_DIR, "value": spec.checkpoint.path},
        {"name": Env.CHECKPOINT_INTERVAL_SECONDS, "value": str(spec.checkpoint.interval_seconds)},
        {"name": Env.CHECKPOINT_KEEP, "value": str(spec.checkpoint.keep)},
        # the job's store authenticates every value with this (runtime/control/store.py)
        {"name": SECRET_ENV, "valueFrom": {"secretKeyRef": {"name": secret_name(name), "key": SECRET_KEY}}},
        # ... bound to this job object, so values of an earlier job of the same name do not verify
        {"name": INCARNATION_ENV, "value": str(job["metadata"].get("uid") or "")},
        # ... and recorded in every checkpoint: a job continues only its own run
        {"name": Env.JOB_UID, "value": str(job["metadata"].get("uid") or "")},
    ]
    return env + list(raw.get("env") or [])


def _checkpoint_volume(spec: JobSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    ckpt = spec.raw.get("checkpoint") or {}
    if not ckpt.get("volume"):
        return [], []
    return ([{"name": "checkpoint", **ckpt["volume"]}],
            [{"name": "checkpoint", "mountPath": spec.checkpoint.path}])


# PodSecurity "restricted": the image's non-root user (images/*/Dockerfile), no privilege, no
# capabilities, the runtime's default seccomp profile, a read-only root filesystem with scratch
# space on /tmp. ``spec.template.securityContext`` replaces the pod-level part (e.g. a GPU stack
# that needs another user or group); the container-level part always applies.
RUN_AS = 10001
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
                "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                      "capabilities": {"drop": ["ALL"]}}


def _hardened(pod_spec: dict[str, Any], container: dict[str, Any], pod_security: dict[str, Any] | None) -> None:
    """Apply the security settings above; writable scratch on /tmp (HOME and caches go there)."""
    pod_spec["securityContext"] = json.loads(json.dumps(pod_security or POD_SECURITY))
    container["securityContext"] = json.loads(json.dumps(CONTAINER_SECURITY))
    pod_spec["volumes"].append({"name": "tmp", "emptyDir": {}})
    container["volumeMounts"].append({"name": "tmp", "mountPath": "/tmp"})
    container["env"] = [{"name": "HOME", "value": "/tmp"}, *container["env"]]


def worker_pod(job: dict[str, Any], spec: JobSpec, index: int) -> dict[str, Any]:
    name = job["metadata"]["name"]
    tpl = spec.raw.get("template") or {}
    gpus = spec.workers.gpus_per_worker
    resources = json.loads(json.dumps(tpl.get("resources") or {}))
    resources.setdefault("limits", {})["nvidia.com/gpu"] = str(gpus)
    volumes, mounts = _checkpoint_volume(spec)
    # NCCL needs a large /dev/shm; the container default (64 MiB) is too small.
    volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    container: dict[str, Any] = {
        "name": "worker", "image": spec.image, "command": list(spec.raw.get("command") or ["liveshard", "worker"]),
        "env": [*_env(job, spec, ROLE_WORKER), {"name": Env.WORKER_INDEX, "value": str(index)}],
        "resources": resources, "volumeMounts": mounts,
        # A worker that exits on bad input says why in one line as the last thing it prints: the
        # log's tail becomes the termination message (the pod's containerStatuses), which the
        # operator puts in the job's status.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.raw.get("args"):
        container["args"] = list(spec.raw["args"])
    if spec.raw.get("imagePullPolicy"):
        container["imagePullPolicy"] = spec.raw["imagePullPolicy"]
    pod_spec: dict[str, Any] = {
        # The operator replaces lost workers itself (with a new plan); the kubelet must not
        # restart one in place behind the runtime's back.
        "restartPolicy": "Never",
        "hostname": worker_name(name, index),
        "subdomain": service_name(name),
        "serviceAccountName": worker_account_name(name),
        # Workers never call the API: no token in their pods (the coordinator's pod has one).
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": tpl.get("terminationGracePeriodSeconds", 120),
        "containers": [container],
        "volumes": volumes,
    }
    _hardened(pod_spec, container, tpl.get("securityContext"))
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName", "schedulerName"):
        if tpl.get(key):
            pod_spec[key] = tpl[key]
    meta = _meta(job, worker_name(name, index), ROLE_WORKER, tpl.get("labels"), tpl.get("annotations"))
    meta["labels"][LABEL_INDEX] = str(index)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def coordinator_pod(job: dict[str, Any], spec: JobSpec) -> dict[str, Any]:
    name = job["metadata"]["name"]
    coord = spec.raw.get("coordinator") or {}
    port = coord.get("port", DEFAULT_COORDINATOR_PORT)
    volumes, mounts = _checkpoint_volume(spec)
    affinity = coord.get("affinity") or {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": key, "operator": "NotIn", "values": [value]} for key, value in SPOT_LABELS]}]}}}
    container: dict[str, Any] = {
        "name": "coordinator", "image": coord.get("image") or spec.image,
        "command": ["liveshard", "coordinator"],
        "env": _env(job, spec, ROLE_COORDINATOR),
        "ports": [{"name": "c10d", "containerPort": port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": DEFAULT_METRICS_PORT, "protocol": "TCP"}],
        "resources": coord.get("resources") or {"requests": {"cpu": "250m", "memory": "256Mi"},
                                                  "limits": {"memory": "1Gi"}},
        "volumeMounts": mounts,
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Always",  # stateless: it rebuilds its state from the job's status
        "hostname": coordinator_name(name),
        "subdomain": service_name(name),
        "serviceAccountName": coordinator_account_name(name),
        "containers": [container],
        "volumes": volumes,
        "affinity": affinity,
    }
    _hardened(pod_spec, container, None)
    for key in ("nodeSelector", "tolerations"):
        if coord.get(key):
            pod_spec[key] = coord[key]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": _meta(job, coordinator_name(name), ROLE_COORDINATOR),
            "spec": pod_spec}


def headless_service(job: dict[str, Any], spec: JobSpec) -> dict[str, Any]:
    name = job["metadata"]["name"]
    port = (spec.raw.get("coordinator") or {}).get("port", DEFAULT_COORDINATOR_PORT)
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(job, service_name(name)), "spec": {
        "clusterIP": "None",
        "selector": {LABEL_JOB: name},
        # Workers must resolve each other and the coordinator before they report ready.
        "publishNotReadyAddresses": True,
        "ports": [{"name": "c10d", "port": port, "targetPort": port, "protocol": "TCP"}],
    }}


def _egress(job_name: str, egress: Egress, extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Egress rules every job pod gets (its own pods, DNS) plus ``extra``."""
    dns_ports = [{"protocol": proto, "port": DNS_PORT} for proto in ("UDP", "TCP")]
    dns: dict[str, Any] = {"ports": dns_ports}
    if egress.dns != DNS_ANY:
        dns["to"] = [{"namespaceSelector": {}, "podSelector": {"matchLabels": dict(KUBE_DNS_LABELS)}}]
    # the job's own pods on any port: gloo and NCCL listen on ephemeral ports
    return [{"to": [{"podSelector": {"matchLabels": {LABEL_JOB: job_name}}}]}, dns, *extra]


def _policy_types(egress: Egress) -> list[str]:
    return ["Ingress", "Egress"] if egress.enabled else ["Ingress"]


def network_policy(job: dict[str, Any], spec: JobSpec, egress: Egress | None = None) -> dict[str, Any]:
    """Only the job's own pods may reach its coordinator (its TCPStore accepts any client); the
    coordinator reaches only the job's pods, DNS and the API server."""
    egress = egress or Egress()
    name = job["metadata"]["name"]
    port = (spec.raw.get("coordinator") or {}).get("port", DEFAULT_COORDINATOR_PORT)
    policy: dict[str, Any] = {
        "podSelector": {"matchLabels": {LABEL_JOB: name, LABEL_ROLE: ROLE_COORDINATOR}},
        "policyTypes": _policy_types(egress),
        "ingress": [{"from": [{"podSelector": {"matchLabels": {LABEL_JOB: name}}}],
                     "ports": [{"protocol": "TCP", "port": port}]},
                    # Prometheus, wherever it runs: the metrics endpoint serves read-only gauges.
                    {"ports": [{"protocol": "TCP", "port": DEFAULT_METRICS_PORT}]}],
    }
    if egress.enabled:
        api_server = {"to": [{"ipBlock": {"cidr": cidr}} for cidr in egress.api_server_cidrs],
                      "ports": [{"protocol": "TCP", "port": p} for p in egress.api_server_ports]}
        policy["egress"] = _egress(name, egress, [api_server])
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(job, coordinator_name(name)), "spec": policy}


def worker_network_policy(job: dict[str, Any], spec: JobSpec | None = None,
                          egress: Egress | None = None) -> dict[str, Any]:
    """Only the job's own pods may reach its workers (gloo and NCCL listen on ephemeral ports,
    so the rule names pods, not ports); workers reach the job's pods, DNS, and what
    ``spec.network.extraEgress`` adds."""
    egress = egress or Egress()
    name = job["metadata"]["name"]
    policy: dict[str, Any] = {
        "podSelector": {"matchLabels": {LABEL_JOB: name, LABEL_ROLE: ROLE_WORKER}},
        "policyTypes": _policy_types(egress),
        "ingress": [{"from": [{"podSelector": {"matchLabels": {LABEL_JOB: name}}}]}],
    }
    if egress.enabled:
        extra = [json.loads(json.dumps(r)) for r in spec.network.extra_egress] if spec is not None else []
        policy["egress"] = _egress(name, egress, extra)
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(job, f"{name}-workers"), "spec": policy}


def job_secret(job: dict[str, Any], token: str) -> dict[str, Any]:
    """The job's store secret (``token``: random, made by the caller; an existing Secret is
    kept, so a restarted operator does not change it under running pods)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(job, secret_name(job["metadata"]["name"])), "stringData": {SECRET_KEY: token}}


def coordinator_service_account(job: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": _meta(job, coordinator_account_name(job["metadata"]["name"]), ROLE_COORDINATOR)}


def worker_service_account(job: dict[str, Any]) -> dict[str, Any]:
    """The workers' own account: no RoleBinding names it, and no pod mounts its token (the
    account says so too, so a pod that forgets still gets none)."""
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": _meta(job, worker_account_name(job["metadata"]["name"]), ROLE_WORKER),
            "automountServiceAccountToken": False}


def role(job: dict[str, Any]) -> dict[str, Any]:
    """Read this job, write only its status: nothing else in the namespace (the coordinator's)."""
    name = job["metadata"]["name"]
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": _meta(job, coordinator_account_name(name), ROLE_COORDINATOR), "rules": [
                # list/watch with resourceNames need a metadata.name field selector on the request.
                {"apiGroups": [GROUP], "resources": [PLURAL], "resourceNames": [name],
                 "verbs": ["get", "list", "watch"]},
                {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "resourceNames": [name],
                 "verbs": ["get", "patch", "update"]},
            ]}


def role_binding(job: dict[str, Any]) -> dict[str, Any]:
    """The job's Role, for the coordinator's account only."""
    name = job["metadata"]["name"]
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": _meta(job, coordinator_account_name(name), ROLE_COORDINATOR),
            "subjects": [{"kind": "ServiceAccount", "name": coordinator_account_name(name),
                          "namespace": job["metadata"]["namespace"]}],
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                        "name": coordinator_account_name(name)}}


def job_children(job: dict[str, Any], spec: JobSpec, token: str, egress: Egress | None = None) -> list[dict[str, Any]]:
    """Everything but the pods, in creation order (the accounts and the secret before what
    uses them); ``token``: the store secret, if the job has none yet."""
    return [job_secret(job, token), coordinator_service_account(job), worker_service_account(job), role(job),
            role_binding(job), headless_service(job, spec), network_policy(job, spec, egress),
            worker_network_policy(job, spec, egress)]
