"""Sizes as people write them, read once for every flag and spec field."""

from __future__ import annotations

import re
from typing import Any

from liveshard.runtime.errors import ConfigError, short

# Binary (Ki, KiB), decimal (K, KB) and Kubernetes quantity suffixes, case-insensitive.
_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
          "T": 10**12, "TB": 10**12, "P": 10**15, "PB": 10**15, "KI": 2**10, "KIB": 2**10, "MI": 2**20,
          "MIB": 2**20, "GI": 2**30, "GIB": 2**30, "TI": 2**40, "TIB": 2**40, "PI": 2**50, "PIB": 2**50}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_bytes(value: Any, field: str) -> int:
    """A positive byte count: ``1073741824``, ``1GiB``, ``80Gi`` (a Kubernetes quantity),
    ``512MiB``, ``1.5GB``; ``ConfigError`` naming ``field`` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        match = _SIZE.fullmatch(value) if isinstance(value, str) else None
        unit = match.group(2).upper() if match else None
        if not match or unit not in _UNITS:
            raise ConfigError(field, f"{short(value)} is not a size in bytes",
                              "write bytes or a number with a unit, e.g. 1073741824, 512MiB, 80Gi or 96GB")
        scaled = float(match.group(1)) * _UNITS[unit]
        if scaled != scaled or scaled in (float("inf"), float("-inf")) or scaled > 2**62:
            raise ConfigError(field, f"{short(value)} is beyond any sane size", "e.g. 512MiB, 80Gi or 96GB")
        number = int(scaled)
    if number <= 0:
        raise ConfigError(field, f"{short(value)} is not a positive size", "give a size above zero")
    return number
