"""A job's status conditions: set one, keeping its transition time while its status holds. Pure."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from liveshard.runtime.contract.times import iso


def set_condition(conditions: list[dict[str, Any]], ctype: str, status: bool, reason: str, message: str,
                  now: datetime) -> list[dict[str, Any]]:
    value = "True" if status else "False"
    out = [c for c in conditions if c.get("type") != ctype]
    old = next((c for c in conditions if c.get("type") == ctype), None)
    since = old["lastTransitionTime"] if old and old.get("status") == value and old.get(
        "lastTransitionTime") else iso(now)
    out.append({"type": ctype, "status": value, "reason": reason, "message": message,
                "lastTransitionTime": since})
    order = {"Ready": 0, "Reconfiguring": 1, "Degraded": 2, "Suspended": 3}
    return sorted(out, key=lambda c: (order.get(c["type"], 9), c["type"]))


def condition(conditions: list[dict[str, Any]], ctype: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == ctype), None)
