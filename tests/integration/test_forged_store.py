"""A client that reaches a running local job's store but lacks its secret: it plants 50,000 forged
slots in the lists of registrations and plan requests, then overwrites a live worker's heartbeat
as fast as it can for more than three heartbeat timeouts (every read of the coordinator finds the
forgery). Liveness is not the attacker's to decide: nobody is declared dead, the coordinator does
bounded work per tick (its status keeps being written) and logs the tampering in a bounded number
of lines with a summary, every step trains and every process exits 0. Real coordinator and worker
processes on CPU (gloo)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from liveshard.dev.localrun import driver
from liveshard.dev.localrun.driver import LocalRun, RunSpec
from liveshard.dev.ports import free_port

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT = 1.0
PLANTED = 50_000


def _client(port: int, stop: threading.Event) -> dist.TCPStore | None:
    while not stop.is_set():
        try:
            return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                 timeout=timedelta(seconds=5))
        except Exception:
            time.sleep(0.1)
    return None


def _attack(port: int, path, stop: threading.Event, seen: dict) -> None:
    client = _client(port, stop)
    prefix = None
    while client is not None and prefix is None and not stop.is_set():
        keys = [k for k in client.list_keys() if "/members/" in k]  # the first registration shows the job
        prefix = keys[0].split("members/")[0] if keys else None
        time.sleep(0.01)
    if client is None or prefix is None:
        return
    for name in ("members/index", "request"):
        for lo in range(0, PLANTED, 5000):  # a few round trips for all of them
            client.multi_set([f"{prefix}{name}/{i}" for i in range(lo, lo + 5000)], ["forged"] * 5000)
    seen["planted"] = 2 * PLANTED
    while not stop.is_set() and not any(p.stat().st_size > 0 for p in path.glob("w*.steps.jsonl")):
        time.sleep(0.05)
    key, t0, writes = f"{prefix}hb/w1", time.monotonic(), 0
    while not stop.is_set() and time.monotonic() - t0 < 4 * HEARTBEAT_TIMEOUT:
        client.set(key, f"forged {writes}")
        writes += 1
    seen["forged_for"], seen["writes"] = time.monotonic() - t0, writes


def test_forged_beats_and_list_slots_neither_kill_nor_stall_the_job(tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setattr(driver, "free_port", lambda: port)  # the attacker knows where the store listens
    steps = 60
    job = LocalRun(RunSpec.mock("tiny-llama", workers=2, parallel="tp=1,pp=1,dp=2", steps=steps, global_batch=4,
                                events=[], workdir=str(tmp_path), heartbeat_timeout=HEARTBEAT_TIMEOUT,
                                collective_timeout=10.0))
    stop, seen = threading.Event(), {}
    attacker = threading.Thread(target=_attack, args=(port, tmp_path, stop, seen), daemon=True)
    attacker.start()
    try:
        report = job.run_live()
        codes = {w: p.wait(timeout=60) for w, p in job.procs.workers.items()}
    finally:
        stop.set()
        job.procs.kill_all()
    attacker.join(timeout=10)
    assert seen.get("planted") == 2 * PLANTED, seen
    assert seen.get("forged_for", 0) >= 3 * HEARTBEAT_TIMEOUT and seen["writes"] > 1000, seen
    log = (tmp_path / "coordinator.log").read_text(errors="replace")
    assert "is dead" not in log, [line for line in log.splitlines() if "is dead" in line]
    store_lines = [line for line in log.splitlines() if "liveshard.store" in line]
    assert len(store_lines) < 100, (len(store_lines), store_lines[-5:])  # bounded, not a line per slot
    assert [s["step"] for s in report["steps"]] == list(range(1, steps + 1))
    status = job.final_status or {}
    assert not status.get("dead") and status.get("finished"), status
    assert (status.get("tampering") or {}).get("forged", 0) > 0, status.get("tampering")
    assert codes == {"w0": 0, "w1": 0}, codes
