"""The plan source's I/O runs on a thread of its own (``coordinator.BackgroundSource``): a slow
API never holds up the coordinator's tick, and a source still sees the report about the request
it handed over before it is polled again."""

from __future__ import annotations

import threading
import time

from liveshard.runtime.coordinator import BackgroundSource, PlanRequest


class SlowSource:
    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.log: list[str] = []
        self.queue = [PlanRequest(members=("a",), reason="one"), PlanRequest(members=("b",), reason="two")]
        self.lock = threading.Lock()

    def poll(self):
        time.sleep(self.delay)  # an API call
        with self.lock:
            self.log.append("poll")
            return self.queue.pop(0) if self.queue else None

    def report(self, status: dict) -> None:
        time.sleep(self.delay)
        with self.lock:
            self.log.append(f"report {status['n']}")

    def planning(self):
        return None


def _until(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end
        time.sleep(0.01)


def test_a_slow_api_never_holds_up_the_tick_and_reports_keep_their_order():
    inner = SlowSource(delay=0.5)
    source = BackgroundSource(inner, period=0.01)
    try:
        t0 = time.monotonic()
        got = None
        while True:
            t = time.monotonic()
            got = source.poll()
            if got is not None:
                break
            source.report({"n": 0})
            assert time.monotonic() - t < 0.05  # the tick's calls return at once
            time.sleep(0.02)
            assert time.monotonic() - t0 < 10
        assert got.reason == "one"
        source.report({"n": 1})  # the coordinator's report about that request
        _until(lambda: inner.log.count("poll") >= 2)
        with inner.lock:
            log = list(inner.log)
        first = log.index("poll")
        second = log.index("poll", first + 1)
        assert "report 1" in log[first:second], log  # reported before it was polled again
    finally:
        source.close()
