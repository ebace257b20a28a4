"""``kill=coordinator@PHASE`` events of a local run: how they are written, and the dev hold that
keeps the members at the phase while the driver kills the coordinator (``HeldPhases``: released
once the store, the restarted coordinator's, no longer names the phase)."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from liveshard.dev.localrun.events import parse_events
from liveshard.dev.localrun.held_worker import HeldPhases
from liveshard.dev.ports import free_port
from liveshard.runtime.contract.keys import SECRET_ENV, Keys
from liveshard.runtime.control.protocol import PHASES
from liveshard.runtime.control.store import JobStore, connect_store, serve_store
from liveshard.runtime.errors import ConfigError

SECRET = b"test-secret"


def test_a_coordinator_kill_names_a_phase_and_a_change_to_kill_in():
    kill, change = parse_events("2:kill=coordinator@commit-window 3:parallel=tp=1,pp=1,dp=2")
    assert kill.coordinator and kill.phase == "commit-window" and not kill.ranks and not kill.joiners
    assert str(kill) == "2:kill=coordinator@commit-window" and "commit-window" in PHASES
    assert not change.coordinator
    for bad, says in [("2:kill=coordinator 3:join=1", "at no phase"),
                      ("2:kill=coordinator@later 3:join=1", "unknown phase 'later'"),
                      ("2:kill=coordinator@prepare", "needs a reconfiguration")]:
        with pytest.raises(ConfigError, match=says):
            parse_events(bad)


def test_a_member_held_at_a_phase_goes_on_once_the_restarted_coordinators_store_names_none(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())  # the held worker's client reads it
    port = free_port()
    server = serve_store("127.0.0.1", port)
    JobStore(connect_store("127.0.0.1", port), secret=SECRET).set(Keys.hold_phase("w0"), "commit-window")
    gate = HeldPhases("127.0.0.1", port, "job", "w0", timeout=60.0, poll=0.05)
    done = threading.Event()
    threading.Thread(target=lambda: (gate("commit-window", 4), done.set()), daemon=True).start()
    store = JobStore(connect_store("127.0.0.1", port), secret=SECRET)
    end = time.monotonic() + 20
    while store.get(Keys.at_phase("w0")) != "commit-window:4":
        assert time.monotonic() < end
        time.sleep(0.02)
    time.sleep(0.3)
    assert not done.is_set()  # held while the store names the phase
    server = None  # the coordinator is killed ...
    gc.collect()
    time.sleep(0.3)
    assert not done.is_set()
    server = serve_store("127.0.0.1", port)  # ... and restarted on the same address, empty
    assert done.wait(20), "the hold was not released by the restarted coordinator's store"
    del server
