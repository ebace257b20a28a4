"""The objects a job owns: names, labels, owner references, placement, access."""

from __future__ import annotations

import json

import pytest

from liveshard.operator import builders
from liveshard.operator.policy import Egress
from liveshard.runtime.contract.crd import LABEL_JOB, LABEL_ROLE
from liveshard.runtime.contract.jobspec import read_spec
from liveshard.runtime.errors import ConfigError

JOB = {"apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob",
       "metadata": {"name": "llm", "namespace": "ml", "uid": "u-1"},
       "spec": {"model": {"preset": "llama3-8b"}, "image": "ghcr.io/example/train:1",
                "workers": {"min": 2, "max": 8, "gpusPerWorker": 8},
                "training": {"data": {"mock": True}, "trainIters": 1000, "globalBatch": 256},
                "template": {"nodeSelector": {"pool": "spot-h100"},
                             "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
                             "resources": {"requests": {"cpu": "90"}, "limits": {"memory": "1500Gi"}},
                             "labels": {"team": "llm"}, "terminationGracePeriodSeconds": 90},
                "checkpoint": {"path": "/ckpt", "volume": {"persistentVolumeClaim": {"claimName": "ckpt"}}},
                "coordinator": {"port": 29500},
                "env": [{"name": "NCCL_DEBUG", "value": "WARN"}]}}
SPEC = read_spec(JOB["spec"])


def env(container):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_worker_pod():
    pod = builders.worker_pod(JOB, SPEC, 3)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "llm-worker-3" and meta["namespace"] == "ml"
    assert meta["labels"]["liveshard.io/worker-index"] == "3" and meta["labels"]["team"] == "llm"
    assert meta["labels"]["liveshard.io/role"] == "worker" and meta["labels"]["liveshard.io/job"] == "llm"
    assert meta["ownerReferences"] == [{"apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob",
                                        "name": "llm", "uid": "u-1", "controller": True,
                                        "blockOwnerDeletion": True}]
    assert spec["restartPolicy"] == "Never" and spec["terminationGracePeriodSeconds"] == 90
    # a worker's one-line error (the end of its log) becomes its termination message
    assert spec["containers"][0]["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert spec["nodeSelector"] == {"pool": "spot-h100"} and spec["tolerations"][0]["key"] == "spot"
    assert spec["hostname"] == "llm-worker-3" and spec["subdomain"] == "llm"
    assert spec["serviceAccountName"] == "llm-worker"
    c = spec["containers"][0]
    assert c["resources"]["limits"] == {"memory": "1500Gi", "nvidia.com/gpu": "8"}
    assert c["resources"]["requests"] == {"cpu": "90"}
    assert JOB["spec"]["template"]["resources"]["limits"] == {"memory": "1500Gi"}  # not mutated
    e = env(c)
    assert e["LIVESHARD_COORDINATOR"] == "llm-coordinator.llm.ml.svc:29500"
    assert e["LIVESHARD_WORKER_INDEX"] == "3" and e["LIVESHARD_GPUS_PER_WORKER"] == "8"
    assert json.loads(e["LIVESHARD_MODEL"])["num_layers"] == 32
    assert e["NCCL_DEBUG"] == "WARN" and e["LIVESHARD_CHECKPOINT_DIR"] == "/ckpt"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts == {"checkpoint": "/ckpt", "dshm": "/dev/shm", "tmp": "/tmp"}
    assert {"name": "checkpoint", "persistentVolumeClaim": {"claimName": "ckpt"}} in spec["volumes"]


def test_coordinator_pod_avoids_spot_capacity_by_default():
    pod = builders.coordinator_pod(JOB, SPEC)
    assert pod["metadata"]["name"] == "llm-coordinator"
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert len(terms) == 1  # one term: all expressions must hold
    exprs = {e["key"]: (e["operator"], e["values"]) for e in terms[0]["matchExpressions"]}
    assert exprs["karpenter.sh/capacity-type"] == ("NotIn", ["spot"])
    assert exprs["eks.amazonaws.com/capacityType"] == ("NotIn", ["SPOT"])
    assert exprs["kubernetes.azure.com/scalesetpriority"] == ("NotIn", ["spot"])
    assert pod["spec"]["containers"][0]["ports"][0]["containerPort"] == 29500
    assert "nvidia.com/gpu" not in pod["spec"]["containers"][0]["resources"].get("limits", {})
    custom = dict(JOB, spec={**JOB["spec"], "coordinator": {"affinity": {"podAffinity": {}}}})
    assert builders.coordinator_pod(custom, read_spec(custom["spec"]))["spec"]["affinity"] == {"podAffinity": {}}


def test_service_policy_and_rbac_are_scoped_to_the_job():
    svc, policy = builders.headless_service(JOB, SPEC), builders.network_policy(JOB, SPEC)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == {"liveshard.io/job": "llm"}
    assert policy["spec"]["podSelector"]["matchLabels"] == {"liveshard.io/job": "llm", "liveshard.io/role": "coordinator"}
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"liveshard.io/job": "llm"}}}],
                                          "ports": [{"protocol": "TCP", "port": 29500}]},
                                         {"ports": [{"protocol": "TCP", "port": 9400}]}]  # metrics only
    role = builders.role(JOB)
    assert role["metadata"]["name"] == "llm-coordinator"
    assert all(rule["resourceNames"] == ["llm"] for rule in role["rules"])
    writes = [rule for rule in role["rules"] if {"patch", "update"} & set(rule["verbs"])]
    assert writes == [{"apiGroups": ["liveshard.io"], "resources": ["elastictrainingjobs/status"],
                       "resourceNames": ["llm"], "verbs": ["get", "patch", "update"]}]
    kinds = [o["kind"] for o in builders.job_children(JOB, SPEC, "t0ken")]
    assert kinds == ["Secret", "ServiceAccount", "ServiceAccount", "Role", "RoleBinding", "Service", "NetworkPolicy",
                     "NetworkPolicy"]
    assert all(o["metadata"]["ownerReferences"][0]["uid"] == "u-1" for o in builders.job_children(JOB, SPEC, "t0ken"))


