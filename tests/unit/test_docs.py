"""docs/crd-reference.md is generated from the CRD and must be current; docs/deploy.md names only
files that exist."""

from __future__ import annotations

import copy
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_crd_reference", ROOT / "docs" / "gen_crd_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_crd_reference_is_up_to_date(gen):
    assert gen.main(["--check"]) == 0, "run: python docs/gen_crd_reference.py"


def test_reference_follows_the_schema(gen):
    crd = yaml.safe_load((ROOT / "crds" / "elastictrainingjob.yaml").read_text())
    text = gen.render(crd)
    assert "| `spec.workers.max` | integer | yes |" in text
    assert "`spec.workers.min` | integer |  | `1` |" in text
    assert "workers.min must be <= workers.max" in text  # CEL rules are listed
    changed = copy.deepcopy(crd)
    schema = changed["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    schema["properties"]["spec"]["properties"]["workers"]["properties"]["max"]["description"] = "CHANGED"
    assert gen.render(changed) != text and "CHANGED" in gen.render(changed)


def test_every_table_row_has_five_cells(gen):
    text = (ROOT / "docs" / "crd-reference.md").read_text()
    fields, _, renamed = text.partition("## Renamed fields")
    for line in fields.splitlines():
        if line.startswith("| `"):
            assert len(re.split(r"(?<!\\)\|", line)) == 7, line
    rows = [line for line in renamed.splitlines() if line.startswith("| `")]
    assert "| `spec.model.num_layers` | `spec.model.numLayers` |" in rows
    assert "| `spec.checkpoint.intervalMinutes` | `spec.checkpoint.intervalSeconds` |" in rows


def test_deploy_doc_names_existing_files():
    text = (ROOT / "docs" / "deploy.md").read_text()
    paths = set(re.findall(r"\b((?:examples|helm|images|e2e|docs|crds)/[\w./-]+\w)", text))
    assert paths
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, missing


def test_architecture_doc_names_existing_files():
    text = (ROOT / "docs" / "architecture.md").read_text()
    paths = set(re.findall(r"`((?:runtime|operator|dev|tests|e2e|crds|helm|images|docs)/[\w./-]*\w/?)`", text))
    assert len(paths) > 20
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, missing
