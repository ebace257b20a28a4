"""Fixtures shared by the unit and integration tests.

``tests/unit`` holds pure tests (no spawned ranks, no servers); ``tests/integration`` runs
processes (gloo ranks, workers, a coordinator) and the Kubernetes API emulator; ``e2e`` runs the
embedded cluster. Test machinery that several suites or the benchmarks share lives in the
development package (``liveshard.dev``: the emulator, the gloo process pool, transition cases),
never here and never in the product packages.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


class _LoggerTable(dict):
    """pytest's log capture walks ``logging``'s logger table at the start of every test phase
    without logging's lock (``catching_logs.__enter__``), while a test's background threads (the
    operator, the API emulator) may create loggers: 'dictionary changed size during iteration'
    failed a test once in CI. Handing out a snapshot makes that walk safe; ``list`` over a dict is
    one C call, atomic under the GIL."""

    def values(self):  # type: ignore[override]
        return list(super().values())


logging.Logger.manager.loggerDict = _LoggerTable(logging.Logger.manager.loggerDict)


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
