"""The one wait loop of the runtime (``control.barrier.wait_until``), on a fake clock: no real
time passes, every sleep is recorded."""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist

from liveshard.runtime.control.barrier import STORE_BACKOFF, Backoff, Status, wait_until
from liveshard.runtime.control.store import JobStore


class FakeTime:
    """A clock that moves only when slept on."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


def _after(n: int, value: object = "v"):
    """A check met at its ``n``-th call (1 first); the calls are counted."""
    calls = []

    def check():
        calls.append(1)
        return value if len(calls) >= n else None

    check.calls = calls
    return check


def test_a_condition_already_met_returns_at_once_without_sleeping():
    t = FakeTime()
    out = wait_until(lambda: "here", timeout=5.0, clock=t.clock, sleep=t.sleep)
    assert out.met and out.status is Status.MET and out.value == "here" and out.attempts == 1
    assert t.sleeps == []


def test_a_condition_met_after_some_polls_backs_off_between_them():
    t = FakeTime()
    check = _after(4, value=7)
    out = wait_until(check, timeout=5.0, clock=t.clock, sleep=t.sleep)
    assert out.met and out.value == 7 and out.attempts == 4 and len(check.calls) == 4
    assert t.sleeps == pytest.approx([0.005, 0.0075, 0.01125])


def test_false_and_none_are_not_met_but_other_falsy_values_are():
    t = FakeTime()
    answers = iter([False, None, 0])
    out = wait_until(lambda: next(answers), clock=t.clock, sleep=t.sleep)
    assert out.met and out.value == 0 and len(t.sleeps) == 2
    out = wait_until(lambda: "", clock=t.clock, sleep=t.sleep)  # an empty store value is a value
    assert out.met and out.value == ""


def test_an_abort_condition_ends_the_wait_with_its_reason():
    t = FakeTime()
    decisions = iter([None, None, "aborted: w2 died"])
    out = wait_until(lambda: None, abort=lambda: next(decisions), timeout=60.0, clock=t.clock, sleep=t.sleep)
    assert out.aborted and not out.met and out.reason == "aborted: w2 died" and out.value is None
    assert len(t.sleeps) == 2 and out.attempts == 3


def test_a_met_condition_wins_over_an_abort_in_the_same_round():
    t = FakeTime()
    out = wait_until(lambda: True, abort=lambda: "stop", clock=t.clock, sleep=t.sleep)
    assert out.met


def test_a_timeout_ends_the_wait_without_oversleeping_the_deadline():
    t = FakeTime()
    out = wait_until(lambda: None, timeout=0.875, poll=Backoff.fixed(0.25), clock=t.clock, sleep=t.sleep)
    assert out.timed_out and out.value is None and out.reason == ""
    assert t.sleeps == [0.25, 0.25, 0.25, 0.125]  # the last sleep is cut to the deadline
    assert t.now == 100.875
    assert out.attempts == 5  # a last look at the deadline


def test_a_check_met_at_the_deadline_still_counts():
    t = FakeTime()
    check = _after(3)
    out = wait_until(check, timeout=0.5, poll=Backoff.fixed(0.25), clock=t.clock, sleep=t.sleep)
    assert out.met and t.now == pytest.approx(100.5)


def test_a_zero_timeout_looks_once():
    t = FakeTime()
    out = wait_until(lambda: None, timeout=0.0, clock=t.clock, sleep=t.sleep)
    assert out.timed_out and out.attempts == 1 and t.sleeps == []


def test_without_a_timeout_it_waits_as_long_as_it_takes():
    t = FakeTime()
    out = wait_until(_after(200), clock=t.clock, sleep=t.sleep)
    assert out.met and len(t.sleeps) == 199 and t.now > 100.0 + 19.0


def test_the_store_backoff_grows_from_5_ms_by_half_to_100_ms():
    delays = [STORE_BACKOFF(a) for a in range(10)]
    assert delays[:4] == pytest.approx([0.005, 0.0075, 0.01125, 0.016875])
    assert all(b == pytest.approx(min(0.1, a * 1.5)) for a, b in itertools.pairwise(delays))
    assert STORE_BACKOFF(8) == 0.1 and STORE_BACKOFF(10_000) == 0.1  # capped, no overflow
    assert Backoff.fixed(0.02)(0) == Backoff.fixed(0.02)(50) == 0.02


def test_the_poll_may_depend_on_the_state_and_the_sleep_may_do_work():
    """The commit point sleeps 0.25 s while its store is lost; a preparation heartbeats
    between looks instead of sleeping."""
    t = FakeTime()
    lost = iter([False, True, True, False])
    beats: list[float] = []
    out = wait_until(_after(5), poll=lambda a: 0.25 if next(lost) else STORE_BACKOFF(a), clock=t.clock,
                     sleep=lambda s: (beats.append(s), t.sleep(s)))
    assert out.met and beats == pytest.approx([0.005, 0.25, 0.25, 0.016875])


def test_a_store_that_fails_ends_the_wait_with_its_error():
    t = FakeTime()
    calls = []

    def check():
        calls.append(1)
        if len(calls) == 2:
            raise ConnectionError("the store went away")

    with pytest.raises(ConnectionError, match="went away"):
        wait_until(check, timeout=5.0, clock=t.clock, sleep=t.sleep)
    assert len(t.sleeps) == 1  # no sleep after the failure

    def abort():
        raise RuntimeError("the abort's store went away")

    with pytest.raises(RuntimeError, match="abort's store"):
        wait_until(lambda: None, abort=abort, clock=t.clock, sleep=t.sleep)


def test_the_job_store_waits_for_a_key_through_the_barrier():
    store = JobStore(dist.HashStore(), secret=b"test-secret")
    store.set("k", "v")
    assert store.wait_for("k", timeout=1.0) == "v"
    assert store.wait_for("absent", timeout=0.05) is None
