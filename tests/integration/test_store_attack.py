"""A client that reaches the job's store but lacks its secret attacks a running local job: it
overwrites every worker's heartbeat with garbage every 20 ms, pre-creates the commit points of the
next generations with forged values and deletes decided ones, while the job leaves and joins.
Nothing it writes is taken for a value: nobody is declared dead, every change commits, every step
trains, and the tampering is counted. Real coordinator and worker processes on CPU (gloo)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from attacks import run_under_attack

from liveshard.dev.localrun import driver
from liveshard.dev.localrun.driver import LocalRun, RunSpec
from liveshard.dev.localrun.events import parse_events
from liveshard.dev.ports import free_port

pytestmark = pytest.mark.slow

GLOBAL_BATCH, STEPS = 4, 8


def _attack(port: int, stop: threading.Event, counts: dict) -> None:
    client = None
    while client is None and not stop.is_set():
        try:
            client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                   timeout=timedelta(seconds=5))
        except Exception:
            time.sleep(0.1)
    while not stop.is_set():
        try:
            keys = client.list_keys()  # the store hides nothing from a client that reaches it
            beats = [k for k in keys if "/hb/" in k]
            prefix = beats[0].split("hb/")[0] if beats else None
            for k in beats:
                client.set(k, "garbage")
            if prefix is not None:
                for g in range(1, 8):
                    client.compare_set(prefix + f"gen/{g}/decision", "", "v2.1.s.00.aborted: forged")
                for k in keys:
                    if k.endswith("/decision"):
                        client.delete_key(k)
                counts["writes"] += 1
        except Exception:
            pass  # the coordinator may be between ticks; keep going
        time.sleep(0.02)


def test_a_client_without_the_secret_cannot_kill_stall_or_steer_the_job(tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setattr(driver, "free_port", lambda: port)  # the attacker knows where the store listens
    job = LocalRun(RunSpec.mock("tiny-llama", workers=2, parallel="tp=1,pp=1,dp=2", steps=STEPS,
                                global_batch=GLOBAL_BATCH, events=parse_events("3:leave=1 5:join=1"),
                                workdir=str(tmp_path), heartbeat_timeout=2.0, collective_timeout=10.0))
    stop, counts = threading.Event(), {"writes": 0}
    report, codes = run_under_attack(job, [lambda: _attack(port, stop, counts)], stop)
    assert counts["writes"] > 50  # the attack ran through the job
    assert [s["step"] for s in report["steps"]] == list(range(1, STEPS + 1))
    assert [s["consumed_samples"] for s in report["steps"]] == [GLOBAL_BATCH * k for k in range(1, STEPS + 1)]
    status = job.final_status or {}
    assert not status.get("dead"), status.get("dead")  # tampering is not silence
    outcomes = [h["outcome"] for h in status.get("history", []) if h.get("generation") is not None]
    assert outcomes and all(o == "committed" for o in outcomes), outcomes
    assert sum((status.get("tampering") or {}).values()) > 0
    assert all(code == 0 for code in codes.values()), codes
