"""A client that reaches a running local job's store but lacks its secret, while the job leaves
and joins: it plants 50,000 forged slots in the lists of registrations and plan requests;
overwrites a live worker's heartbeat as fast as it can for more than three heartbeat timeouts
(every read of the coordinator finds the forgery); and plants the c10d rendezvous keys of the
next generations (every key it lists under a generation's world or transfer prefix it writes,
with garbage, under the same path for the generations after it). Nobody is declared dead (liveness
is not the attacker's to decide), the coordinator does bounded work per tick and logs the
tampering in a bounded number of lines, the planted rendezvous keys are never read (a
generation's keys live under a token only the job's processes can compute), every change
commits, every step trains and every process exits 0. Real coordinator and worker processes on
CPU (gloo)."""

from __future__ import annotations

import re
import threading
import time

import pytest
from attacks import client as store_client
from attacks import run_under_attack

from liveshard.dev.localrun import driver
from liveshard.dev.localrun.driver import LocalRun, RunSpec
from liveshard.dev.localrun.events import parse_events
from liveshard.dev.ports import free_port

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT = 2.0
PLANTED = 50_000
GLOBAL_BATCH, STEPS = 4, 40
RENDEZVOUS = re.compile(r"(?P<job>.*/)(?P<kind>world|xfer)/(?P<gen>\d+)/(?P<rest>.+)")


def _plant_rendezvous(port: int, stop: threading.Event, seen: dict) -> None:
    client = store_client(port, stop)
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
                seen["rendezvous_planted"] = len(planted)
        except Exception:
            pass  # the coordinator may be between ticks; keep going
        time.sleep(0.02)


def _attack(port: int, path, stop: threading.Event, seen: dict) -> None:
    client = store_client(port, stop)
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
    key, t0, writes = f"{prefix}hb/w0", time.monotonic(), 0  # w0 stays through the leave and the join
    while not stop.is_set() and time.monotonic() - t0 < 3.5 * HEARTBEAT_TIMEOUT:
        client.set(key, f"forged {writes}")
        writes += 1
    seen["forged_for"], seen["writes"] = time.monotonic() - t0, writes


def test_a_client_without_the_secret_neither_kills_nor_stalls_nor_breaks_a_change(tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setattr(driver, "free_port", lambda: port)  # the attacker knows where the store listens
    job = LocalRun(RunSpec.mock("tiny-llama", workers=2, parallel="tp=1,pp=1,dp=2", steps=STEPS,
                                global_batch=GLOBAL_BATCH, events=parse_events("3:leave=1 5:join=1"),
                                workdir=str(tmp_path), heartbeat_timeout=HEARTBEAT_TIMEOUT,
                                collective_timeout=10.0))
    stop, seen = threading.Event(), {}
    report, codes = run_under_attack(job, [lambda: _attack(port, tmp_path, stop, seen),
                                           lambda: _plant_rendezvous(port, stop, seen)], stop)
    assert seen.get("planted") == 2 * PLANTED, seen
    assert seen.get("forged_for", 0) >= 3 * HEARTBEAT_TIMEOUT and seen["writes"] > 1000, seen
    assert seen.get("rendezvous_planted", 0) > 0, seen  # it planted keys for later generations
    # under each generation's prefix, the keys are under a token (16 hex digits), not the c10d names
    assert all(re.fullmatch(r"[0-9a-f]{16}", t) for t in seen["rendezvous"]), seen["rendezvous"]
    log = (tmp_path / "coordinator.log").read_text(errors="replace")
    assert "is dead" not in log, [line for line in log.splitlines() if "is dead" in line]
    store_lines = [line for line in log.splitlines() if "liveshard.store" in line]
    assert len(store_lines) < 100, (len(store_lines), store_lines[-5:])  # bounded, not a line per slot
    assert [s["step"] for s in report["steps"]] == list(range(1, STEPS + 1))
    assert [s["consumed_samples"] for s in report["steps"]] == [GLOBAL_BATCH * k for k in range(1, STEPS + 1)]
    status = job.final_status or {}
    assert not status.get("dead") and status.get("finished"), status
    outcomes = [h["outcome"] for h in status.get("history", []) if h.get("generation") is not None]
    assert len(outcomes) >= 3 and all(o == "committed" for o in outcomes), outcomes
    assert (status.get("tampering") or {}).get("forged", 0) > 0, status.get("tampering")
    assert all(code == 0 for code in codes.values()), codes
