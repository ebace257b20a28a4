"""A client that reaches a running local job's store but lacks its secret replays an earlier,
validly sealed value of ``checkpoint/latest``: it captures the raw bytes while they name the
step-5 checkpoint, and writes them back over every newer value within milliseconds, so that the
coordinator (restarted at step 2: its store's readers start with no memory) never reads the
step-10 pointer. Then a member is killed in a tensor-parallel world of two, where the survivor
holds only half of every weight: the coordinator restores from a checkpoint
(``planning._with_restore_if_needed``, which reads ``Coordinator.latest_checkpoint``). It must restore the newest checkpoint on the job's
volume that verifies (step 10), not the one the replayed pointer names: steps 11-13 recomputed,
not 6-13, and every step trained in order with its samples. Real coordinator and worker
processes on CPU (gloo)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from attacks import client as store_client
from attacks import run_under_attack, sealed_json

from liveshard.dev.localrun import driver
from liveshard.dev.localrun.driver import LocalRun, RunSpec
from liveshard.dev.localrun.events import parse_events
from liveshard.dev.ports import free_port

pytestmark = pytest.mark.slow

GLOBAL_BATCH, STEPS, EVERY = 4, 14, 5
OLD, NEWEST = 5, 10  # the replayed checkpoint's step; the newest one when the member is lost
# the coordinator restarts at step 2 (a new store); rank 1 is killed at 13 (before the step-15 save)
KILL_AT = 13
EVENTS = f"2:coordinator=restart {KILL_AT}:kill=1"
PROBE = b"\0probe"  # compare_set(k, PROBE, PROBE): the value without blocking on an absent key


def _step(raw: bytes) -> int | None:
    """The step a sealed pointer names (readable by anyone)."""
    try:
        return int(sealed_json(raw)["step"])
    except (KeyError, TypeError, ValueError):
        return None


def _replay(job: LocalRun, port: int, stop: threading.Event, seen: dict) -> None:
    """Capture the pointer's bytes while they name step OLD; from then on, write them back over
    every newer value within milliseconds, until the member is killed."""
    client, key = None, None
    while not stop.is_set() and KILL_AT not in job.signalled_at:
        try:
            client = client or store_client(port, stop)
            key = key or next((k for k in client.list_keys() if k.endswith("/checkpoint/latest")), None)
            raw = client.compare_set(key, PROBE, PROBE) if key is not None else PROBE
            if raw != PROBE and "captured" not in seen and _step(raw) == OLD:
                seen["captured"] = raw
            elif raw != PROBE and "captured" in seen and raw != seen["captured"]:
                seen.setdefault("replaced", []).append(_step(raw))
                client.set(key, seen["captured"])
        except Exception:
            client = None  # the store restarts with its coordinator: connect again
        time.sleep(0.002)


def _step_log(path: Path, wid: str) -> list[dict]:
    return [json.loads(line) for line in (path / f"{wid}.steps.jsonl").read_text().splitlines() if line.strip()]


def test_a_replayed_checkpoint_pointer_does_not_roll_a_restore_back(tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setattr(driver, "free_port", lambda: port)  # the attacker knows where the store listens
    job = LocalRun(RunSpec.mock("tiny-llama", workers=2, parallel="tp=2,pp=1,dp=1", steps=STEPS,
                                global_batch=GLOBAL_BATCH, events=parse_events(EVENTS), workdir=str(tmp_path),
                                heartbeat_timeout=2.0, collective_timeout=10.0, checkpoint_every=EVERY))
    stop, seen = threading.Event(), {}
    report, codes = run_under_attack(job, [lambda: _replay(job, port, stop, seen)], stop)
    # the replay landed over the newer pointer
    assert _step(seen.get("captured", b"")) == OLD and NEWEST in seen.get("replaced", []), seen
    # the survivor restored the newest checkpoint, not the replayed one
    result = json.loads((tmp_path / "w0.json").read_text())
    restores = [e for e in result.get("events", []) if e["kind"] == "restore"]
    assert [Path(e["from"]).name for e in restores] == [f"step{NEWEST:08d}"], restores
    log = (tmp_path / "coordinator.log").read_text(errors="replace")
    assert f"checkpoint/latest names step {OLD}, but step {NEWEST} verifies" in log
    # after the restore it trained from step NEWEST + 1: only the steps since that checkpoint again
    restored = restores[0]["generation"]
    again = [r["step"] for r in _step_log(tmp_path, "w0") if r["generation"] == restored]
    assert again == list(range(NEWEST + 1, STEPS + 1)), again
    # the recomputed steps give the losses the lost world computed
    before = {r["step"]: r["loss"] for r in _step_log(tmp_path, "w0") if r["generation"] != restored}
    after = {r["step"]: r["loss"] for r in _step_log(tmp_path, "w0") if r["generation"] == restored}
    common = sorted(set(before) & set(after))
    assert common and all(after[s] == pytest.approx(before[s], rel=1e-5) for s in common), (before, after)
    assert [s["step"] for s in report["steps"]] == list(range(1, STEPS + 1))
    assert [s["consumed_samples"] for s in report["steps"]] == [GLOBAL_BATCH * k for k in range(1, STEPS + 1)]
    assert report["steps"][-1]["world_size"] == 1
    assert codes["w0"] == 0, codes
