"""Timestamps as the Kubernetes API writes them (RFC 3339, UTC), parsed and written in one place."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any


def parse_time(value: Any) -> datetime | None:
    """An RFC 3339 timestamp or a unix time; None if absent or garbled."""
    if value is None or value == "":
        return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    if isinstance(value, int | float) or (isinstance(value, str) and re.fullmatch(r"\d{9,11}", value)):
        return datetime.fromtimestamp(float(value), tz=UTC)  # with its fraction: microseconds survive
    if isinstance(value, str):
        text = value.strip().replace("Z", "+00:00")
        try:
            parsed = datetime.fromisoformat(text)
        except ValueError:
            return None
        return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
    return None


def iso(t: datetime | float) -> str:
    """RFC 3339 with microseconds, UTC (``...Z``), from a datetime or a unix time."""
    if not isinstance(t, datetime):
        t = datetime.fromtimestamp(t, tz=UTC)
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