def test_the_coordinator_alone_is_bound_to_the_jobs_role_and_workers_have_an_account_bound_to_nothing():
    children = builders.job_children(JOB, SPEC, "t0ken")
    accounts = {o["metadata"]["name"]: o for o in children if o["kind"] == "ServiceAccount"}
    assert sorted(accounts) == ["llm-coordinator", "llm-worker"]
    (binding,) = [o for o in children if o["kind"] == "RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llm-coordinator", "namespace": "ml"}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "llm-coordinator"}
    # the pods use those accounts; the workers' token is never mounted, by the pod and by the account
    coordinator, worker = builders.coordinator_pod(JOB, SPEC), builders.worker_pod(JOB, SPEC, 0)
    assert coordinator["spec"]["serviceAccountName"] == "llm-coordinator"
    assert worker["spec"]["serviceAccountName"] == "llm-worker"
    assert worker["spec"]["automountServiceAccountToken"] is False
    assert accounts["llm-worker"]["automountServiceAccountToken"] is False
    assert "automountServiceAccountToken" not in accounts["llm-coordinator"]
    assert not [b for b in children if b["kind"] == "RoleBinding"
                and any(s["name"] == worker["spec"]["serviceAccountName"] for s in b["subjects"])]


# The Pod Security Standards' "restricted" profile, as the PodSecurity admission plugin checks it.
ALLOWED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                   "projected", "secret"}


def restricted_violations(pod: dict) -> list[str]:
    spec, out = pod["spec"], []
    psc = spec.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            out.append(key)
    for v in spec.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            out.append(f"volume {v['name']}: {sorted(kinds)}")
    for c in spec["containers"]:
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"{c['name']}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{c['name']}: allowPrivilegeEscalation not false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []) or set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{c['name']}: capabilities")
        if not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")):
            out.append(f"{c['name']}: runAsNonRoot")
        if 0 in (sc.get("runAsUser"), psc.get("runAsUser")):
            out.append(f"{c['name']}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{c['name']}: seccompProfile")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            out.append(f"{c['name']}: hostPort")
    return out


