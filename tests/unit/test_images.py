"""The Dockerfiles, checked statically (no Docker daemon here to build them): what they COPY exists
and is in the build context, bases are pinned, they run as non-root, and they start real commands."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from liveshard.dev.dockerfile import instructions
from liveshard.runtime.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "images").glob("*/Dockerfile"))


def arg_defaults(instrs: list[tuple[str, str]]) -> dict[str, str]:
    return dict(a.split("=", 1) for k, a in instrs if k == "ARG" and "=" in a)


def resolve(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), value)


def dockerignore_allows(rel: str) -> bool:
    """Docker's rule: the last matching pattern wins; ``!`` re-includes."""
    allowed = True
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(rel, pattern) or rel.startswith(pattern + "/"):
            allowed = negate
    return allowed


def test_there_are_two_images():
    assert [p.parent.name for p in DOCKERFILES] == ["operator", "worker"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_copied_files_exist_and_are_in_the_build_context(dockerfile):
    copies = [a for k, a in instructions(dockerfile) if k == "COPY" and not a.startswith("--from")]
    assert copies
    for args in copies:
        *sources, _dest = shlex.split(args)
        for src in sources:
            path = ROOT / src
            assert path.exists(), f"{dockerfile.parent.name}: COPY {src}: no such file in the repository"
            assert dockerignore_allows(src.rstrip("/")), f"{src} is excluded by .dockerignore"
    # The wheel is built from what is copied: every folder of pyproject's package-dir and the
    # files pyproject names.
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {"pyproject.toml", meta["project"]["readme"], *meta["tool"]["setuptools"]["package-dir"].values()}
    copied = {s.rstrip("/").removeprefix("./") for a in copies for s in shlex.split(a)[:-1]}
    assert needed <= copied, f"{dockerfile.parent.name}: does not COPY {sorted(needed - copied)}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_bases_are_pinned_and_multi_stage(dockerfile):
    instrs = instructions(dockerfile)
    args = arg_defaults(instrs)
    froms = [resolve(a.split()[0], args) for k, a in instrs if k == "FROM"]
    assert len(froms) >= 2, "multi-stage: a build stage and a runtime stage"
    for image in froms:
        assert "$" not in image, f"unresolved base {image}"
        tag = image.partition("@")[0].rpartition(":")[2] if ":" in image else ""
        assert "@sha256:" in image or (tag and tag != "latest" and re.search(r"\d", tag)), \
            f"base image {image} is not pinned to a version tag or digest"
    stage_names = {a.split()[-1] for k, a in instrs if k == "FROM" and " AS " in a.upper()}
    for k, a in instrs:
        if k == "COPY" and a.startswith("--from="):
            assert a.split()[0].split("=", 1)[1] in stage_names


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_runs_as_non_root(dockerfile):
    instrs = instructions(dockerfile)
    last_from = max(i for i, (k, _) in enumerate(instrs) if k == "FROM")
    users = [a for k, a in instrs[last_from:] if k == "USER"]
    assert users, "the final stage sets USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and user.isdigit(), "numeric non-root UID (runAsNonRoot can check it)"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_entrypoint_is_a_real_liveshard_command(dockerfile):
    (entry,) = [json.loads(a) for k, a in instructions(dockerfile) if k == "ENTRYPOINT"]
    assert entry[0] == "liveshard"
    assert entry[1] in COMMANDS, f"{entry[1]} is not a liveshard subcommand"
    assert entry[1] == {"operator": "operator", "worker": "worker"}[dockerfile.parent.name]


def test_operator_image_installs_the_operator_extra_and_no_torch():
    runs = " ".join(a for k, a in instructions(ROOT / "images" / "operator" / "Dockerfile") if k == "RUN")
    assert "'.[operator]'" in runs and "torch" not in runs and "[runtime]" not in runs


def test_worker_image_installs_megatron_core_and_the_runtime_extra():
    runs = " ".join(a for k, a in instructions(ROOT / "images" / "worker" / "Dockerfile") if k == "RUN")
    assert "megatron-core==" in runs and "[runtime]" in runs
