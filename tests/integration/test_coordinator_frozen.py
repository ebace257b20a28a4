"""The coordinator's process stopped (SIGSTOP) for three heartbeat timeouts, then continued: its
store stopped with it, so no heartbeat could land meanwhile. On waking it must not take that
time for its members' silence: no live worker is declared dead, training never stops, and every
process ends with exit code 0. Real coordinator and worker processes on CPU (gloo)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from liveshard.dev.localrun.driver import LocalRun, RunSpec

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT = 2.0


def _freeze_when_training(job: LocalRun, path, seconds: float, done: list[float]) -> None:
    """SIGSTOP the coordinator once the first world trains, SIGCONT ``seconds`` later."""
    end = time.monotonic() + 120
    while time.monotonic() < end:
        steps = [p for p in path.glob("w*.steps.jsonl") if p.stat().st_size > 0] if path.exists() else []
        coordinator = job.procs.coordinator
        if steps and coordinator is not None and coordinator.poll() is None:
            os.kill(coordinator.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            time.sleep(seconds)
            os.kill(coordinator.pid, signal.SIGCONT)
            done.append(time.monotonic() - t0)
            return
        time.sleep(0.05)


def test_a_coordinator_stopped_past_the_heartbeat_timeout_declares_nobody_dead(tmp_path):
    steps = 400
    job = LocalRun(RunSpec.mock("tiny-llama", workers=2, parallel="tp=1,pp=1,dp=2", steps=steps, global_batch=4,
                                events=[], workdir=str(tmp_path), heartbeat_timeout=HEARTBEAT_TIMEOUT,
                                collective_timeout=10.0))
    frozen: list[float] = []
    thread = threading.Thread(target=_freeze_when_training, args=(job, tmp_path, 3 * HEARTBEAT_TIMEOUT, frozen),
                              daemon=True)
    thread.start()
    try:
        report = job.run_live()
        codes = {w: p.wait(timeout=60) for w, p in job.procs.workers.items()}
    finally:
        job.procs.kill_all()
    thread.join(timeout=5)
    assert frozen and frozen[0] >= 3 * HEARTBEAT_TIMEOUT, "the coordinator was never stopped while training"
    log = (tmp_path / "coordinator.log").read_text(errors="replace")
    assert "is dead" not in log, [line for line in log.splitlines() if "is dead" in line]
    assert "did not run for" in log  # it knew it had been stopped
    assert [s["step"] for s in report["steps"]] == list(range(1, steps + 1))
    assert codes == {"w0": 0, "w1": 0}, codes
