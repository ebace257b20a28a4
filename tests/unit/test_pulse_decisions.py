"""The pulse's decisions (``runtime/agent/pulse.py``) one look at a time, over an in-process store:
who writes each payload (one writer per payload), when the pulse writes, when it falls silent.
The processes themselves are in ``tests/integration/test_pulse.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import torch.distributed as dist

from liveshard.runtime.agent.pulse import PAYLOAD, READY, Pulse, Pulsing
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.control.protocol import Heartbeat
from liveshard.runtime.control.store import JobStore

SECRET = b"pulse-test-secret"


class Running:
    returncode = None

    def poll(self) -> int | None:
        return None


def _pulse(tmp_path) -> Pulse:
    pulse = Pulse("w0", "127.0.0.1", 1, "job", interval=0.5, stale_after=60.0)
    pulse.proc, pulse.dir = Running(), str(tmp_path)
    return pulse


def _pulsing(tmp_path, pid: int | None = None) -> Pulsing:
    pulsing = Pulsing(pid or os.getpid(), "127.0.0.1", 1, "job", "w0", str(tmp_path), interval=0.5,
                      stale_after=60.0, secret=SECRET)
    pulsing.store = JobStore(dist.HashStore(), secret=SECRET)  # connected (epoch 0)
    return pulsing


def test_a_payload_is_handed_over_only_while_the_pulse_is_connected(tmp_path):
    pulse = _pulse(tmp_path)
    assert pulse.publish(Heartbeat(time=1.0, state="training")) is False  # not connected: the worker sends it itself
    assert json.loads((tmp_path / PAYLOAD).read_text())["pulse"] is False
    (tmp_path / READY).touch()
    assert pulse.publish(Heartbeat(time=2.0, state="training"), epoch=3) is True
    doc = json.loads((tmp_path / PAYLOAD).read_text())
    assert doc == {"epoch": 3, "payload": Heartbeat(time=2.0, state="training").to_dict(), "pulse": True}
    pulse._stopped = True
    assert pulse.publish(Heartbeat(time=3.0, state="training")) is False


def test_the_pulse_writes_what_was_handed_over_at_once_and_every_interval(tmp_path):
    pulse, pulsing = _pulse(tmp_path), _pulsing(tmp_path)
    assert pulsing.tick(100.0) == "nothing published"
    (tmp_path / READY).touch()  # what connecting says: the worker hands its payloads over
    now = time.time()
    assert pulse.publish(Heartbeat(time=now, state="training", step=3)) is True
    assert pulsing.tick(now) == "sent"
    hb = pulsing.store.get_json(Keys.heartbeat("w0"))
    assert hb["step"] == 3 and hb["pulse"] and hb["time"] == now
    assert pulsing.tick(now + 0.1) == "sent recently"
    assert pulsing.tick(now + 4.0) == "sent"  # the worker is busy: the same payload, a new time
    hb = pulsing.store.get_json(Keys.heartbeat("w0"))
    assert hb["time"] == now + 4.0 and hb["age"] == 4.0 and hb["published"] == now


def test_a_payload_the_worker_sent_itself_is_taken_over_only_when_it_is_old(tmp_path):
    pulse, pulsing = _pulse(tmp_path), _pulsing(tmp_path)
    now = time.time()
    assert pulse.publish(Heartbeat(time=now, state="training")) is False
    assert pulsing.tick(now + 0.2) == "sent by the worker"
    assert pulsing.store.get_json(Keys.heartbeat("w0")) is None
    assert pulsing.tick(now + 1.5) == "sent"


def test_a_stale_payload_is_not_pulsed(tmp_path):
    pulse, pulsing = _pulse(tmp_path), _pulsing(tmp_path)
    (tmp_path / READY).touch()
    now = time.time()
    pulse.publish(Heartbeat(time=now - 61.0, state="training"))
    assert pulsing.tick(now) == "stale"
    assert pulsing.store.get_json(Keys.heartbeat("w0")) is None


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_a_stopped_worker_is_not_pulsed(tmp_path):
    child = subprocess.Popen(["sleep", "30"])
    try:
        pulse, pulsing = _pulse(tmp_path), _pulsing(tmp_path, pid=child.pid)
        (tmp_path / READY).touch()
        now = time.time()
        pulse.publish(Heartbeat(time=now, state="training"))
        assert pulsing.tick(now) == "sent"
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(0.2)
        assert pulsing.tick(now + 1.0) == "worker stopped"
        os.kill(child.pid, signal.SIGCONT)
        time.sleep(0.2)
        assert pulsing.tick(now + 1.1) == "sent"
    finally:
        child.kill()
        child.wait()
