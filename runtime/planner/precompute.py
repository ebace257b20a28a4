"""Plans worked out before the events that need them: a memo of pure planning calls.

After each commit the coordinator asks, in a background thread, the questions the likeliest
next events will ask (a node lost without notice, a waiting worker joining): the world plan
for the workers left, and whether the running world still holds a live copy of every piece of
state. When the event comes, the coordinator asks the same question again and the answer is
there: no planning between detecting the event and publishing its plan.

The cache is keyed by everything a question's answer is a function of (the function and its
whole argument tuple: model, GPUs with their nodes, memory and speeds, constraints, the
running config and members, the lost members; the transition's configs, device map and rank
order), so an entry can only ever answer exactly the question it was computed for: a stale one
is never used, it is merely never asked for again. A question being computed when it is asked
is waited for, not computed twice. Exceptions are answers too (``NoFeasiblePlan``, a
``ConfigError``): they are kept and raised again. Pure: no I/O.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any


class PlanCache:
    """Answers of pure planning calls by their full inputs (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._answers: dict[Hashable, Future] = {}
        self.hits = 0  # questions answered from the cache (or by waiting for it)
        self.misses = 0

    def get(self, key: Hashable, compute: Callable[[], Any], *, count: bool = True) -> Any:
        """``compute()``'s answer for ``key``: cached, being computed by another thread (waited
        for), or computed now. ``count``: whether this call counts as a hit or a miss (the
        background's own calls do not)."""
        with self._lock:
            fut = self._answers.get(key)
            mine = fut is None
            if mine:
                fut = self._answers[key] = Future()
            if count:
                if mine:
                    self.misses += 1
                else:
                    self.hits += 1
        if mine:
            try:
                fut.set_result(compute())
            except BaseException as e:  # an answer too: raised to every asker (none left waiting)
                fut.set_exception(e)
        return fut.result()

    def clear(self) -> None:
        """Forget every answer (a new world: its questions are other ones)."""
        with self._lock:
            self._answers.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._answers)
