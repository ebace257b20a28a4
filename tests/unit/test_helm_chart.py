"""The Helm chart, rendered and linted by Helm's own engine (helm-python-sdk), every rendered
object checked against the Kubernetes API schemas (kubernetes-validate, strict)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "liveshard"
KUBE_VERSION = "1.30.0"

CUSTOM = {
    "image": {"repository": "registry.example.com/ml/liveshard-operator", "tag": "1.2.3", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "watchNamespaces": ["training", "research"],
    "operator": {"watchTimeoutSeconds": 120, "healthPort": 8081, "verbose": True, "extraArgs": ["--retry-period=3"]},
    "serviceAccount": {"name": "ls-op", "annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/x"}},
    "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"cpu": 1, "memory": "1Gi"}},
    "nodeSelector": {"node-role": "system"},
    "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"}],
    "priorityClassName": "system-cluster-critical",
    "podLabels": {"team": "ml"},
    "metrics": {"port": 9100, "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "kps"}},
                "jobs": {"podMonitor": {"enabled": True, "interval": "10s", "labels": {"release": "kps"}}}},
    "dashboard": {"enabled": True, "namespace": "monitoring"},
}

# Bring-your-own account and RBAC, no metrics endpoint.
MINIMAL = {"serviceAccount": {"create": False, "name": "preexisting"}, "rbac": {"create": False},
           "metrics": {"enabled": False}, "webhook": {"enabled": False}, "replicas": 0}

# The operator's permissions, verb by verb: what operator/kube.py and operator/handlers/ call,
# plus what the per-job Role it creates grants (RBAC escalation rules: it must hold them).
EXPECTED_NODE_RULES = {("", "nodes"): {"get", "list", "watch"},
                       # Kueue: cluster-scoped reads of the flavors an admission names, the priority class
                       ("kueue.x-k8s.io", "resourceflavors"): {"get"},
                       ("kueue.x-k8s.io", "workloadpriorityclasses"): {"get"}}
EXPECTED_JOB_RULES = {
    ("", "pods"): {"create", "delete", "get", "list", "watch", "patch"},
    ("", "events"): {"create"},
    ("", "services"): {"create"},
    ("", "serviceaccounts"): {"create"},
    ("", "secrets"): {"create"},  # the job's store secret
    ("networking.k8s.io", "networkpolicies"): {"create"},
    ("rbac.authorization.k8s.io", "roles"): {"create"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"create"},
    ("liveshard.io", "elastictrainingjobs"): {"get", "list", "watch", "patch"},
    ("liveshard.io", "elastictrainingjobs/status"): {"get", "patch", "update"},
    # ownerReferences with blockOwnerDeletion (OwnerReferencesPermissionEnforcement)
    ("liveshard.io", "elastictrainingjobs/finalizers"): {"update"},
    # Kueue: a queued job's Workloads, owned by the operator (operator/kueue.py)
    ("kueue.x-k8s.io", "workloads"): {"create", "list", "patch"},
    ("kueue.x-k8s.io", "workloads/status"): {"patch"},
}


def render(values: dict[str, Any] | None = None, namespace: str = "liveshard-system") -> list[dict[str, Any]]:
    chart = helm.Chart.load(str(CHART))
    out = chart.render(values or {}, name="ls", namespace=namespace)
    objs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        objs += [o for o in yaml.safe_load_all(text) if o]
    return objs


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def rules_of(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                out.setdefault((group, res), set()).update(rule["verbs"])
    return out


@pytest.fixture(scope="module")
def default_objs() -> list[dict[str, Any]]:
    return render()


@pytest.fixture(scope="module")
def custom_objs() -> list[dict[str, Any]]:
    return render(CUSTOM, namespace="ml-system")


def test_lint_strict_passes_with_default_and_custom_values():
    for values in ({}, CUSTOM, MINIMAL, HA):
        report = helm.lint(str(CHART), values, strict=True)
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert report["errors"] == [] and problems == [], report


# Two replicas with leader election, the webhook with a cert-manager certificate, hostPath allowed.
HA = {"replicas": 2, "webhook": {"enabled": True, "certManager": {"enabled": True}},
      "operator": {"allowHostPathCheckpoints": True,
                   "jobEgress": {"dns": "any", "apiServerCIDRs": ["172.20.0.1/32"], "apiServerPorts": [443]}},
      "watchNamespaces": ["training"]}
# CRD kinds: kubernetes-validate has no schema for them
CRD_KINDS = {"ServiceMonitor": "monitoring.coreos.com/v1", "PodMonitor": "monitoring.coreos.com/v1",
             "Certificate": "cert-manager.io/v1", "Issuer": "cert-manager.io/v1"}


@pytest.mark.parametrize("values", [{}, CUSTOM, MINIMAL, HA], ids=["default", "custom", "minimal", "ha"])
def test_every_rendered_object_is_valid_kubernetes(values):
    for obj in render(values):
        if obj["kind"] in CRD_KINDS:
            assert obj["apiVersion"] == CRD_KINDS[obj["kind"]]
            continue
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_kubernetes_validate_rejects_a_bad_object(default_objs):
    """The validator itself must be able to fail (strict mode: unknown fields)."""
    deployment = json.loads(json.dumps(by_kind(default_objs, "Deployment")[0]))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)


def test_default_render_has_exactly_the_expected_objects(default_objs):
    kinds = sorted(o["kind"] for o in default_objs)
    assert kinds == sorted(["ServiceAccount", "Deployment", "Service", "ClusterRole", "ClusterRole",
                            "ClusterRoleBinding", "ClusterRoleBinding", "Role", "RoleBinding",
                            # the validating webhook, on by default, with a certificate the chart makes
                            "Service", "ValidatingWebhookConfiguration", "Secret"])
    assert not by_kind(default_objs, "ServiceMonitor") and not by_kind(default_objs, "ConfigMap")
    assert not by_kind(default_objs, "PodMonitor") and not by_kind(default_objs, "Certificate")


def test_operator_deployment_security_and_probe(default_objs):
    (dep,) = by_kind(default_objs, "Deployment")
    spec = dep["spec"]
    # leader election is on: the new pod waits for the Lease the old one hands over
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    assert c["command"] == ["liveshard", "operator"]
    # The probe hits the port and path the operator's --liveness flag serves.
    probe = c["livenessProbe"]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert f"--liveness=http://0.0.0.0:{ports[probe['port']]}{probe['path']}" in c["args"]
    assert "--metrics-port=9090" in c["args"]
    assert c["image"] == "ghcr.io/liveshard/operator:0.1.0"  # appVersion by default


def test_operator_args_parse_with_the_real_command(custom_objs):
    """The rendered args are accepted by ``liveshard operator``'s own parser."""
    (dep,) = by_kind(custom_objs, "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    options = parse_args(c)
    assert options.namespaces == ("training", "research")
    assert options.metrics_port == 9100 and options.liveness == "http://0.0.0.0:8081/healthz"
    assert options.watch_server_timeout == 120
    assert options.leader_election.retry_period == 3  # extraArgs come last: they win


def test_custom_values_reach_the_objects(custom_objs):
    (dep,) = by_kind(custom_objs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "registry.example.com/ml/liveshard-operator:1.2.3"
    assert c["imagePullPolicy"] == "Always"
    assert c["resources"] == CUSTOM["resources"]
    assert pod["nodeSelector"] == {"node-role": "system"} and pod["tolerations"] == CUSTOM["tolerations"]
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["serviceAccountName"] == "ls-op"
    assert dep["spec"]["template"]["metadata"]["labels"]["team"] == "ml"
    assert all(o["metadata"]["namespace"] == "ml-system"
               for o in custom_objs if o["kind"] in ("Deployment", "Service", "ServiceAccount", "ServiceMonitor"))
    (sm,) = by_kind(custom_objs, "ServiceMonitor")
    (svc,) = [o for o in by_kind(custom_objs, "Service") if not o["metadata"]["name"].endswith("-webhook")]
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] == "metrics"
    assert sm["spec"]["endpoints"][0]["interval"] == "15s" and sm["metadata"]["labels"]["release"] == "kps"
    assert svc["spec"]["ports"][0]["port"] == 9100
    assert sm["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    (cm,) = by_kind(custom_objs, "ConfigMap")
    assert cm["metadata"]["namespace"] == "monitoring" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_minimal_values_render_only_the_deployment():
    objs = render(MINIMAL)
    assert [o["kind"] for o in objs] == ["Deployment"]
    (c,) = objs[0]["spec"]["template"]["spec"]["containers"]
    assert objs[0]["spec"]["replicas"] == 0
    assert objs[0]["spec"]["template"]["spec"]["serviceAccountName"] == "preexisting"
    assert "--metrics-port=0" in c["args"] and [p["name"] for p in c["ports"]] == ["health"]


def parse_args(container: dict[str, Any], monkeypatch: pytest.MonkeyPatch | None = None):
    """The container's args through ``liveshard operator``'s own parser and checks."""
    import argparse
    from unittest import mock

    from liveshard.operator.command import configure, options_from

    real_is_file = Path.is_file

    def is_file(self: Path) -> bool:  # the webhook's certificate files exist only in the pod
        return str(self).startswith("/etc/liveshard/webhook/") or real_is_file(self)

    parser = argparse.ArgumentParser()
    configure(parser)
    with mock.patch.object(Path, "is_file", is_file):
        return options_from(parser.parse_args(container["args"]))


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


# ---- leader election ---------------------------------------------------------------------------
def test_two_replicas_elect_a_leader_over_a_lease_they_may_use(monkeypatch):
    objs = render({"replicas": 2})
    (dep,) = by_kind(objs, "Deployment")
    assert dep["spec"]["replicas"] == 2
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    options = parse_args(c)
    election = options.leader_election
    assert election is not None and election.namespace == "liveshard-system" and election.name == "ls-liveshard"
    assert (election.lease_duration, election.renew_deadline, election.retry_period) == (15, 10, 2)
    env = env_of(c)  # the identity and namespace come from the downward API
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    # the Role grants exactly what operator/leader.py calls, on that Lease, in that namespace
    (role,) = by_kind(objs, "Role")
    assert role["metadata"]["namespace"] == "liveshard-system"
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": [election.name],
         "verbs": ["get", "update"]}]
    (binding,) = by_kind(objs, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"] and binding["roleRef"]["kind"] == "Role"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": dep["spec"]["template"]["spec"][
        "serviceAccountName"], "namespace": "liveshard-system"}]


