"""A client that reaches a running local job's store but lacks its secret plants the c10d
rendezvous keys of the next generations: every key it lists under a generation's world or
transfer prefix it writes, with garbage, under the same path for the generations after it. The
rendezvous keys of a generation live under a token only the job's processes can compute, so the
planted keys are never read: the leave and the join commit, every step trains and every process
exits 0. Real coordinator and worker processes on CPU (gloo)."""

from __future__ import annotations

import re
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from liveshard.dev.localrun import driver
from liveshard.dev.localrun.driver import LocalRun, RunSpec
from liveshard.dev.localrun.events import parse_events
from liveshard.dev.ports import free_port

pytestmark = pytest.mark.slow

GLOBAL_BATCH, STEPS = 4, 8
RENDEZVOUS = re.compile(r"(?P<job>.*/)(?P<kind>world|xfer)/(?P<gen>\d+)/(?P<rest>.+)")


def _plant(port: int, stop: threading.Event, seen: dict) -> None:
    client = None
    while client is None and not stop.is_set():
        try:
            client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                   timeout=timedelta(seconds=5))
        except Exception:
            time.sleep(0.1)
    planted: set[str] = set()
    while client is not None and not stop.is_set():
        try:
            for key in client.list_keys():
                m = RENDEZVOUS.fullmatch(key)
                if m is None or key in planted:
                    continue
                seen.setdefault("rendezvous", set()).add(m["rest"].split("/")[0])
                for later in range(int(m["gen"]) + 1, int(m["gen"]) + 4):
                    target = f"{m['job']}{m['kind']}/{later}/{m['rest']}"
                    if target not in planted:
                        client.set(target, "garbage")
                        planted.add(target)
                seen["planted"] = len(planted)
        except Exception:
            pass  # the coordinator may be between ticks; keep going
        time.sleep(0.02)


def test_planted_rendezvous_keys_of_later_generations_are_never_read(tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setattr(driver, "free_port", lambda: port)  # the attacker knows where the store listens
    job = LocalRun(RunSpec.mock("tiny-llama", workers=2, parallel="tp=1,pp=1,dp=2", steps=STEPS,
                                global_batch=GLOBAL_BATCH, events=parse_events("3:leave=1 5:join=1"),
                                workdir=str(tmp_path), heartbeat_timeout=2.0, collective_timeout=10.0))
    stop, seen = threading.Event(), {}
    attacker = threading.Thread(target=_plant, args=(port, stop, seen), daemon=True)
    attacker.start()
    try:
        report = job.run_live()
        codes = {w: p.wait(timeout=60) for w, p in job.procs.workers.items()}
    finally:
        stop.set()
        job.procs.kill_all()
    attacker.join(timeout=10)
    assert seen.get("planted", 0) > 0, seen  # it planted keys for later generations
    # under each generation's prefix, the keys are under a token (16 hex digits), not the c10d names
    assert seen["rendezvous"] and all(re.fullmatch(r"[0-9a-f]{16}", t) for t in seen["rendezvous"]), seen
    assert [s["step"] for s in report["steps"]] == list(range(1, STEPS + 1))
    status = job.final_status or {}
    outcomes = [h["outcome"] for h in status.get("history", []) if h.get("generation") is not None]
    assert len(outcomes) >= 3 and all(o == "committed" for o in outcomes), outcomes
    assert all(code == 0 for code in codes.values()), codes
