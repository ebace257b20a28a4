"""The validating webhook served over HTTPS with a supplied certificate, as an API server calls it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from liveshard.dev.ports import free_port
from liveshard.dev.tls import TLSUnavailable, self_signed
from liveshard.operator import admission
from liveshard.operator.options import Options

SPEC = {"model": {"preset": "tiny-gpt"}, "image": "img", "workers": {"max": 2, "gpusPerWorker": 1},
        "training": {"data": {"mock": True}, "trainIters": 100, "globalBatch": 8}}


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    try:
        return self_signed(tmp_path_factory.mktemp("tls"), hosts=("localhost", "127.0.0.1"))
    except TLSUnavailable as e:
        pytest.skip(str(e))


def review_body(spec: dict, uid: str = "0d3a1c2e", operation: str = "CREATE") -> dict:
    """An AdmissionReview as kube-apiserver sends it (the fields the webhook reads, and some it does not)."""
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": uid, "kind": {"group": "liveshard.io", "version": "v1alpha1", "kind": "ElasticTrainingJob"},
        "resource": {"group": "liveshard.io", "version": "v1alpha1", "resource": "elastictrainingjobs"},
        "name": "j", "namespace": "default", "operation": operation,
        "userInfo": {"username": "kubernetes-admin", "groups": ["system:masters"]},
        "object": {"apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob",
                   "metadata": {"name": "j", "namespace": "default"}, "spec": spec},
        "oldObject": None, "dryRun": False}}


def post(port: int, body: dict, cafile) -> dict:
    context = ssl.create_default_context(cafile=str(cafile))  # verifies the chain and the host name
    request = urllib.request.Request(f"https://127.0.0.1:{port}{admission.REVIEW_PATH}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, context=context, timeout=5) as response:
        return json.loads(response.read())


def wait_until_serving(port: int, cafile, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            post(port, review_body(SPEC), cafile)
            return
        except (urllib.error.URLError, ConnectionError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class Served:
    """``admission.serve`` in an event loop of its own thread."""

    def __init__(self, options: Options) -> None:
        self.loop = asyncio.new_event_loop()
        self.task: asyncio.Task | None = None
        self.options = options
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.task = self.loop.create_task(admission.serve(self.options))
        with contextlib.suppress(asyncio.CancelledError):
            self.loop.run_until_complete(self.task)

    def __enter__(self) -> Served:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(lambda: self.task and self.task.cancel())
        self.thread.join(10)
        assert not self.thread.is_alive()


def test_the_webhook_answers_admission_reviews_over_tls_with_the_supplied_certificate(cert):
    crt, key = cert
    port = free_port()
    options = Options(webhook_port=port, webhook_addr="127.0.0.1", webhook_cert_file=str(crt),
                      webhook_key_file=str(key))
    with Served(options):
        wait_until_serving(port, crt)
        allowed = post(port, review_body(SPEC, uid="good"), crt)
        assert allowed == {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                           "response": {"uid": "good", "allowed": True}}
        denied = post(port, review_body({**SPEC, "parallelism": {"ep": [2]}}, uid="bad"), crt)["response"]
        assert denied["uid"] == "bad" and denied["allowed"] is False and denied["status"]["code"] == 422
        assert denied["status"]["message"].startswith("spec.parallelism.ep:")
        host_path = {**SPEC, "checkpoint": {"volume": {"hostPath": {"path": "/mnt"}}}}
        refused = post(port, review_body(host_path, uid="hp"), crt)["response"]
        assert refused["allowed"] is False and "--allow-host-path-checkpoints" in refused["status"]["message"]
        # a body that is no review is a bad request, not a crash
        with pytest.raises(urllib.error.HTTPError) as e:
            post(port, {"kind": "Pod"}, crt)
        assert e.value.code == 400
        # a client that does not trust the certificate is refused by TLS itself
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"https://127.0.0.1:{port}/validate", data=b"{}", timeout=5,
                                   context=ssl.create_default_context())


def test_the_certificate_is_required(cert, tmp_path):
    """No self-signed fallback: a missing key file stops the server (kopf would need certbuilder)."""
    crt, _ = cert
    options = Options(webhook_port=free_port(), webhook_addr="127.0.0.1", webhook_cert_file=str(crt),
                      webhook_key_file=str(tmp_path / "missing.key"))
    with pytest.raises(OSError):
        asyncio.run(asyncio.wait_for(admission.serve(options), 10))
    assert not os.path.exists(tmp_path / "missing.key")


def test_an_operator_waiting_for_the_lease_serves_the_webhook_too(kube, cert):
    """The Service sends reviews to any replica: the standby answers while another one leads."""
    import kubernetes.client as k8s

    from liveshard.operator.command import run_operator
    from liveshard.operator.options import LeaderElection
    from liveshard.runtime.contract.times import iso

    crt, key = cert
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
             "metadata": {"name": "webhook-test", "namespace": "default"},
             "spec": {"holderIdentity": "the-leader", "leaseDurationSeconds": 60, "renewTime": iso(time.time())}}
    k8s.CoordinationV1Api(kube.api_client()).create_namespaced_lease("default", lease)
    port = free_port()
    options = Options(server=kube.url, metrics_port=None, liveness=None, webhook_port=port,
                      webhook_addr="127.0.0.1", webhook_cert_file=str(crt), webhook_key_file=str(key),
                      leader_election=LeaderElection(namespace="default", name="webhook-test", identity="standby",
                                                     lease_duration=2, renew_deadline=1, retry_period=0.1))
    stop, ready = threading.Event(), threading.Event()
    exit_code: list[int] = []
    thread = threading.Thread(target=lambda: exit_code.append(run_operator(options, stop, ready)), daemon=True)
    thread.start()
    try:
        wait_until_serving(port, crt)
        denied = post(port, review_body({**SPEC, "parallelism": {"ep": [2]}}), crt)["response"]
        assert denied["allowed"] is False
        assert not ready.is_set()  # it is not leading: kopf has not started
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive() and exit_code == [0]


# ---- the emulator calls registered webhooks, as kube-apiserver does ----------------------------
HOOK = "validate.elastictrainingjobs.liveshard.io"


def configuration(port: int, ca_pem: bytes, failure_policy: str = "Fail", name: str = "liveshard-test") -> dict:
    import base64

    from liveshard.runtime.contract.crd import GROUP, PLURAL, VERSION

    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": [{"name": HOOK, "admissionReviewVersions": ["v1"], "sideEffects": "None",
                          "failurePolicy": failure_policy, "timeoutSeconds": 5,
                          "clientConfig": {"url": f"https://127.0.0.1:{port}{admission.REVIEW_PATH}",
                                           "caBundle": base64.b64encode(ca_pem).decode()},
                          "rules": [{"apiGroups": [GROUP], "apiVersions": [VERSION], "resources": [PLURAL],
                                     "operations": ["CREATE", "UPDATE"], "scope": "Namespaced"}]}]}


def kubectl_apply(kubeconfig, tmp_path, name: str, spec: dict):
    import shutil
    import subprocess

    import yaml

    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob",
                                    "metadata": {"name": name}, "spec": spec}))
    return subprocess.run(["kubectl", "--kubeconfig", str(kubeconfig), "apply", "-f", str(path)],
                          capture_output=True, text=True, timeout=60)


def test_kubectl_apply_on_the_emulator_is_answered_by_the_registered_webhook(kube, cert, tmp_path):
    """A ValidatingWebhookConfiguration in the emulator sends its reviews to the operator's
    webhook over TLS (trusting only the caBundle): kubectl shows a refusal with the webhook's
    one line, and a deprecated field as a ``Warning:``; a webhook that cannot be called refuses
    under Fail and lets requests through under Ignore."""
    import kubernetes.client as k8s

    crt, key = cert
    port = free_port()
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
    hooks = k8s.AdmissionregistrationV1Api(kube.api_client())
    options = Options(webhook_port=port, webhook_addr="127.0.0.1", webhook_cert_file=str(crt),
                      webhook_key_file=str(key))
    hooks.create_validating_webhook_configuration(configuration(port, crt.read_bytes()))
    try:
        answered_by_the_webhook(kube, hooks, options, kubeconfig, tmp_path)
    finally:  # the emulator is shared by the module's tests
        hooks.delete_validating_webhook_configuration("liveshard-test")


def answered_by_the_webhook(kube, hooks, options, kubeconfig, tmp_path) -> None:
    crt, port = options.webhook_cert_file, options.webhook_port
    with Served(options):
        wait_until_serving(port, crt)
        refused = kubectl_apply(kubeconfig, tmp_path, "bad", {**SPEC, "parallelism": {"ep": [2]}})
        assert refused.returncode != 0
        assert f'admission webhook "{HOOK}" denied the request: spec.parallelism.ep:' in refused.stderr
        old = kubectl_apply(kubeconfig, tmp_path, "old", {**SPEC, "checkpoint": {"intervalMinutes": 5}})
        assert old.returncode == 0, old.stderr
        assert "Warning:" in old.stderr and "intervalSeconds" in old.stderr
        assert "created" in old.stdout
        fine = kubectl_apply(kubeconfig, tmp_path, "fine", SPEC)
        assert fine.returncode == 0 and "Warning" not in fine.stderr, fine.stderr
        # a refusal carries the webhook's warnings too, as kube-apiserver sends them
        both = kubectl_apply(kubeconfig, tmp_path, "both", {**SPEC, "parallelism": {"ep": [2]},
                                                           "checkpoint": {"intervalMinutes": 5}})
        assert both.returncode != 0 and "denied the request" in both.stderr
        assert "Warning: spec.checkpoint.intervalMinutes is deprecated" in both.stderr
        # an edit of the spec is reviewed too
        edited = kubectl_apply(kubeconfig, tmp_path, "fine", {**SPEC, "parallelism": {"ep": [2]}})
        assert edited.returncode != 0 and "denied the request" in edited.stderr
    # nobody answers: Fail refuses, with the call's failure named
    down = kubectl_apply(kubeconfig, tmp_path, "down", SPEC)
    assert down.returncode != 0 and f'failed calling webhook "{HOOK}"' in down.stderr
    ignore = configuration(port, Path(crt).read_bytes(), "Ignore")["webhooks"]
    hooks.patch_validating_webhook_configuration("liveshard-test", {"webhooks": ignore})
    assert kubectl_apply(kubeconfig, tmp_path, "down", SPEC).returncode == 0


def test_the_emulator_trusts_only_the_ca_bundle_and_checks_configurations(kube, cert, tmp_path):
    import kubernetes.client as k8s
    from kubernetes.client.rest import ApiException

    from liveshard.dev.tls import self_signed

    crt, key = cert
    other, _ = self_signed(tmp_path / "other", hosts=("127.0.0.1",))
    port = free_port()
    hooks = k8s.AdmissionregistrationV1Api(kube.api_client())
    jobs = k8s.CustomObjectsApi(kube.api_client())
    hooks.create_validating_webhook_configuration(configuration(port, other.read_bytes(), name="other-ca"))
    try:
        only_the_ca_bundle(hooks, jobs, port, crt, key)
    finally:
        hooks.delete_validating_webhook_configuration("other-ca")
    # the API server's own checks of a configuration
    bad = configuration(port, crt.read_bytes(), name="bad")
    bad["webhooks"][0].update(name="short.name", sideEffects="Some",
                              clientConfig={"url": f"http://127.0.0.1:{port}/validate"})
    with pytest.raises(ApiException) as e:
        hooks.create_validating_webhook_configuration(bad)
    assert e.value.status == 422
    for field in ("webhooks[0].name", "webhooks[0].sideEffects", "webhooks[0].clientConfig.url"):
        assert field in e.value.body


def only_the_ca_bundle(hooks, jobs, port, crt, key) -> None:
    from kubernetes.client.rest import ApiException

    body = {"apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob", "metadata": {"name": "j"},
            "spec": SPEC}
    with Served(Options(webhook_port=port, webhook_addr="127.0.0.1", webhook_cert_file=str(crt),
                        webhook_key_file=str(key))):
        wait_until_serving(port, crt)
        with pytest.raises(ApiException) as e:  # the served certificate is not signed by the caBundle
            jobs.create_namespaced_custom_object("liveshard.io", "v1alpha1", "default", "elastictrainingjobs", body)
        assert e.value.status == 500 and "failed calling webhook" in e.value.body
        assert "CERTIFICATE_VERIFY_FAILED" in e.value.body or "certificate verify failed" in e.value.body
