"""The worker writes its heartbeats and registrations as the contract's dataclasses
(``control.protocol.Heartbeat``, ``Registration``): their JSON keeps the keys readers know, and
what is written reads back as what was built."""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field

from liveshard.runtime.agent.connection import heartbeat_payload, member_info
from liveshard.runtime.agent.pulse import stamped
from liveshard.runtime.control.protocol import Heartbeat, OpenGeneration, Registration, WorldPlan

PLAN = WorldPlan(generation=3, config="tp=1,pp=1,dp=2", members=("w0", "w1"), nodes=(("w0", "n0"), ("w1", "n1")))


@dataclass
class State:
    phase: str = "training"
    generation: int | None = 3
    rank: int | None = 1
    incarnation: str = "inc-1"


@dataclass
class Trainer:
    step_count: int = 12
    consumed_samples: int = 48
    last_step_seconds: float | None = 0.25
    last_loss: float | None = 7.5
    compute_log: deque = field(default_factory=lambda: deque([(11, 0.2, 4.0), (12, 0.21, 4.0)]))


def test_a_heartbeat_has_the_keys_it_always_had_and_reads_back():
    hb = heartbeat_payload(100.0, State(), Trainer(), preparing=4)
    wire = hb.to_dict()
    assert set(wire) >= {"time", "state", "generation", "rank", "step", "consumed_samples", "step_seconds",
                         "compute", "loss", "pid", "incarnation", "preparing"}
    assert set(wire) - {"health"} == {"time", "state", "generation", "rank", "step", "consumed_samples",
                                      "step_seconds", "compute", "loss", "pid", "incarnation", "preparing"}
    assert wire["compute"] == [[11, 0.2, 4.0], [12, 0.21, 4.0]] and wire["pid"] == os.getpid()
    assert wire["state"] == "training" and wire["step"] == 12 and wire["preparing"] == 4
    assert Heartbeat.parse(wire) == hb


def test_a_heartbeat_without_a_trainer_says_so_with_nulls():
    wire = heartbeat_payload(5.0, State(phase="waiting", generation=None, rank=None), None).to_dict()
    assert wire["step"] is None and wire["loss"] is None and wire["compute"] == [] and wire["preparing"] is None


def test_the_pulse_stamp_reads_back():
    hb = stamped(Heartbeat(time=10.0, state="training", step=2, incarnation="i"), 12.25)
    wire = hb.to_dict()
    assert wire["pulse"] is True and wire["published"] == 10.0 and wire["age"] == 2.25 and wire["time"] == 12.25
    assert Heartbeat.parse(wire) == hb


def test_malformed_reported_fields_do_not_make_a_heartbeat_invalid():
    hb = Heartbeat.parse({"time": 1.0, "state": "training", "compute": "x", "pid": "p", "health": [1]})
    assert hb is not None and hb.compute == () and hb.pid is None and hb.health is None
    assert Heartbeat.parse({"state": "training"}) is None  # no time: not a heartbeat


def test_a_first_registration_has_the_keys_it_always_had():
    reg = member_info("inc-1")
    wire = reg.to_dict()
    assert set(wire) - {"gpu_memory_bytes"} == {"host", "node", "pid", "incarnation", "time"}
    assert Registration.parse("w0", wire) == reg


def test_a_reannouncement_carries_its_world_and_reads_back():
    opened = OpenGeneration(generation=3, plan=PLAN, ready=True)
    pending = WorldPlan(generation=4, config="tp=2,pp=1,dp=1", members=("w0", "w1"), previous=3)
    reg = Registration(node="n0", incarnation="inc-1", plan=PLAN, latest_seen=4, checkpoint={"path": "/c", "step": 9},
                       open=opened, pending_plan=pending, host="h", pid=7, time=3.0, reconnected=True)
    wire = reg.to_dict()
    assert isinstance(wire["plan"], str) and isinstance(wire["pending_plan"], str)  # plans as their JSON text
    assert isinstance(wire["open"], dict) and wire["reconnected"] is True and wire["latest_seen"] == 4
    assert Registration.parse("w0", wire) == reg
    # latest_seen goes on the wire with a reconnection, even when no plan was seen yet
    assert member_info("inc-1", reconnected=True).to_dict()["latest_seen"] == -1
