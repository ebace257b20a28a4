"""What a worker wrote for a generation under way, kept written until the generation is decided.

A client without the job's secret can delete or overwrite any key of the store, and a reader that
never read a key sees its deletion as absence (``control.store.JobStore``). A member's result,
its prepared digest, its connect answer, its arrival and its ready vote deleted before their
readers read them would leave the generation to abort at the transition timeout. Each is a value
its writer never takes back, so writing it again is always what the writer said: the control
thread reads them back (``KeptWrites.restore``) and writes again what is gone or not authentic.
"""

from __future__ import annotations

import logging
import threading

from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.control.store import JobStore

log = logging.getLogger("liveshard.worker")

KEPT_CHECK = 0.5  # seconds between read-backs of the kept writes (``KeptWrites.restore``)


class KeptWrites:
    """What this worker wrote for generations still undecided: written again where gone or not
    authentic (``restore``, by the control thread), dropped once the generation has an outcome.
    Only values a member never takes back are kept (a digest, an answer, a result, an arrival, a
    ready vote)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, tuple[int, str]] = {}  # key -> (generation, value)
        self._checked = float("-inf")

    def keep(self, gen: int, key: str, value: str) -> None:
        with self._lock:
            self._values[key] = (gen, value)

    def write(self, store: JobStore, gen: int, key: str, value: str) -> None:
        """Write ``key`` for generation ``gen`` and keep it written until the generation is decided."""
        store.set(key, value)
        self.keep(gen, key, value)

    def restore(self, store: JobStore, now: float) -> None:
        """Read every kept write back, at most every ``KEPT_CHECK`` seconds (``now``: monotonic)."""
        if now - self._checked < KEPT_CHECK:
            return
        self._checked = now
        with self._lock:
            kept = dict(self._values)
        decided: set[int] = set()
        for gen in sorted({g for g, _ in kept.values()}):
            if store.has(Keys.outcome(gen)):
                decided.add(gen)
        for key, (gen, value) in kept.items():
            if gen in decided:
                continue
            r = store.read(key)
            if r.tampered or r.value != value:
                log.warning("store key %s (this worker's, generation %d) was deleted or overwritten: written again",
                            key, gen)
                store.set(key, value)
        with self._lock:
            for key in [k for k, (g, _) in self._values.items() if g in decided]:
                del self._values[key]
