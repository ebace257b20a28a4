"""What the attack tests share: a store client without the job's secret, how it reads a sealed
value (anyone can: only writing one needs the secret), and a run with attackers beside it."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from liveshard.dev.localrun.driver import LocalRun


def client(port: int, stop: threading.Event) -> dist.TCPStore | None:
    """A plain c10d client of the job's store (None once ``stop`` is set before it connects)."""
    while not stop.is_set():
        try:
            return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                 timeout=timedelta(seconds=5))
        except Exception:
            time.sleep(0.1)
    return None


def sealed_json(raw: bytes) -> Any:
    """The JSON a sealed value carries (``v2.<seq>.<flag>.<mac>.<json>``), or None."""
    try:
        return json.loads(raw.decode().split(".", 4)[4])
    except (ValueError, IndexError, UnicodeDecodeError):
        return None


def run_under_attack(job: LocalRun, attacks: list[Callable[[], None]],
                     stop: threading.Event) -> tuple[dict, dict[str, int | None]]:
    """Run ``job`` live with each attack in a thread of its own; the report and each worker's
    exit code. The attacks end when ``stop`` is set (after the run, whatever happened)."""
    threads = [threading.Thread(target=a, daemon=True) for a in attacks]
    for t in threads:
        t.start()
    try:
        report = job.run_live()
        codes = {w: p.wait(timeout=60) for w, p in job.procs.workers.items()}
    finally:
        stop.set()
        job.procs.kill_all()
    for t in threads:
        t.join(timeout=10)
    return report, codes
