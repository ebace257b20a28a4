"""A checkpoint directory's completion marker and file manifest: what a save writes last, and
what every reader (a restore, the coordinator choosing where to restart from, ``convert``)
verifies before it trusts the directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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
