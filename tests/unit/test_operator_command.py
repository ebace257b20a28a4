"""``liveshard operator``: flags, errors, and the admission review."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from liveshard.operator import admission
from liveshard.operator.command import configure, options_from
from liveshard.operator.policy import DEFAULT_POLICY, JobPolicy
from liveshard.runtime.cli import main
from liveshard.runtime.errors import ConfigError


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["operator", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--namespace", "--kubeconfig", "--metrics-port", "--liveness", "--watch-timeout", "--webhook-port",
                 "--webhook-cert-file", "--webhook-key-file", "--leader-election", "--leader-election-namespace",
                 "--lease-duration", "--renew-deadline", "--retry-period", "--allow-host-path-checkpoints",
                 "--egress-policy", "--dns-egress", "--api-server-cidr", "--api-server-port"):
        assert flag in out


@pytest.mark.parametrize("argv,message", [
    (["operator", "--watch-timeout", "0"], "liveshard operator: error: --watch-timeout: 0 is not a positive"),
    (["operator", "--metrics-port", "70000"], "liveshard operator: error: --metrics-port: 70000 is not a port"),
    (["operator", "--webhook-port", "9443"], "liveshard operator: error: --webhook-cert-file: is required with "
                                             "--webhook-port"),
    (["operator", "--webhook-port", "9443", "--webhook-cert-file", "/nonexistent/tls.crt", "--webhook-key-file",
      "/nonexistent/tls.key"], "liveshard operator: error: --webhook-cert-file: /nonexistent/tls.crt is not a file"),
    (["operator", "--webhook-key-file", "k.pem"], "liveshard operator: error: --webhook-key-file: is given without"),
    (["operator", "--renew-deadline", "20"], "liveshard operator: error: --renew-deadline: needs 0 < --retry-period"),
    (["operator", "--api-server-cidr", "10.0.0.0/33"], "liveshard operator: error: --api-server-cidr: '10.0.0.0/33'"),
    (["operator", "--metrics-address", "localhost"], "liveshard operator: error: --metrics-address: 'localhost' is "
                                                     "not an IP address"),
])
def test_bad_flags_are_one_clear_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err


def test_parsing_the_command_line_imports_neither_kopf_nor_kubernetes():
    code = ("import sys; from liveshard.runtime.cli import _lazy_parser; "
            "_lazy_parser(['operator']).parse_args(['operator']); "
            "print(sorted(m for m in ('kopf', 'kubernetes', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    configure(parser)
    return options_from(parser.parse_args(list(argv)))


def test_leader_election_is_on_by_default_with_a_unique_identity(monkeypatch):
    monkeypatch.setenv("POD_NAMESPACE", "liveshard-system")
    monkeypatch.setenv("POD_NAME", "liveshard-5d8f-abcde")
    first, second = parse().leader_election, parse().leader_election
    assert first is not None and first.namespace == "liveshard-system" and first.name == "liveshard-operator"
    assert first.identity.startswith("liveshard-5d8f-abcde_") and first.identity != second.identity
    assert (first.lease_duration, first.renew_deadline, first.retry_period) == (15.0, 10.0, 2.0)
    chosen = parse("--leader-election-namespace", "ops", "--leader-election-lease", "ls", "--lease-duration", "30",
                   "--renew-deadline", "20", "--retry-period", "4").leader_election
    assert (chosen.namespace, chosen.name, chosen.lease_duration, chosen.renew_deadline) == ("ops", "ls", 30, 20)
    assert parse("--no-leader-election").leader_election is None


def test_job_policy_flags():
    assert parse().policy == DEFAULT_POLICY
    assert not DEFAULT_POLICY.allow_host_path_checkpoints and DEFAULT_POLICY.egress.enabled
    policy = parse("--allow-host-path-checkpoints", "--no-egress-policy", "--dns-egress", "any",
                   "--api-server-cidr", "172.20.0.1/32", "--api-server-port", "443").policy
    assert policy.allow_host_path_checkpoints and not policy.egress.enabled and policy.egress.dns == "any"
    assert policy.egress.api_server_cidrs == ("172.20.0.1/32",) and policy.egress.api_server_ports == (443,)


# ---- the admission review ------------------------------------------------------------------------
SPEC = {"model": {"preset": "llama3-8b"}, "image": "img", "workers": {"max": 2},
        "training": {"data": {"mock": True}, "trainIters": 1000, "globalBatch": 8}}
HOST_PATH = {**SPEC, "checkpoint": {"path": "/ckpt", "volume": {"hostPath": {"path": "/mnt/ckpt"}}}}


def review(operation, spec, old_spec=None, policy=DEFAULT_POLICY, **request):
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "req-1", "operation": operation, "object": {"spec": spec},
                        **({"oldObject": {"spec": old_spec}} if old_spec is not None else {}), **request}}
    out = admission.review(body, policy)
    assert out["apiVersion"] == "admission.k8s.io/v1" and out["kind"] == "AdmissionReview"
    assert out["response"]["uid"] == "req-1"
    return out["response"]


def test_admission_refuses_what_only_the_model_can_tell():
    bad = {**SPEC, "parallelism": {"ep": [2]}}
    response = review("CREATE", bad)
    assert response["allowed"] is False and response["status"]["code"] == 422
    assert response["status"]["message"].startswith("spec.parallelism.ep:")
    assert review("CREATE", {**SPEC, "parallelism": {"tp": [1, 2, 4, 8]}}) == {"uid": "req-1", "allowed": True}
    assert review("UPDATE", bad, old_spec=SPEC)["allowed"] is False  # an edit that breaks it


def test_admission_never_blocks_metadata_updates_or_deletes():
    """kopf's finalizer and annotation patches are UPDATEs: a job accepted once must stay
    manageable and deletable, whatever today's checks say about its spec."""
    bad = {**SPEC, "parallelism": {"ep": [2]}}
    assert review("UPDATE", bad, old_spec=bad)["allowed"] is True
    assert review("DELETE", bad)["allowed"] is True
    assert review("UPDATE", bad, old_spec=SPEC, subResource="status")["allowed"] is True


def test_admission_refuses_host_path_checkpoints_unless_the_operator_allows_them():
    response = review("CREATE", HOST_PATH)
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert message.startswith("spec.checkpoint.volume.hostPath:") and "--allow-host-path-checkpoints" in message
    assert "operator.allowHostPathCheckpoints" in message and "persistentVolumeClaim" in message
    assert review("CREATE", HOST_PATH, policy=JobPolicy(allow_host_path_checkpoints=True))["allowed"] is True


def test_admission_rejects_a_body_that_is_not_a_review():
    with pytest.raises(ValueError, match="AdmissionReview"):
        admission.review({"kind": "Pod"}, DEFAULT_POLICY)


def test_config_error_names_the_flag():
    with pytest.raises(ConfigError) as e:
        parse("--api-server-port", "0")
    assert e.value.field == "--api-server-port"


def test_metrics_and_webhook_listen_where_told(tmp_path):
    assert parse().metrics_addr == "0.0.0.0" and parse().webhook_addr == "0.0.0.0"
    assert parse("--metrics-address", "127.0.0.1").metrics_addr == "127.0.0.1"
    assert parse("--metrics-address", "[::1]").metrics_addr == "::1"
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_text("x")
    key.write_text("x")
    opts = parse("--webhook-port", "9443", "--webhook-cert-file", str(cert), "--webhook-key-file", str(key),
                 "--webhook-address", "10.1.2.3")
    assert opts.webhook_addr == "10.1.2.3" and opts.webhook_port == 9443
