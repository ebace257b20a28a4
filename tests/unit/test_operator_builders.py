"""The objects a job owns: names, labels, owner references, placement, access."""

from __future__ import annotations

import json

from liveshard.operator import builders
from liveshard.runtime.contract.jobspec import read_spec

JOB = {"apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob",
       "metadata": {"name": "llm", "namespace": "ml", "uid": "u-1"},
       "spec": {"model": {"preset": "llama3-8b"}, "image": "ghcr.io/example/train:1",
                "workers": {"min": 2, "max": 8, "gpusPerWorker": 8},
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
    assert spec["nodeSelector"] == {"pool": "spot-h100"} and spec["tolerations"][0]["key"] == "spot"
    assert spec["hostname"] == "llm-worker-3" and spec["subdomain"] == "llm"
    assert spec["serviceAccountName"] == "llm-liveshard"
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
    assert mounts == {"checkpoint": "/ckpt", "dshm": "/dev/shm"}
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
                                          "ports": [{"protocol": "TCP", "port": 29500}]}]
    role = builders.role(JOB)
    assert all(rule["resourceNames"] == ["llm"] for rule in role["rules"])
    writes = [rule for rule in role["rules"] if {"patch", "update"} & set(rule["verbs"])]
    assert writes == [{"apiGroups": ["liveshard.io"], "resources": ["elastictrainingjobs/status"],
                       "resourceNames": ["llm"], "verbs": ["get", "patch", "update"]}]
    binding = builders.role_binding(JOB)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llm-liveshard", "namespace": "ml"}]
    kinds = [o["kind"] for o in builders.job_children(JOB, SPEC)]
    assert kinds == ["ServiceAccount", "Role", "RoleBinding", "Service", "NetworkPolicy"]
    assert all(o["metadata"]["ownerReferences"][0]["uid"] == "u-1" for o in builders.job_children(JOB, SPEC))