def test_the_lease_calls_are_the_ones_the_role_grants():
    """Derived from the code: the verbs LeaseStore uses (kubernetes client method names)."""
    import inspect

    from liveshard.operator import leader

    source = inspect.getsource(leader.LeaseStore)
    used = {"get": "read_namespaced_lease", "create": "create_namespaced_lease", "update": "replace_namespaced_lease"}
    assert all(method in source for method in used.values())
    assert "patch_namespaced_lease" not in source and "delete_namespaced_lease" not in source


def test_without_leader_election_one_replica_at_a_time():
    objs = render({"leaderElection": {"enabled": False}})
    (dep,) = by_kind(objs, "Deployment")
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert "--no-leader-election" in c["args"] and parse_args(c).leader_election is None
    assert not by_kind(objs, "Role")
    with pytest.raises(helm.HelmError, match=re.escape("replicas > 1 needs leaderElection.enabled=true")):
        render({"replicas": 2, "leaderElection": {"enabled": False}})
    with pytest.raises(helm.HelmError, match=re.escape("retryPeriodSeconds < renewDeadlineSeconds < leaseDurationSeconds")):
        render({"leaderElection": {"renewDeadlineSeconds": 20}})


# ---- what jobs may do ----------------------------------------------------------------------------
def test_job_policy_values_reach_the_operator(monkeypatch):
    (dep,) = by_kind(render(HA), "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    policy = parse_args(c, monkeypatch).policy
    assert policy.allow_host_path_checkpoints is True
    assert policy.egress.dns == "any" and policy.egress.api_server_cidrs == ("172.20.0.1/32",)
    assert policy.egress.api_server_ports == (443,)
    (dep,) = by_kind(render({"operator": {"jobEgress": {"enabled": False}}}), "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    policy = parse_args(c).policy
    assert not policy.allow_host_path_checkpoints and not policy.egress.enabled


def test_default_job_policy_is_the_operators_default(default_objs):
    from liveshard.operator.policy import DEFAULT_POLICY

    (dep,) = by_kind(default_objs, "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert parse_args(c).policy == DEFAULT_POLICY


# ---- the validating webhook ----------------------------------------------------------------------
def test_webhook_with_cert_manager(monkeypatch):
    from liveshard.operator.admission import REVIEW_PATH
    from liveshard.runtime.contract.crd import GROUP, PLURAL, VERSION

    objs = render(HA)
    (dep,) = by_kind(objs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    options = parse_args(c, monkeypatch)
    assert options.webhook_port == 9443
    # the Service reaches the container's webhook port on every replica
    (svc,) = [o for o in by_kind(objs, "Service") if o["metadata"]["name"] == "ls-liveshard-webhook"]
    (port,) = svc["spec"]["ports"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]}[port["targetPort"]] == options.webhook_port
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    # the configuration sends reviews of the CRD's objects to that Service, failures ignored
    (vwc,) = by_kind(objs, "ValidatingWebhookConfiguration")
    (hook,) = vwc["webhooks"]
    assert hook["failurePolicy"] == "Ignore" and hook["sideEffects"] == "None"
    assert hook["admissionReviewVersions"] == ["v1"]
    assert hook["clientConfig"]["service"] == {"name": "ls-liveshard-webhook", "namespace": "liveshard-system",
                                               "path": REVIEW_PATH, "port": port["port"]}
    assert hook["rules"] == [{"apiGroups": [GROUP], "apiVersions": [VERSION], "resources": [PLURAL],
                              "operations": ["CREATE", "UPDATE"], "scope": "Namespaced"}]
    assert hook["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["training"]}]
    # cert-manager: a certificate for the Service's names, its CA injected, its Secret mounted
    (cert,) = by_kind(objs, "Certificate")
    (issuer,) = by_kind(objs, "Issuer")
    assert vwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == \
        f"liveshard-system/{cert['metadata']['name']}"
    assert "caBundle" not in hook["clientConfig"]
    assert "ls-liveshard-webhook.liveshard-system.svc" in cert["spec"]["dnsNames"]
    assert cert["spec"]["issuerRef"] == {"name": issuer["metadata"]["name"], "kind": "Issuer"}
    assert issuer["spec"] == {"selfSigned": {}}
    volumes = {v["name"]: v for v in pod["volumes"]}
    (mount,) = [m for m in c["volumeMounts"] if volumes[m["name"]].get("secret")]
    assert volumes[mount["name"]]["secret"]["secretName"] == cert["spec"]["secretName"]
    assert options.webhook_cert_file == f"{mount['mountPath']}/tls.crt"
    assert options.webhook_key_file == f"{mount['mountPath']}/tls.key"


def test_webhook_without_cert_manager_uses_a_given_secret_and_ca():
    objs = render({"webhook": {"enabled": True, "secretName": "my-tls", "caBundle": "Q0E=", "failurePolicy": "Fail"}})
    assert not by_kind(objs, "Certificate") and not by_kind(objs, "Issuer")
    (vwc,) = by_kind(objs, "ValidatingWebhookConfiguration")
    assert vwc["webhooks"][0]["clientConfig"]["caBundle"] == "Q0E=" and vwc["webhooks"][0]["failurePolicy"] == "Fail"
    assert "annotations" not in vwc["metadata"] and "namespaceSelector" not in vwc["webhooks"][0]
    (dep,) = by_kind(objs, "Deployment")
    assert {"name": "webhook-cert", "secret": {"secretName": "my-tls"}} in dep["spec"]["template"]["spec"]["volumes"]
    # a caBundle alone: the user's Secret under the default name; the chart makes none
    objs = render({"webhook": {"caBundle": "Q0E="}})
    assert not by_kind(objs, "Secret")
    (vwc,) = by_kind(objs, "ValidatingWebhookConfiguration")
    assert vwc["webhooks"][0]["clientConfig"]["caBundle"] == "Q0E="
    (dep,) = by_kind(objs, "Deployment")
    assert {"name": "webhook-cert", "secret": {"secretName": "ls-liveshard-webhook-tls"}} in \
        dep["spec"]["template"]["spec"]["volumes"]
    issuer = {"name": "corp-ca", "kind": "ClusterIssuer"}
    objs = render({"webhook": {"enabled": True, "certManager": {"enabled": True, "issuerRef": issuer}}})
    assert not by_kind(objs, "Issuer") and by_kind(objs, "Certificate")[0]["spec"]["issuerRef"] == issuer


def _handshake(cert_pem: bytes, key_pem: bytes, ca_pem: bytes, server_name: str, tmp: Path) -> None:
    """A TLS handshake in memory: the server serves ``cert_pem``; the client trusts only
    ``ca_pem`` and checks the certificate is for ``server_name``, as the API server does."""
    import ssl

    (tmp / "tls.crt").write_bytes(cert_pem)
    (tmp / "tls.key").write_bytes(key_pem)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp / "tls.crt", tmp / "tls.key")
    client = ssl.create_default_context(cadata=ca_pem.decode())
    pipes = [ssl.MemoryBIO() for _ in range(4)]  # client in/out, server in/out
    c = client.wrap_bio(pipes[0], pipes[1], server_hostname=server_name)
    s = server.wrap_bio(pipes[2], pipes[3], server_side=True)
    done = [False, False]
    for _ in range(20):
        for i, end in enumerate((c, s)):
            if not done[i]:
                try:
                    end.do_handshake()
                    done[i] = True
                except ssl.SSLWantReadError:
                    pass
        pipes[2].write(pipes[1].read())
        pipes[0].write(pipes[3].read())
        if all(done):
            return
    raise AssertionError("the TLS handshake did not finish")


def test_webhook_is_on_by_default_with_a_certificate_the_chart_makes(default_objs, monkeypatch, tmp_path):
    """With neither cert-manager nor a Secret of the user's, the chart makes a CA and a serving
    certificate: the Secret the operator mounts, and the caBundle the API server verifies with."""
    import base64
    import ssl

    (dep,) = by_kind(default_objs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    options = parse_args(c, monkeypatch)
    assert options.webhook_port == 9443
    (secret,) = by_kind(default_objs, "Secret")
    assert secret["type"] == "kubernetes.io/tls"
    assert {"name": "webhook-cert", "secret": {"secretName": secret["metadata"]["name"]}} in pod["volumes"]
    (vwc,) = by_kind(default_objs, "ValidatingWebhookConfiguration")
    (hook,) = vwc["webhooks"]
    assert hook["failurePolicy"] == "Ignore" and hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    service = hook["clientConfig"]["service"]
    pem = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    # what the API server dials: <service>.<namespace>.svc, trusting only the caBundle
    _handshake(pem["tls.crt"], pem["tls.key"], base64.b64decode(hook["clientConfig"]["caBundle"]),
               f"{service['name']}.{service['namespace']}.svc", tmp_path)
    with pytest.raises(ssl.SSLCertVerificationError):  # the check can fail: another name
        _handshake(pem["tls.crt"], pem["tls.key"], pem["ca.crt"], "elsewhere.liveshard-system.svc", tmp_path)
    other = render()  # each render without a cluster makes a new CA: it does not vouch for this one
    (other_secret,) = by_kind(other, "Secret")
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(pem["tls.crt"], pem["tls.key"], base64.b64decode(other_secret["data"]["ca.crt"]),
                   f"{service['name']}.{service['namespace']}.svc", tmp_path)


def test_the_operator_needs_no_rbac_for_the_webhook():
    """The chart, not the operator, owns the webhook configuration and the certificate."""
    for role in by_kind(render(HA), "ClusterRole") + by_kind(render(HA), "Role"):
        resources = {r for rule in role["rules"] for r in rule["resources"]}
        assert not resources & {"validatingwebhookconfigurations", "certificates", "secrets/status"}
        assert ("", "secrets") not in {(g, r) for rule in role["rules"] for g in rule["apiGroups"]
                                       for r in rule["resources"] if "get" in rule["verbs"]}


def test_rbac_has_no_wildcards_and_exactly_the_listed_verbs(default_objs):
    roles = {r["metadata"]["name"]: r for r in by_kind(default_objs, "ClusterRole")}
    assert set(roles) == {"ls-liveshard-nodes", "ls-liveshard-jobs"}
    for role in roles.values():
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[field], (role["metadata"]["name"], rule)
            assert "nonResourceURLs" not in rule and "resourceNames" not in rule
    assert rules_of(roles["ls-liveshard-nodes"]) == EXPECTED_NODE_RULES
    assert rules_of(roles["ls-liveshard-jobs"]) == EXPECTED_JOB_RULES
    bindings = by_kind(default_objs, "ClusterRoleBinding")
    assert sorted(b["roleRef"]["name"] for b in bindings) == sorted(roles)
    for b in bindings:
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": "ls-liveshard", "namespace": "liveshard-system"}]


def test_watch_namespaces_bind_job_permissions_only_there(custom_objs):
    (crb,) = by_kind(custom_objs, "ClusterRoleBinding")  # nodes only: they are cluster-scoped
    assert crb["roleRef"]["name"] == "ls-liveshard-nodes"
    rbs = [rb for rb in by_kind(custom_objs, "RoleBinding") if rb["roleRef"]["kind"] == "ClusterRole"]
    assert sorted(rb["metadata"]["namespace"] for rb in rbs) == ["research", "training"]
    for rb in rbs:
        assert rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                 "name": "ls-liveshard-jobs"}
        assert rb["subjects"] == [{"kind": "ServiceAccount", "name": "ls-op", "namespace": "ml-system"}]


def test_operator_holds_every_permission_it_uses_and_grants(default_objs):
    """Derived from the code: every kind Kube.create makes, and the per-job Role's rules (which
    the operator may only grant if it holds them)."""
    from liveshard.operator import builders
    from liveshard.runtime.contract.jobspec import read_spec

    roles = {r["metadata"]["name"]: r for r in by_kind(default_objs, "ClusterRole")}
    held = rules_of(roles["ls-liveshard-jobs"])
    job = {"apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob",
           "metadata": {"name": "j", "namespace": "ns", "uid": "u"},
           "spec": {"model": {"preset": "tiny-gpt"}, "image": "img", "workers": {"max": 2, "gpusPerWorker": 1},
                    "training": {"data": {"mock": True}, "trainIters": 1000, "globalBatch": 8}}}
    spec = read_spec(job["spec"])
    plural = {"Pod": "pods", "Service": "services", "ServiceAccount": "serviceaccounts", "Role": "roles",
              "RoleBinding": "rolebindings", "NetworkPolicy": "networkpolicies", "Secret": "secrets"}
    for child in [*builders.job_children(job, spec, "t0ken"), builders.worker_pod(job, spec, 0),
                  builders.coordinator_pod(job, spec)]:
        group = child["apiVersion"].rpartition("/")[0]
        assert "create" in held[(group, plural[child["kind"]])], child["kind"]
    for rule in builders.role(job)["rules"]:
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                assert set(rule["verbs"]) <= held[(group, res)], (res, rule["verbs"])


@pytest.mark.parametrize(("bad", "where"), [
    ({"replicas": "two"}, "/replicas"),
    ({"unknownKey": True}, "unknownKey"),
    ({"image": {"repository": ""}}, "/image/repository"),
    ({"image": {"repository": "x", "pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"watchNamespaces": ["Not_A_Namespace"]}, "/watchNamespaces/0"),
    ({"resources": {"requests": {"cpu": "lots"}}}, "/resources/requests/cpu"),
    ({"metrics": {"serviceMonitor": {"enabled": "yes"}}}, "/metrics/serviceMonitor/enabled"),
    ({"operator": {"healthPort": 70000}}, "/operator/healthPort"),
    ({"metrics": {"jobs": {"podMonitor": {"interval": "often"}}}}, "/metrics/jobs/podMonitor/interval"),
    ({"metrics": {"jobs": {"podMonitor": {"namespaceSelector": {"matchNames": ["Bad_NS"]}}}}},
     "/metrics/jobs/podMonitor/namespaceSelector/matchNames/0"),
    ({"metrics": {"jobs": {"podMonitor": {"namespaceSelector": {"all": True}}}}},
     "/metrics/jobs/podMonitor/namespaceSelector"),
    ({"replicas": 9}, "/replicas"),
    ({"leaderElection": {"leaseDurationSeconds": "15s"}}, "/leaderElection/leaseDurationSeconds"),
    ({"operator": {"allowHostPathCheckpoints": "yes"}}, "/operator/allowHostPathCheckpoints"),
    ({"operator": {"jobEgress": {"dns": "coredns"}}}, "/operator/jobEgress/dns"),
    ({"operator": {"jobEgress": {"apiServerCIDRs": ["kubernetes.default"]}}}, "/operator/jobEgress/apiServerCIDRs/0"),
    ({"webhook": {"failurePolicy": "Sometimes"}}, "/webhook/failurePolicy"),
    ({"webhook": {"certManager": {"issuerRef": {"kind": "Vault"}}}}, "/webhook/certManager/issuerRef/kind"),
], ids=lambda v: json.dumps(v) if isinstance(v, dict) else "")
def test_schema_rejects_broken_values(bad, where):
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmValuesError, match=re.escape(where)):
        chart.validate_schema(bad)
    with pytest.raises(helm.HelmError):  # an install renders with the same check
        chart.render(bad, name="ls", namespace="x")


def test_schema_accepts_the_defaults_and_custom_values():
    chart = helm.Chart.load(str(CHART))
    chart.validate_schema({})
    chart.validate_schema(CUSTOM)
    chart.validate_schema(HA)


def test_chart_crd_is_the_top_level_crd_byte_for_byte():
    assert (CHART / "crds" / "elastictrainingjob.yaml").read_bytes() == \
        (ROOT / "crds" / "elastictrainingjob.yaml").read_bytes(), \
        "run: cp crds/elastictrainingjob.yaml helm/liveshard/crds/"
    assert not (CHART / "crds" / "elastictrainingjob.yaml").is_symlink()  # `helm package` drops links
    chart = helm.Chart.load(str(CHART))
    (crd,) = chart.crds
    obj = yaml.safe_load(crd["data"])
    assert obj["metadata"]["name"] == "elastictrainingjobs.liveshard.io"
    kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_dashboard_queries_only_metrics_the_operator_and_coordinators_export():
    from prometheus_client import REGISTRY

    from liveshard.operator import metrics  # noqa: F401  (registers the operator's metrics)
    from liveshard.runtime.control.metrics import JobMetrics

    job_registry = JobMetrics("any").registry
    collected = [f for registry in (REGISTRY, job_registry) for f in registry.collect()
                 if f.name.startswith("liveshard_")]
    exported = set()
    for family in collected:
        exported.add(family.name)
        exported.update(s.name for s in family.samples)
        if family.type == "counter":
            exported.add(family.name + "_total")
        if family.type == "histogram":
            exported.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
    dash = json.loads((CHART / "dashboards" / "liveshard.json").read_text())
    used = set()
    for panel in dash["panels"]:
        for target in panel.get("targets", ()):  # a row has none
            used.update(re.findall(r"liveshard_[a-z_]+", target["expr"]))
    assert used and used <= exported, used - exported
    # Every metric family the operator and a job's coordinator export is on the dashboard.
    families = {f.name for f in collected}
    assert {f for f in families if f.startswith("liveshard_job_")}, families
    assert all(any(u.startswith(f) for u in used) for f in families), families


def test_dashboard_job_panels_follow_the_job_variable():
    from liveshard.runtime.control.metrics import JobMetrics

    dash = json.loads((CHART / "dashboards" / "liveshard.json").read_text())
    (var,) = [v for v in dash["templating"]["list"] if v["name"] == "job"]
    family = re.search(r"label_values\((liveshard_job_[a-z_]+), job\)", var["query"]["query"]).group(1)
    assert family in {f.name for f in JobMetrics("any").registry.collect()}
    job_exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", ()) if "liveshard_job_" in t["expr"]]
    assert len(job_exprs) >= 10
    for expr in job_exprs:
        selectors = re.findall(r"liveshard_job_[a-z_]+(\{[^}]*\})?", expr)
        assert selectors and all(sel == '{job=~"$job"}' for sel in selectors), expr
    quantiles = [e for e in job_exprs if "reconfiguration_seconds" in e]
    assert sorted(re.search(r"histogram_quantile\(([0-9.]+)", e).group(1) for e in quantiles) == ["0.5", "0.95"]
    assert all("sum by (le, phase)" in e for e in quantiles)


# ---- the jobs' PodMonitor --------------------------------------------------------------------
def _coordinator_and_worker_pods() -> tuple[dict[str, Any], dict[str, Any]]:
    from liveshard.operator import builders
    from liveshard.runtime.contract.jobspec import read_spec

    job = {"apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob",
           "metadata": {"name": "j", "namespace": "ns", "uid": "u"},
           "spec": {"model": {"preset": "tiny-gpt"}, "image": "img", "workers": {"max": 2, "gpusPerWorker": 1},
                    "training": {"data": {"mock": True}, "trainIters": 10, "globalBatch": 8}}}
    spec = read_spec(job["spec"])
    return builders.coordinator_pod(job, spec), builders.worker_pod(job, spec, 0)


def test_pod_monitor_selects_the_coordinators_metrics_port(custom_objs):
    from liveshard.runtime.contract.crd import LABEL_ROLE, ROLE_COORDINATOR

    (pm,) = by_kind(custom_objs, "PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["metadata"]["name"] == "ls-liveshard-jobs" and pm["metadata"]["namespace"] == "ml-system"
    assert pm["metadata"]["labels"]["release"] == "kps"
    selector = pm["spec"]["selector"]["matchLabels"]
    assert selector[LABEL_ROLE] == ROLE_COORDINATOR
    # The labels the operator really puts on a coordinator pod, and not on a worker pod.
    coordinator, worker = _coordinator_and_worker_pods()
    assert selector.items() <= coordinator["metadata"]["labels"].items()
    assert not selector.items() <= worker["metadata"]["labels"].items()
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint == {"port": "metrics", "path": "/metrics", "interval": "10s", "honorLabels": True}


@pytest.mark.parametrize(("selector", "rendered"), [
    ({"matchNames": ["training", "research"]}, {"matchNames": ["training", "research"]}),  # wins over any
    ({"any": False}, {"any": False}),  # the release's namespace only
])
def test_pod_monitor_namespace_selector(selector, rendered):
    values = {"metrics": {"jobs": {"podMonitor": {"enabled": True, "namespaceSelector": selector}}}}
    (pm,) = by_kind(render(values), "PodMonitor")
    assert pm["spec"]["namespaceSelector"] == rendered
    assert pm["spec"]["podMetricsEndpoints"][0]["interval"] == "30s"  # the default
    report = helm.lint(str(CHART), values, strict=True)
    assert report["errors"] == [] and not [m for m in report["messages"] if m["severity"] >= 2], report


def test_pod_monitor_needs_no_operator_metrics():
    (pm,) = by_kind(render({**MINIMAL, "metrics": {"enabled": False, "jobs": {"podMonitor": {"enabled": True}}}}),
                    "PodMonitor")
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_the_kueue_calls_are_the_ones_the_roles_grant(default_objs):
    """Derived from the code: the kubernetes client methods the operator's Kueue calls use."""
    import inspect

    from liveshard.operator.kube import Kube

    roles = {r["metadata"]["name"]: r for r in by_kind(default_objs, "ClusterRole")}
    jobs, nodes = rules_of(roles["ls-liveshard-jobs"]), rules_of(roles["ls-liveshard-nodes"])
    verbs = {"list_namespaced_custom_object": ("list", "workloads", jobs),
             "create_namespaced_custom_object": ("create", "workloads", jobs),
             "patch_namespaced_custom_object": ("patch", "workloads", jobs),
             "patch_namespaced_custom_object_status": ("patch", "workloads/status", jobs),
             "get_cluster_custom_object": ("get", "resourceflavors", nodes)}
    source = "".join(inspect.getsource(getattr(Kube, m)) for m in
                     ("list_workloads", "get_cluster_object", "create_workload", "patch_workload"))
    used = {m for m in verbs if f"self.custom.{m}" in source}
    assert used == set(verbs)
    for verb, resource, held in verbs.values():
        assert verb in held[("kueue.x-k8s.io", resource)], (verb, resource)
    assert "get" in nodes[("kueue.x-k8s.io", "workloadpriorityclasses")]
