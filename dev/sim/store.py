"""The simulated transport under the job's store: a c10d ``Store`` held in memory, per process.

The protocol's processes use the production ``control.store.JobStore`` (MACs, sequences,
write-once keys, tamper accounting) over a ``SimClient``: one per process and store incarnation,
as each process has its own TCP client. What is simulated is only the wire and the server:

* ``SimServer`` is one incarnation of the coordinator's c10d store (a restarted coordinator
  serves a new, empty one). It holds raw bytes, as a ``TCPStore`` does; when it is ``up`` False
  every call fails (``DistStoreError``), except that a ``set`` may "return" and write nothing,
  as a client of a dead server sometimes does.
* Every write is entered in a ledger with its writer (a process's name, or ``ATTACKER``), so the
  simulator's invariants know who wrote what without trusting the MAC code under test.
* An attacker without the secret uses the server directly: ``forge`` (well-formed seals with a
  wrong MAC and a payload that would do harm if accepted), ``replay`` (an older raw value the key
  held), ``delete``.

No rule of the protocol is here: what a value means, whether it is valid, and what a reader does
about it are ``JobStore``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from liveshard.runtime.agent.kept_writes import KeptWrites

if TYPE_CHECKING:
    from liveshard.runtime.control.store import JobStore

ATTACKER = "attacker"
JOB = "job"
PREFIX = f"liveshard/{JOB}//"  # what ``JobStore``'s PrefixStore puts before each protocol key


def full(key: str) -> str:
    return PREFIX + key


def protocol_key(key: str) -> str | None:
    return key[len(PREFIX):] if key.startswith(PREFIX) else None


def seal_parts(raw: bytes) -> tuple[str, str] | None:
    """(flag, value) of a raw ``v2.<seq>.<flag>.<mac>.<value>`` (the writer is known: this is no
    check of the seal, only its layout, for the invariants)."""
    try:
        parts = raw.decode().split(".", 4)
    except UnicodeDecodeError:
        return None
    return (parts[2], parts[4]) if len(parts) == 5 else None


@dataclass(frozen=True)
class Write:
    time: float
    writer: str
    key: str  # the protocol key (no prefix)
    raw: bytes


def _b(v: str | bytes) -> bytes:
    return v if isinstance(v, bytes) else v.encode()


class SimServer:
    """One incarnation of the coordinator's store. ``on_write(write)`` is the simulator's hook
    for every write that lands (its invariants, and faults tied to a write)."""

    def __init__(self, epoch: int, clock: Callable[[], float],
                 on_write: Callable[[Write], None] = lambda w: None) -> None:
        self.epoch = epoch
        self.up = True
        self.data: dict[str, bytes] = {}
        # every raw a process wrote under each key, with its writer
        self.history: dict[str, list[tuple[str, bytes]]] = {}
        self.forged: set[bytes] = set()
        self.clock = clock
        self.on_write = on_write
        self.frozen_until = 0.0

    def _land(self, writer: str, key: str, raw: bytes) -> None:
        self.data[key] = raw
        pk = protocol_key(key)
        if writer != ATTACKER:
            self.history.setdefault(key, []).append((writer, raw))
        if pk is not None:
            self.on_write(Write(self.clock(), writer, pk, raw))

    @property
    def frozen(self) -> bool:
        """Its process is stopped (SIGSTOP): every call times out until it wakes."""
        return self.clock() < self.frozen_until

    def fail(self, key: str) -> None:
        if not self.up:
            raise dist.DistStoreError(f"the store of epoch {self.epoch} is gone ({key})")
        if self.frozen:
            raise dist.DistStoreError(f"the store of epoch {self.epoch} does not answer: its process is stopped ({key})")

    # ---- an attacker without the secret ------------------------------------------------------
    def forge(self, key: str, value: str) -> bytes | None:
        """A well-formed seal of ``value`` under a MAC made without the secret."""
        if not self.up:
            return None
        if self.frozen:
            return None
        raw = f"v2.{9 * 10**19 + len(self.forged)}.s.{'0' * 64}.{value}".encode()
        self.forged.add(raw)
        self._land(ATTACKER, full(key), raw)
        return raw

    def garbage(self, key: str) -> None:
        if self.up and not self.frozen:
            raw = b"\xff not a seal %d" % len(self.forged)
            self.forged.add(raw)
            self._land(ATTACKER, full(key), raw)

    def replay(self, key: str) -> bool:
        """Write back an older value the key held (validly sealed, out of date): the oldest one
        written by another process than the key's last writer where there is one (a previous
        incarnation's: the most harmful to take for new), else the oldest."""
        old = self.history.get(full(key))
        if not self.up or self.frozen or not old:
            return False
        last_writer = old[-1][0]
        raw = next((r for w, r in old if w != last_writer), old[0][1])
        if self.data.get(full(key)) == raw:
            return False
        self._land(ATTACKER, full(key), raw)
        return True

    def stale_keys(self, prefixes: tuple[str, ...]) -> list[str]:
        """Keys that hold values of more than one writer (a process and an earlier one)."""
        return [k for k in self.keys(prefixes) if len({w for w, _ in self.history.get(full(k), ())}) > 1]

    def delete(self, key: str) -> bool:
        return self.up and not self.frozen and self.data.pop(full(key), None) is not None

    def keys(self, prefixes: tuple[str, ...]) -> list[str]:
        return sorted(pk for k in self.data if (pk := protocol_key(k)) is not None and pk.startswith(prefixes))


