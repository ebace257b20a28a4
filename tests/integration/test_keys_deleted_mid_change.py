"""A client that reaches a running local job's store but lacks its secret deletes every key it
can list or guess while a generation is pending (a planned leave, then a join): the
registrations, heartbeats, plans, the pointers ``plan/latest`` and ``plan/current``, every vote,
result, decision and outcome, the coordinator's status and the guessed keys of the pending
generation, again every 20 ms for the first 3 s of each pending generation (a sweep that outlasts
the publication of the plan, the preparation and the first votes; an attack kept up for ever is a
stall, which the docs bound, not a change that can be made). It reads the coordinator's status
from the store as anyone can (sealed, not secret) to know when a change is pending.

What was deleted is written again by its owners (the coordinator's kept keys: pointers, plans,
decisions; a worker's kept writes: results, digests, arrivals; a reader that accepted a
write-once value; a worker's registration), and every rank agrees that it holds the plan before
the world votes on it, so each change commits (or aborts and is
asked again) within the pending generation's bound (``--transition-timeout``:
docs/architecture.md, "Bounds"), the coordinator's status keeps being written, every step trains
once in order with its samples, and every process exits 0.
Only ``dev/`` keys are spared: they are the local driver's script (its holds at event steps),
which no real job has. Real coordinator and worker processes on CPU (gloo)."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time

import pytest
from attacks import client as store_client
from attacks import run_under_attack, sealed_json

from liveshard.dev.localrun import driver
from liveshard.dev.localrun.driver import LocalRun, RunSpec
from liveshard.dev.localrun.events import parse_events
from liveshard.dev.ports import free_port

pytestmark = pytest.mark.slow

GLOBAL_BATCH, STEPS = 4, 24
# Each step's compute stretched 10x (slept, not burnt: ``held_worker.Slowdown``), so the 19 steps
# after the join's publication last longer than the attack on it plus its preparation however
# loaded the machine is: a join is switched to once prepared, and a run that trains to its end
# first ends with "training finished before the join committed".
STRETCH = 10.0
ATTACK = 3.0  # seconds of deletions per pending generation (then the job must recover on its own)
TRANSITION_TIMEOUT = 10.0  # the documented bound of a pending generation, shortened for the test
PROBE = b"\0probe"  # compare_set(k, PROBE, PROBE): the value without blocking on an absent key



def _guessed(prefix: str, gen: int) -> list[str]:
    """Keys of generation ``gen`` the attacker guesses from the key names (contract.keys)."""
    names = [f"plan/{gen}", "plan/latest", "plan/current", f"gen/{gen}/decision", f"gen/{gen}/outcome",
             f"gen/{gen}/switch", f"gen/{gen}/arrivals"]
    for w in ("w0", "w1", "w2"):
        names += [f"gen/{gen}/{kind}/{w}" for kind in ("prepared", "connecting", "result", "arrived", "ready")]
        names += [f"hb/{w}", f"members/{w}", f"dead/{w}"]
    return [prefix + n for n in names]


def _attack(port: int, stop: threading.Event, seen: dict) -> None:
    client = store_client(port, stop)
    prefix = None
    while client is not None and prefix is None and not stop.is_set():
        with contextlib.suppress(Exception):  # the job's prefix: where its coordinator reports
            prefix = next((k.removesuffix("coordinator/status") for k in client.list_keys()
                           if k.endswith("/coordinator/status")), None)
        time.sleep(0.02)
    status_key = f"{prefix}coordinator/status"
    pending_since: dict[int, float] = {}
    last_raw: bytes | None = None
    while client is not None and prefix is not None and not stop.is_set():
        try:
            raw = client.compare_set(status_key, PROBE, PROBE)
            now = time.monotonic()
            if raw != PROBE and raw != last_raw:  # a status written anew
                last_raw = raw
                seen["updates"].append(now)
            st = sealed_json(raw) if raw != PROBE else None
            if st is not None:
                gen = st.get("pending")
                # a change of the running world (the first world's start is not one)
                if gen is not None and st.get("generation") is not None and gen > st["generation"]:
                    pending_since.setdefault(gen, now)
                for g, t0 in list(pending_since.items()):
                    if g != gen:  # decided: how long it was pending under attack
                        seen["windows"][g] = now - t0
                        del pending_since[g]
            gen = max(pending_since, default=None)
            if gen is not None and now - pending_since[gen] < ATTACK:  # a change is pending: delete
                # everything listed, and the guesses
                keys = [k for k in client.list_keys() if not k.startswith(prefix + "dev/")]
                for k in dict.fromkeys(keys + _guessed(prefix, gen)):
                    if client.delete_key(k):
                        seen["deleted"] += 1
                seen["bursts"] += 1
        except Exception as e:  # the coordinator may be between ticks; keep going
            seen.setdefault("errors", []).append(repr(e)[:200])
        time.sleep(0.02)
    seen["open"] = {g: time.monotonic() - t0 for g, t0 in pending_since.items()}


def test_keys_deleted_while_a_change_is_pending_neither_wedge_nor_break_it(tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setattr(driver, "free_port", lambda: port)  # the attacker knows where the store listens
    job = LocalRun(RunSpec.mock("tiny-llama", workers=2, parallel="tp=1,pp=1,dp=2", steps=STEPS,
                                global_batch=GLOBAL_BATCH, events=parse_events("3:leave=1 5:join=1"),
                                workdir=str(tmp_path), heartbeat_timeout=2.0, collective_timeout=10.0,
                                transition_timeout=TRANSITION_TIMEOUT, stretch=STRETCH))
    stop = threading.Event()
    seen: dict = {"deleted": 0, "bursts": 0, "windows": {}, "updates": []}
    report, codes = run_under_attack(job, [lambda: _attack(port, stop, seen)], stop)
    # the attack ran while changes were pending, and deleted keys each time
    assert seen["bursts"] > 5 and seen["deleted"] > 50, repr(seen)[:3000]
    assert len(seen["windows"]) >= 2, seen["windows"]  # the first world's, the leave's and the join's
    # every pending generation was decided within its bound, none left open
    assert not seen.get("open"), seen.get("open")
    assert all(w < TRANSITION_TIMEOUT + 10 for w in seen["windows"].values()), seen["windows"]
    # the coordinator's status kept being written (a report at least every few seconds)
    updates = seen["updates"]
    assert len(updates) > 10 and max(b - a for a, b in itertools.pairwise(updates)) < 10, updates
    assert [s["step"] for s in report["steps"]] == list(range(1, STEPS + 1))
    assert [s["consumed_samples"] for s in report["steps"]] == [GLOBAL_BATCH * k for k in range(1, STEPS + 1)]
    status = job.final_status or {}
    assert not status.get("dead") and status.get("finished"), status
    history = [h for h in status.get("history", []) if h.get("generation") is not None]
    outcomes = [h["outcome"] for h in history]
    # each change committed, possibly after aborted tries (asked again): the leave and the join
    assert [h["outcome"] for h in history].count("committed") >= 3, outcomes
    assert all(o == "committed" or o.startswith("aborted") for o in outcomes), outcomes
    assert report["steps"][-1]["world_size"] == 2 and [e["outcome"] for e in report["events"]] == ["committed"] * 2
    assert (status.get("tampering") or {}).get("deleted", 0) > 0, status.get("tampering")
    assert all(code == 0 for code in codes.values()), codes
