"""The distribution maps folders to import names explicitly; keep that list complete."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for top, name in (("runtime", "liveshard.runtime"), ("operator", "liveshard.operator"), ("dev", "liveshard.dev")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            found.add(".".join([name, *rel.parts]))
    assert found == listed


def test_no_module_shadows_the_standard_library_operator():
    assert not (ROOT / "operator.py").exists()
    assert not (ROOT / "operator" / "operator.py").exists()