class SimClient(dist.Store):
    """One process's client of ``server``: a c10d ``Store`` the production ``JobStore`` wraps.
    ``forged_read``: the forged raw values (key, raw) this client returned to its process (the
    tamper-accounting invariant: every one must be counted by the ``JobStore`` above)."""

    def __init__(self, server: SimServer, who: str) -> None:
        super().__init__()
        self.server = server
        self.who = who
        self.forged_read: set[tuple[str, bytes]] = set()

    def _seen(self, key: str, raw: bytes | None) -> bytes | None:
        if raw is not None and raw in self.server.forged:
            self.forged_read.add((key, raw))
        return raw

    def set(self, key: str, value: str | bytes) -> None:
        s = self.server
        if not s.up:
            return  # a c10d set to a dead server can return without error and write nothing
        s.fail(key)  # a stopped server: the call times out
        s._land(self.who, key, _b(value))

    def get(self, key: str) -> bytes:
        self.server.fail(key)
        raw = self.server.data.get(key)
        if raw is None:
            raise dist.DistStoreError(f"key {key} not found (a real client would wait)")
        return self._seen(key, raw) or b""

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        s = self.server
        s.fail(key)
        expected, desired = _b(expected), _b(desired)
        current = s.data.get(key)
        if current is None:
            if expected == b"":
                s._land(self.who, key, desired)
                return desired
            return expected  # c10d answers a compare-and-set on an absent key with the expected value
        if current == expected:
            s._land(self.who, key, desired)
            return desired
        return self._seen(key, current) or b""

    def add(self, key: str, amount: int) -> int:
        s = self.server
        s.fail(key)
        value = int(s.data.get(key, b"0")) + amount
        s.data[key] = str(value).encode()
        return value

    def check(self, keys: list[str]) -> bool:
        self.server.fail("check")
        return all(k in self.server.data for k in keys)

    def delete_key(self, key: str) -> bool:
        self.server.fail(key)
        return self.server.data.pop(key, None) is not None

    def num_keys(self) -> int:
        self.server.fail("num_keys")
        return len(self.server.data)


class Link:
    """A worker's store clients (``commit_driver.StoreLink``): ``epoch`` counts the clients made
    after the first, one per coordinator restart it reconnected to."""

    def __init__(self) -> None:
        self.epoch = -1
        self.kept = KeptWrites()  # the shipped kept writes; the world restores them at each poll
        self.registration_slot: int | None = None
        self.client: SimClient | None = None
        self._store: JobStore | None = None

    @property
    def store(self) -> JobStore:
        assert self._store is not None
        return self._store

    @property
    def server(self) -> SimServer | None:
        return self.client.server if self.client is not None else None
