"""The pulse (``runtime/agent/pulse.py``): a worker whose process holds the GIL keeps a fresh
heartbeat; a frozen or dead worker does not.

Each test runs a small worker process (a real ``StoreClients`` and ``Pulse``, a control thread
that heartbeats through ``connection.beat`` as ``WorkerAgent`` does) against a real store and
reads its heartbeat key the way the coordinator does: a member is dead once ``now - hb["time"]``
exceeds the heartbeat timeout (3 s by default).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from liveshard.dev.ports import free_port
from liveshard.runtime.agent.pulse import process_state, stamped
from liveshard.runtime.contract.keys import SECRET_ENV, Keys
from liveshard.runtime.control.protocol import Heartbeat
from liveshard.runtime.control.store import JobStore, connect_store, serve_store

HEARTBEAT_TIMEOUT = 3.0  # the coordinator's default

WORKER = r"""
import sys, threading, time
from liveshard.runtime.agent.connection import StoreClients, beat
from liveshard.runtime.agent.pulse import Pulse
from liveshard.runtime.control.protocol import Heartbeat

port, mode, hog = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
clients = StoreClients("127.0.0.1", port, "job", timeout=30.0)
pulse = Pulse("w0", "127.0.0.1", port, "job", interval=0.2) if mode == "pulse" else None
if pulse is not None:
    assert pulse.start()

beaten = threading.Event()

def control():
    while True:
        beat(clients, "w0", Heartbeat(time=time.time(), state="training", incarnation="i0"), pulse)
        beaten.set()
        time.sleep(0.2)

clients.control_thread = threading.Thread(target=control, daemon=True)
clients.control_thread.start()
end = time.monotonic() + 60
while pulse is not None and not pulse.ready() and time.monotonic() < end:
    time.sleep(0.05)
beaten.clear()
beaten.wait(60)  # a heartbeat written (by the pulse, where it is ready) before the work starts
if pulse is not None:
    clients.store.set("test/pulse", f"{pulse.proc.pid} {pulse.dir}")
clients.store.set("test/hogging", "1")
# Hold the GIL: a pure-Python loop under a switch interval longer than the loop, so no other
# thread of this process runs until it ends (what a long C call or a data build does).
sys.setswitchinterval(hog + 10.0)
t0 = time.perf_counter()
while time.perf_counter() - t0 < hog:
    pass
sys.setswitchinterval(0.005)
clients.store.set("test/hogged", "1")
time.sleep(120.0)  # the test ends it
"""


@pytest.fixture()
def store(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "pulse-test-secret")
    port = free_port()
    server = serve_store("127.0.0.1", port)
    reader = JobStore(connect_store("127.0.0.1", port), "job", b"pulse-test-secret")
    yield port, reader
    del server


def _start(port: int, mode: str, hog: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-P", "-c", WORKER, str(port), mode, repr(hog)], env=dict(os.environ))


def _wait(reader: JobStore, key: str, proc: subprocess.Popen, timeout: float = 90.0) -> str:
    end = time.monotonic() + timeout
    while (value := reader.get(key)) is None:
        assert proc.poll() is None, f"the worker exited with {proc.returncode}"
        assert time.monotonic() < end, f"no {key} in {timeout:.0f} s"
        time.sleep(0.02)
    return value


def _staleness_until(reader: JobStore, key: str, proc: subprocess.Popen, timeout: float = 60.0) -> tuple[float, dict]:
    """The longest the heartbeat went without a new write (as the coordinator measures it) until
    ``key`` appears, and the last heartbeat read."""
    worst, hb = 0.0, {}
    end = time.monotonic() + timeout
    while reader.get(key) is None:
        assert proc.poll() is None and time.monotonic() < end
        hb = reader.get_json(Keys.heartbeat("w0")) or hb
        if hb:
            worst = max(worst, time.time() - hb["time"])
        time.sleep(0.05)
    return worst, hb


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()  # the worker only: its pulse must notice by itself
    proc.wait(timeout=10)


def test_stamped_heartbeat_carries_the_payload_and_its_age():
    hb = stamped(Heartbeat(time=100.0, state="training", step=7, incarnation="i"), 103.5).to_dict()
    assert hb["time"] == 103.5 and hb["published"] == 100.0 and hb["age"] == 3.5
    assert hb["state"] == "training" and hb["step"] == 7 and hb["incarnation"] == "i" and hb["pulse"]


def test_process_state_reads_proc():
    assert process_state(os.getpid()) in ("R", "S")
    child = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        end = time.monotonic() + 5
        while process_state(child.pid) != "T" and time.monotonic() < end:
            time.sleep(0.01)
        assert process_state(child.pid) == "T"
    finally:
        child.kill()
        child.wait()
    assert process_state(child.pid) is None


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pulse", pytest.param("thread", marks=pytest.mark.long)])  # thread: the control
def test_a_worker_holding_its_gil_for_5_s_keeps_a_fresh_heartbeat_only_with_the_pulse(store, mode):
    port, reader = store
    proc = _start(port, mode, hog=5.0)
    try:
        _wait(reader, "test/hogging", proc)
        worst, hb = _staleness_until(reader, "test/hogged", proc)
        print(f"{mode}: longest heartbeat gap {worst:.2f} s, last payload age {hb.get('age')}")
    finally:
        _stop(proc)
    assert hb, "no heartbeat before the work started"
    if mode == "pulse":
        # written all along, from the payload the worker published before it got busy
        assert worst < HEARTBEAT_TIMEOUT / 2, worst
        assert hb["pulse"] and hb["age"] > 3.0 and hb["state"] == "training", hb
    else:
        # the control thread could not run: the coordinator would have declared it dead
        assert worst > HEARTBEAT_TIMEOUT, worst
        assert "pulse" not in hb


@pytest.mark.slow
def test_a_frozen_worker_falls_silent_and_a_dead_one_takes_its_pulse_along(store):
    port, reader = store
    proc = _start(port, "pulse", hog=0.0)
    try:
        pid_text, directory = _wait(reader, "test/pulse", proc).split(" ", 1)
        _wait(reader, "test/hogged", proc)
        os.kill(proc.pid, signal.SIGSTOP)  # the worker alone: its pulse keeps running
        time.sleep(HEARTBEAT_TIMEOUT + 0.5)
        hb = reader.get_json(Keys.heartbeat("w0"))
        assert time.time() - hb["time"] > HEARTBEAT_TIMEOUT, hb  # a frozen worker is found dead
        assert process_state(int(pid_text)) in ("R", "S")
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(1.0)
        hb = reader.get_json(Keys.heartbeat("w0"))
        assert time.time() - hb["time"] < 1.0, hb
    finally:
        _stop(proc)
    end = time.monotonic() + 5
    while process_state(int(pid_text)) not in (None, "Z") and time.monotonic() < end:
        time.sleep(0.05)
    assert process_state(int(pid_text)) in (None, "Z")  # gone (a zombie where nobody reaps orphans)
    assert not os.path.exists(directory)
