"""A checkpoint directory's completion marker and file manifest: what a save writes last, and
what every reader (a restore, the coordinator choosing where to restart from, ``convert``)
verifies before it trusts the directory."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from liveshard.runtime.contract.env import Env
from liveshard.runtime.errors import ConfigError

MARKER = "liveshard.json"  # written last: a directory without it is an incomplete save
# Files are hashed in pieces of this size (a shard may be many GiB).
HASH_CHUNK = 8 << 20


def sha256_of(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_manifest(directory: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """``{file: {size, sha256}}`` for every file a save wrote (the marker itself excepted): every
    byte, whatever the file's size."""
    out: dict[str, dict[str, Any]] = {}
    root = Path(directory)
    for entry in sorted(root.rglob("*")):
        if not entry.is_file() or entry.name in (MARKER, ".liveshard.json.partial"):
            continue
        out[entry.relative_to(root).as_posix()] = {"size": entry.stat().st_size, "sha256": sha256_of(entry)}
    return out


# ---- whose checkpoint it is ------------------------------------------------------------------
# Every checkpoint records the identity of the job that wrote it (``liveshard.json``'s ``job``):
# a job continues only its own run, or the one ``spec.training.resume`` names on purpose.
IDENTITY_KEY = "job"


@dataclass(frozen=True)
class JobIdentity:
    """The job a checkpoint belongs to: namespace, name, the job object's uid, and its
    incarnation (``$LIVESHARD_JOB_INCARNATION``: the uid for a job the operator runs, a run id
    for ``run-local``). Two jobs of one name (a job deleted and applied again) differ in their
    incarnation."""

    namespace: str
    name: str
    uid: str
    incarnation: str

    def to_dict(self) -> dict[str, str]:
        return {"namespace": self.namespace, "name": self.name, "uid": self.uid, "incarnation": self.incarnation}

    @classmethod
    def from_dict(cls, value: object) -> JobIdentity | None:
        """The identity a checkpoint's marker records; None for one that records none (written
        before identities, or by ``liveshard convert``)."""
        if not isinstance(value, dict) or not value.get("incarnation"):
            return None
        return cls(*(str(value.get(k) or "") for k in ("namespace", "name", "uid", "incarnation")))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> JobIdentity | None:
        """This process's job, from the environment the operator (or ``run-local``) sets; None
        where nothing names an incarnation (a worker started by hand): no checks then."""
        env = os.environ if env is None else env
        incarnation = env.get(Env.JOB_INCARNATION, "")
        if not incarnation:
            return None
        return cls(env.get(Env.NAMESPACE, ""), env.get(Env.JOB, "job"), env.get(Env.JOB_UID, ""), incarnation)

    def owns(self, meta: Mapping[str, Any]) -> bool:
        """Whether a checkpoint whose marker is ``meta`` is this job's own."""
        other = JobIdentity.from_dict(meta.get(IDENTITY_KEY))
        return other is not None and (other.namespace, other.name, other.incarnation) == (
            self.namespace, self.name, self.incarnation)

    def __str__(self) -> str:
        """``job NS/NAME (uid U)``, or ``run-local run R`` (a run-local run has no namespace)."""
        if not self.namespace and not self.uid:
            return f"run-local run {self.incarnation}"
        where = f"{self.namespace}/{self.name}" if self.namespace else self.name
        return f"job {where} (uid {self.uid})" if self.uid else f"job {where} (run {self.incarnation})"


def describe_owner(meta: Mapping[str, Any]) -> str:
    """Whose a checkpoint is, in words, from its marker."""
    owner = JobIdentity.from_dict(meta.get(IDENTITY_KEY))
    return str(owner) if owner is not None else "a job that recorded no identity (an older liveshard, or an import)"


def complete_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path, dict[str, Any]]]:
    """``(step, directory, marker)`` of every directory directly under ``root`` with a readable
    marker, oldest step first (nothing is verified here)."""
    import json

    out: list[tuple[int, Path, dict[str, Any]]] = []
    base = Path(root)
    if not base.is_dir():
        return out
    for entry in base.iterdir():
        try:
            meta = json.loads((entry / MARKER).read_text())
            step = int(meta.get("step", -1))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
        if isinstance(meta, dict):
            out.append((step, entry, meta))
    return sorted(out, key=lambda item: (item[0], item[1].name))


def foreign_run(root: str | os.PathLike[str] | None, identity: JobIdentity | None,
                field: str = "spec.checkpoint.path",
                otherwise: str = "give this job an empty checkpoint directory") -> ConfigError | None:
    """Why a job of ``identity`` must not start on the checkpoint directory ``root``: it holds
    another job's run (the newest such checkpoint is named, with how to continue it on purpose);
    None when every checkpoint there is the job's own, or there is none (or no identity)."""
    if not root or identity is None:
        return None
    foreign = [(step, path, meta) for step, path, meta in complete_checkpoints(root) if not identity.owns(meta)]
    if not foreign:
        return None
    step, path, meta = foreign[-1]
    return ConfigError(
        field, f"{root} holds the run of {describe_owner(meta)} (newest: {path} at step {step}), "
               f"not of this {identity}: a job continues only its own checkpoints",
        f"to continue that run on purpose set spec.training.resume.path: {path}; otherwise {otherwise}")
