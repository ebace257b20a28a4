"""The job's store as the protocol sees it, for the simulator: values with or without a valid MAC,
replays, deletions, compare-and-set, counters, and a server that dies with its coordinator.

``SimStore`` is one incarnation of the coordinator's c10d store (a restarted coordinator serves a
new, empty one). ``Reader`` is one process's authenticated view of it, with the rules of
``control.store.JobStore``: a forged, replayed or deleted value is tampering, never "absent"; the
last valid value stands; a write-once key keeps the first valid value read.
"""

from __future__ import annotations

from dataclasses import dataclass


class StoreDown(Exception):
    """The store's server is gone (its coordinator died)."""


@dataclass(frozen=True)
class Entry:
    value: object  # what the value decodes to (the simulator skips the encoding)
    valid: bool  # the MAC verifies (written by a holder of the job's secret)
    seq: int  # the writer's sequence, bound into the MAC


def write_once(key: str) -> bool:
    """Keys whose first valid value is final (a later different one is tampering)."""
    return key.endswith(("/decision", "/outcome")) or "/result/" in key or (key.startswith("plan/")
                                                                           and key[5:].isdigit())


class SimStore:
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.up = True
        self.data: dict[str, Entry] = {}
        self.history: dict[str, list[Entry]] = {}  # every valid value each key held (what a replay can use)
        self.counters: dict[str, int] = {}
        self.seq = 0

    # ---- the job's processes ------------------------------------------------------------------
    def set(self, key: str, value: object) -> None:
        """A ``TCPStore.set``: on a dead server it may return without error and write nothing."""
        if not self.up:
            return
        self.seq += 1
        e = Entry(value, True, self.seq)
        self.data[key] = e
        self.history.setdefault(key, []).append(e)

    def set_confirmed(self, key: str, value: object) -> None:
        """A write read back (or an ``add``): fails at once on a dead server."""
        if not self.up:
            raise StoreDown(key)
        self.set(key, value)

    def get(self, key: str) -> Entry | None:
        if not self.up:
            raise StoreDown(key)
        return self.data.get(key)

    def add(self, key: str, n: int) -> int:
        if not self.up:
            raise StoreDown(key)
        self.counters[key] = self.counters.get(key, 0) + n
        return self.counters[key]

    def decide(self, key: str, value: str) -> str:
        """First *valid* writer wins: forged bytes under the key do not block the compare-and-set
        (``JobStore.decide`` retries against them)."""
        if not self.up:
            raise StoreDown(key)
        e = self.data.get(key)
        if e is not None and e.valid:
            return e.value
        self.set(key, value)
        return value

    # ---- an attacker without the secret ------------------------------------------------------
    def forge(self, key: str) -> None:
        if self.up:
            self.seq += 1
            self.data[key] = Entry("forged", False, self.seq)

    def replay(self, key: str) -> bool:
        """Write back the oldest valid value the key held (validly signed, out of date)."""
        old = self.history.get(key)
        if not self.up or not old or self.data.get(key) == old[0]:
            return False
        self.data[key] = old[0]
        return True

    def delete(self, key: str) -> None:
        if self.up:
            self.data.pop(key, None)

    def bump(self, key: str) -> None:
        if self.up:
            self.counters[key] = self.counters.get(key, 0) + 1


class Reader:
    """One process's view of one store incarnation (``JobStore``'s rules)."""

    def __init__(self, store: SimStore) -> None:
        self.store = store
        self.last: dict[str, Entry] = {}
        self.tampered = 0

    def read(self, key: str) -> tuple[object, bool]:
        """(the last valid value, whether this read saw tampering); raises ``StoreDown``."""
        e = self.store.get(key)
        kept = self.last.get(key)
        if e is None or not e.valid or (kept is not None and (e.seq < kept.seq or (write_once(key)
                                                                                   and e.value != kept.value))):
            # deleted (the protocol never deletes what it reads), forged, replayed, or a write-once
            # value rewritten: the last valid value stands, and a write-once one is put back
            if kept is None:
                if e is None:
                    return None, False
                self.tampered += 1
                return None, True
            self.tampered += 1
            if write_once(key) and self.store.up:
                self.store.data[key] = kept
            return kept.value, True
        self.last[key] = e
        return e.value, False

    def get(self, key: str) -> object:
        return self.read(key)[0]
