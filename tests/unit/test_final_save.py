"""The end of a run is never lost: the final save's schedule and verdicts (pure), the coordinator's
answer to a final checkpoint that cannot be saved, the status a retried save clears, and a first
world aborted by a death made again with every survivor. No processes (the real ones:
``tests/integration/test_run_ends.py``)."""

from __future__ import annotations

import pytest
from test_coordinator import LOCAL, Requests, _beat, _coordinator, _running

from liveshard.runtime.agent.final_save import Attempt, attempts, give_up_reason, verdict
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.contract.status import CheckpointReport
from liveshard.runtime.coordinator import PlanRequest


def test_the_final_save_tries_both_directories_at_once_then_waits_for_space_with_doubling_pauses():
    plan = attempts("/ckpt", "/fallback", patience=40.0, first_pause=5.0, longest_pause=15.0)
    assert plan == [Attempt("/ckpt"), Attempt("/fallback"),
                    Attempt("/ckpt", 5.0), Attempt("/fallback"),
                    Attempt("/ckpt", 10.0), Attempt("/fallback"),
                    Attempt("/ckpt", 15.0), Attempt("/fallback"),
                    Attempt("/ckpt", 10.0), Attempt("/fallback")]  # the last pause fills the patience
    assert sum(a.wait for a in plan) == 40.0


@pytest.mark.parametrize(("primary", "fallback", "patience", "expected"), [
    ("/ckpt", None, 0.0, [Attempt("/ckpt")]),  # no patience: one try
    ("/ckpt", "/ckpt", 0.0, [Attempt("/ckpt")]),  # the same directory once
    (None, "/fallback", 3.0, [Attempt("/fallback"), Attempt("/fallback", 3.0)]),  # checkpoint dir unusable at start
    (None, None, 100.0, []),  # nowhere to save: the worker says so, nothing is tried
])
def test_the_schedule_of_the_final_save_in_its_corner_cases(primary, fallback, patience, expected):
    assert attempts(primary, fallback, patience, first_pause=5.0) == expected


def test_the_verdict_of_an_attempt_is_the_same_line_on_every_rank():
    assert verdict([None, None, None]) is None
    # megatron raises one write failure on every rank: said once
    assert verdict(["OSError: [Errno 28] No space left on device"] * 2) == "OSError: [Errno 28] No space left on device"
    assert verdict([None, "x", "x"]) == "x (on rank(s) 1, 2)"
    assert verdict(["does not verify", "other"]) == "rank 0: does not verify (and 1 more rank(s))"


def test_a_write_failure_is_told_by_the_disk_error_behind_it_in_one_line():
    from torch.distributed.checkpoint import CheckpointException

    from liveshard.runtime.agent.final_save import _first_cause

    # megatron's failure dict holds (exception, traceback) per rank; another rank's writer saw
    # only what the full disk made of its file
    error = CheckpointException("write", {0: (RuntimeError("unexpected pos 704 vs 598"), "tb"),
                                          1: (OSError(28, "No space left on device"), "tb")})
    assert _first_cause(error) == "rank 1: OSError: [Errno 28] No space left on device"
    assert _first_cause(OSError("two\nlines")) == "two lines"


def test_the_reason_a_job_fails_with_names_where_it_tried_for_how_long_and_why():
    line = give_up_reason(300, ["/ckpt", "/fallback", "/ckpt"], "OSError: [Errno 28] No space left on device", 59.6)
    assert line == ("the final checkpoint of step 300 could not be saved in /ckpt and /fallback (tried for 60 s): "
                    "OSError: [Errno 28] No space left on device")
    assert "\n" not in line


def test_a_final_checkpoint_that_cannot_be_saved_fails_the_job_and_the_exits_after_it_are_no_deaths():
    source = Requests()
    c = _coordinator(source, LOCAL)
    _running(c, source, ("w0", "w1"), "tp=1,pp=1,dp=2")
    reason = "the final checkpoint of step 3 could not be saved in /ckpt (tried for 600 s): OSError: no space"
    c.store.set_json(Keys.FINISHED, {"step": 3, "checkpoint": None, "error": reason, "generation": 0})
    for w in ("w0", "w1"):  # the workers exit right after saying so, in the same tick
        c.store.set_json(Keys.heartbeat(w), {"time": 1e12, "state": "exited"})
    c.tick()
    assert c.core.failure["reason"] == "FinalCheckpointFailed" and c.core.failure["message"] == reason
    assert c.core.finished is None and c.pending is None  # neither finished nor recovered
    assert c.store.has(Keys.STOP)


def test_a_finished_report_without_an_error_still_finishes_the_job():
    source = Requests()
    c = _coordinator(source, LOCAL)
    _running(c, source, ("w0", "w1"), "tp=1,pp=1,dp=2")
    c.store.set_json(Keys.FINISHED, {"step": 3, "checkpoint": "/ckpt/step00000003", "generation": 0})
    c.tick()
    assert c.core.failure is None and c.core.finished["checkpoint"] == "/ckpt/step00000003"


def test_a_final_save_that_succeeded_after_failing_clears_checkpoint_failing():
    failed = {"count": 2, "step": 300, "error": "final checkpoint in /ckpt: no space", "time": 1.0}
    latest = {"path": "/fallback/step00000300", "step": 300}
    assert CheckpointReport.from_coordinator({"latest": latest, "failed": failed}).failing
    cleared = CheckpointReport.from_coordinator({"latest": latest, "failed": {**failed, "resolved": 300}})
    assert not cleared.failing and cleared.failed_saves == 2 and cleared.last_failure is None


def test_a_first_world_aborted_by_a_death_starts_again_with_every_survivor_even_those_still_silent():
    """The survivors wait for the dead member in the world's rendezvous and answer only once it
    fails: their missing results say nothing of them, and they are in the next first world."""
    source = Requests()
    c = _coordinator(source, LOCAL)
    for w in ("w0", "w1", "w2"):
        c.store.register_member(w, {"host": "h", "node": f"node-{w}"})
    _beat(c, "w0", "w1", "w2")
    source.queue.append(PlanRequest(members=("w0", "w1", "w2"), config="tp=1,pp=1,dp=2"))
    c.tick()
    first = c.pending.plan
    assert first.generation == 0 and first.members == ("w0", "w1")
    c.tick()
    c.clock.advance(10)  # w1 killed in the start: silent past the timeout; the others beat, no result yet
    _beat(c, "w0", "w2")
    c.tick()
    assert "w1" in c.dead and c.history[-1]["outcome"].startswith("aborted: member w1 died")
    for _ in range(3):
        _beat(c, "w0", "w2")
        c.tick()
        if c.pending is not None:
            break
    again = c.pending.plan
    assert again.generation == 1 and again.previous is None and set(again.members) == {"w0", "w2"}


def test_a_failed_write_on_a_full_disk_says_so_whatever_the_writer_raised(tmp_path, monkeypatch):
    """torch's archive writer can fail on a full disk with "unexpected pos ..." instead of ENOSPC:
    the message still names the cause when the filesystem has (almost) no room left."""
    import shutil
    from collections import namedtuple

    from liveshard.runtime.agent import final_save

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(2 << 20, (2 << 20) - 512, 512))
    assert final_save._full_disk(str(tmp_path / "not" / "made")).startswith("No space left on device (512 bytes free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 1 << 30, 1 << 39))
    assert final_save._full_disk(str(tmp_path)) is None
