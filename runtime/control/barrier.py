"""Waiting on the store: one loop for every "look, then sleep a little, until..." of the runtime.

``wait_until(check, timeout=..., abort=..., poll=...)`` calls ``check`` until it returns a value
(anything but ``None`` or ``False``), ``abort`` names a reason to give up, or ``timeout`` seconds
have passed; between looks it sleeps ``poll(attempt)`` seconds, never past the deadline. Every
round is, in this order: check, abort, deadline, sleep; so a check that succeeds at the deadline
still counts. The answer is an ``Outcome``: met (with the check's value), aborted (with the
reason) or timed out. An exception raised by ``check`` or ``abort`` (a store that went away)
ends the wait and reaches the caller unchanged: what a lost store means differs by caller.

``STORE_BACKOFF`` is how a process polls a key that many ranks poll at once: 5 ms at first,
growing ×1.5 to 100 ms. ``clock`` and ``sleep`` are injectable, so a wait can be tested without
real time (and a caller can do useful work, a heartbeat, in place of a sleep).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Seconds to sleep after the ``attempt``-th look (0 first): ``first`` growing by
    ``factor`` per attempt up to ``cap``."""

    first: float
    factor: float = 1.0
    cap: float | None = None

    @classmethod
    def fixed(cls, seconds: float) -> Backoff:
        return cls(seconds, 1.0, seconds)

    def __call__(self, attempt: int) -> float:
        delay = self.first * self.factor ** min(attempt, 20)  # the exponent is bounded: no overflow
        return delay if self.cap is None else min(self.cap, delay)


# Hundreds of ranks may poll the one store: 5 ms at first, backing off to 100 ms.
STORE_BACKOFF = Backoff(first=0.005, factor=1.5, cap=0.1)


class Status(Enum):
    MET = "met"
    ABORTED = "aborted"
    TIMED_OUT = "timed out"


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """How a wait ended: ``value`` is what ``check`` returned when met, ``reason`` what
    ``abort`` returned when aborted; ``attempts`` is how many times ``check`` was called."""

    status: Status
    value: T | None = None
    reason: str = ""
    attempts: int = 0

    @property
    def met(self) -> bool:
        return self.status is Status.MET

    @property
    def aborted(self) -> bool:
        return self.status is Status.ABORTED

    @property
    def timed_out(self) -> bool:
        return self.status is Status.TIMED_OUT


def wait_until(check: Callable[[], T | None], *, timeout: float | None = None,
               abort: Callable[[], str | None] | None = None,
               poll: Callable[[int], float] = STORE_BACKOFF,
               clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> Outcome[T]:
    """Wait until ``check()`` returns something other than ``None`` or ``False``.

    ``abort()`` is asked after every unmet check: a string (not ``None``) ends the wait with
    that reason. ``timeout`` (seconds from now on ``clock``; ``None``: no limit) ends it after
    an unmet check once the deadline is reached. ``poll(attempt)`` is the sleep after the
    ``attempt``-th unmet look, cut to what is left before the deadline."""
    end = None if timeout is None else clock() + timeout
    attempt = 0
    while True:
        value = check()
        if value is not None and value is not False:
            return Outcome(Status.MET, value, attempts=attempt + 1)
        if abort is not None:
            reason = abort()
            if reason is not None:
                return Outcome(Status.ABORTED, reason=reason, attempts=attempt + 1)
        delay = poll(attempt)
        if end is not None:
            left = end - clock()
            if left <= 0:
                return Outcome(Status.TIMED_OUT, attempts=attempt + 1)
            delay = min(delay, left)
        sleep(delay)
        attempt += 1