def test_pods_pass_pod_security_restricted():
    for pod in (builders.worker_pod(JOB, SPEC, 0), builders.coordinator_pod(JOB, SPEC)):
        assert restricted_violations(pod) == [], pod["metadata"]["name"]
        c = pod["spec"]["containers"][0]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert {"name": "HOME", "value": "/tmp"} in c["env"]  # caches go to the writable scratch space
    # the check can fail: a root container with a hostPath volume is refused
    bad = builders.worker_pod(JOB, SPEC, 0)
    bad["spec"]["securityContext"]["runAsUser"] = 0
    bad["spec"]["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    assert len(restricted_violations(bad)) == 2


def test_workers_carry_no_api_token_and_only_the_job_reaches_its_pods():
    assert builders.worker_pod(JOB, SPEC, 0)["spec"]["automountServiceAccountToken"] is False
    assert "automountServiceAccountToken" not in builders.coordinator_pod(JOB, SPEC)["spec"]
    policy = builders.worker_network_policy(JOB)
    assert policy["spec"]["podSelector"]["matchLabels"] == {LABEL_JOB: "llm", LABEL_ROLE: "worker"}
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": {LABEL_JOB: "llm"}}}]}]


# ---- egress ----------------------------------------------------------------------------------
JOB_PODS = {"to": [{"podSelector": {"matchLabels": {LABEL_JOB: "llm"}}}]}
DNS_PORTS = [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
KUBE_DNS = {"to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
            "ports": DNS_PORTS}


def test_worker_egress_is_the_jobs_pods_and_dns_only():
    policy = builders.worker_network_policy(JOB, SPEC)
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert policy["spec"]["egress"] == [JOB_PODS, KUBE_DNS]
    # nothing reaches the API server or the internet: no ipBlock anywhere
    assert "ipBlock" not in json.dumps(policy)


def test_coordinator_egress_adds_the_api_server():
    policy = builders.network_policy(JOB, SPEC)
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    jobs_pods, dns, api = policy["spec"]["egress"]
    assert (jobs_pods, dns) == (JOB_PODS, KUBE_DNS)
    assert api == {"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}, {"ipBlock": {"cidr": "::/0"}}],
                   "ports": [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 6443}]}
    narrow = Egress(dns="any", api_server_cidrs=("172.20.0.1/32",), api_server_ports=(443,))
    jobs_pods, dns, api = builders.network_policy(JOB, SPEC, narrow)["spec"]["egress"]
    assert dns == {"ports": DNS_PORTS}  # port 53 anywhere (NodeLocal DNSCache)
    assert api == {"to": [{"ipBlock": {"cidr": "172.20.0.1/32"}}], "ports": [{"protocol": "TCP", "port": 443}]}


def test_extra_egress_goes_to_the_workers_only():
    s3 = {"to": [{"ipBlock": {"cidr": "52.216.0.0/15"}}], "ports": [{"port": 443, "protocol": "TCP"}]}
    spec = read_spec({**JOB["spec"], "network": {"extraEgress": [s3]}})
    assert builders.worker_network_policy(JOB, spec)["spec"]["egress"] == [JOB_PODS, KUBE_DNS, s3]
    assert s3 not in builders.network_policy(JOB, spec)["spec"]["egress"]
    children = builders.job_children(JOB, spec, "t0ken")
    assert [o["spec"]["egress"][-1] for o in children if o["metadata"]["name"] == "llm-workers"] == [s3]


def test_egress_can_be_left_open_by_the_operator():
    off = Egress(enabled=False)
    for policy in (builders.network_policy(JOB, SPEC, off), builders.worker_network_policy(JOB, SPEC, off)):
        assert policy["spec"]["policyTypes"] == ["Ingress"] and "egress" not in policy["spec"]


@pytest.mark.parametrize(("network", "field"), [
    ({"extraEgress": {"to": []}}, "spec.network.extraEgress"),
    ({"extraEgress": [{"to": [], "from": []}]}, "spec.network.extraEgress[0]"),
    ({"extraEgress": [{}, "443"]}, "spec.network.extraEgress[1]"),
    ({"extraEgress": [{"ports": {"port": 443}}]}, "spec.network.extraEgress[0].ports"),
])
def test_bad_extra_egress_names_the_field(network, field):
    with pytest.raises(ConfigError) as e:
        read_spec({**JOB["spec"], "network": network})
    assert e.value.field == field


def test_a_gpu_stack_may_replace_the_pod_security_context():
    spec = read_spec({**JOB["spec"], "template": {"securityContext": {"runAsUser": 1000, "runAsNonRoot": True,
                                                                      "seccompProfile": {"type": "RuntimeDefault"}}}})
    pod = builders.worker_pod(JOB, spec, 0)
    assert pod["spec"]["securityContext"]["runAsUser"] == 1000
    assert pod["spec"]["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
