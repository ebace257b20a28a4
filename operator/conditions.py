"""A job's status conditions, shaped like ``metav1.Condition``: set one, keeping its transition
time while its status holds. Pure."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

from liveshard.runtime.contract.times import iso

# metav1.Condition's reason: CamelCase, starting with a letter
REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
MAX_MESSAGE = 32768  # metav1.Condition's limit
ORDER = {"Ready": 0, "Reconfiguring": 1, "Degraded": 2, "Suspended": 3}


def reason_of(text: str) -> str:
    """``text`` as a valid condition reason: ``spot-interruption`` -> ``SpotInterruption``."""
    if REASON.match(text or ""):
        return text
    words = re.findall(r"[A-Za-z0-9]+", text or "")
    reason = "".join(w[:1].upper() + w[1:] for w in words).lstrip("0123456789")
    return reason[:1024] or "Unknown"


def set_condition(conditions: list[dict[str, Any]], ctype: str, status: bool, reason: str, message: str,
                  now: datetime, observed_generation: int | None = None) -> list[dict[str, Any]]:
    """``conditions`` with ``ctype`` set; ``observed_generation``: the job's ``metadata.generation``
    this judgement was made on."""
    value = "True" if status else "False"
    out = [c for c in conditions if c.get("type") != ctype]
    old = next((c for c in conditions if c.get("type") == ctype), None)
    since = old["lastTransitionTime"] if old and old.get("status") == value and old.get(
        "lastTransitionTime") else iso(now)
    new = {"type": ctype, "status": value, "reason": reason_of(reason), "message": (message or "")[:MAX_MESSAGE],
           "lastTransitionTime": since}
    if isinstance(observed_generation, int):
        new["observedGeneration"] = observed_generation
    out = [{**c, "reason": reason_of(str(c.get("reason") or ""))} for c in out] + [new]
    return sorted(out, key=lambda c: (ORDER.get(c["type"], 9), c["type"]))


def condition(conditions: list[dict[str, Any]], ctype: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == ctype), None)
