"""Fixtures shared by the unit and integration tests.

``tests/unit`` holds pure tests (no spawned ranks, no servers); ``tests/integration`` runs
processes (gloo ranks, workers, a coordinator) and the Kubernetes API emulator; ``e2e`` runs the
embedded cluster. Test machinery that several suites or the benchmarks share lives in the
development package (``liveshard.dev``: the emulator, the gloo process pool, transition cases),
never here and never in the product packages.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def crd_path() -> Path:
    return ROOT / "crds" / "elastictrainingjob.yaml"


@pytest.fixture(scope="session")
def crd(crd_path: Path) -> dict:
    return yaml.safe_load(crd_path.read_text())


@pytest.fixture(scope="session")
def crd_validator(crd: dict):
    """The CRD's schema and CEL rules, applied as the API server applies them."""
    from liveshard.dev.localcluster.crd_validation import CRDValidator

    return CRDValidator(crd)


@pytest.fixture(scope="module")
def kube(crd_path: Path):
    """The Kubernetes API emulator with the CRD installed, served on a free local port."""
    from liveshard.dev.localcluster.emulator import KubeEmulator

    with KubeEmulator(crds=[crd_path]) as emulator:
        yield emulator
