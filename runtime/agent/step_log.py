"""A rank's steps, one JSON line each, appended and flushed as each step is recorded.

``liveshard worker --step-log FILE`` keeps it. The result file (``--result``) is written once,
when the worker ends; a process killed later takes the steps it trained with it. The step log
is written as training goes: every line is handed to the kernel before the step boundary, so a
process killed at any point (kill -9 included) leaves every step it finished on disk. With
``fsync`` each line is also forced to the device (it then survives the node's crash too, at a
few milliseconds a step).

Each line is the step's ``StepRecord`` (without the global batch's sample indices) plus the
worker's ``id``. A reader (``read_step_log``) skips a last line torn by a kill mid-write.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["StepLog", "read_step_log"]


class StepLog:
    """The append-only step log of one rank (``path``), opened for appending: a restarted
    process with the same path adds to it."""

    def __init__(self, path: str | os.PathLike, worker_id: str, *, fsync: bool = False) -> None:
        self.path = Path(path)
        self.worker_id = worker_id
        self.fsync = fsync
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def append(self, record: Any) -> None:
        """One step (a ``StepRecord`` or a dict of its fields), flushed at once."""
        fields = dict(record if isinstance(record, dict) else record.__dict__)
        fields.pop("samples", None)
        line = json.dumps({"id": self.worker_id, **fields}, separators=(",", ":"))
        self._file.write(line + "\n")
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def read_step_log(path: str | os.PathLike) -> list[dict]:
    """Every complete line of a step log (a torn or unreadable line is skipped)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break  # the writer was killed mid-line
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
