"""The job's key-value store: a c10d ``TCPStore`` served by the coordinator, with typed, authenticated access.

The same store carries the protocol keys (``contract.keys.Keys``) and, under per-generation
prefixes, the rendezvous keys of every process group the job builds, so a new world never sees a
previous world's stale addresses. Values are JSON or plain text, never pickled.

**Threat.** The store's port is reachable by anything on the network the job's pods share, and a
c10d store has no access control: any client can list, overwrite and delete any key. So every
value that steers the job is sealed with the job's secret (``$LIVESHARD_JOB_SECRET``, a Secret
the operator creates per job; the local driver makes one per run) and a reader classifies what it
sees (``JobStore.read`` -> ``StoreRead``, ``Seen``):

- ``VALID``: a sealed value that passes every rule below; it becomes the key's *accepted* value.
- ``ABSENT``: nothing there (or a tombstone ``JobStore.delete`` wrote), and nothing valid was
  ever read from this key by this ``JobStore``.
- ``FORGED``: something is there but it is not sealed with the job's secret for this key, job and
  incarnation (old-format ``<mac>.<value>`` values included).
- ``REPLAYED``: validly sealed, but older than the value already accepted (rules below).
- ``DELETED``: absent after a valid value was read from this ``JobStore``. The protocol never
  deletes a key: a legitimate deletion is ``JobStore.delete``, a sealed tombstone.

For ``FORGED``, ``REPLAYED`` and ``DELETED`` the last accepted value stands: ``get`` returns it
(None only when nothing valid was ever read). Each such observation is tampering: counted per
distinct bad value (``tampering``, ``tampered_keys``; the coordinator exports it as
``liveshard_store_tampering_total``) and logged within bounds (below).

**Seal.** ``v2.<seq>.<flag>.<mac>.<value>``; the MAC (HMAC-SHA256) covers the job name, the job's
incarnation (``$LIVESHARD_JOB_INCARNATION``: the job object's uid, so a value from an earlier job
of the same name does not verify), the key, ``seq``, ``flag`` and the value, so a value cannot be
moved to another key, job or incarnation, nor altered. ``flag`` is ``s`` (a value), ``r`` (a
value that legitimately goes back in its own order, ``JobStore.rewind``) or ``d`` (a tombstone).

**Sequence rule** (what makes a replay detectable). ``seq`` is a hybrid logical clock per key: a
writer reads the key first and writes ``seq = max(time_ns(), highest valid seq it has seen for
the key + 1)``. A reader accepts a valid value only if its ``seq`` is higher than the accepted
one's (the same bytes again are simply ``VALID``); a lower or equal ``seq`` is ``REPLAYED``.
Because the writer reads before it writes, a writer whose clock is behind (a restarted worker on
another node, a new rank 0) still writes a higher ``seq`` than every value it could see, so its
write is accepted: clock skew costs nothing but a ``seq`` that runs ahead of wall time. What it
cannot order is two writers racing on one key (both read ``seq`` S, both write): a reader that
saw the later clock first refuses the other as ``REPLAYED`` and counts it. Protocol keys have one
writer at a time (the write-once keys below go through ``decide``), except ``hb/<id>`` for the
seconds after a reconnection, when a worker and its pulse both write it (``agent.connection.beat``):
there a reader keeps the later of two racing beats and may count one replay.

**Value order.** Where a value carries its own order a lower one is ``REPLAYED`` even with a higher
``seq``: ``checkpoint/latest`` by its ``step``, ``plan/latest`` by its generation. A writer that
legitimately goes back (a restore from an older checkpoint) writes with ``JobStore.rewind``.

**Write-once keys** (``gen/<N>/decision``, ``gen/<N>/outcome``, ``gen/<N>/result/<id>``,
``plan/<N>``): the first value this ``JobStore`` accepts is final; a different valid value later is
``REPLAYED`` and the reader puts its accepted bytes back (compare-and-set against what it found,
so it never overwrites anything else) for readers that come after it. ``decide`` is the commit
point's compare-and-set: the first *valid* writer wins even if forged values were planted first.

**Counters.** ``store.add`` values cannot be sealed. Registration and plan requests therefore do
not use them: ``append`` claims the first slot of an indexed list that holds no valid entry (an
absent one, or one an attacker planted) with a compare-and-set, and ``entries`` reads slots up
to ``LIST_GAP`` in a row without a valid entry: however many slots are planted, a reader reads a
few past the last entry and a writer passes over valid entries only. ``gen/<N>/arrived`` is
still a counter (see ``contract.keys``).

**Bounded tampering report.** Each bad value is counted; the first ``LOGGED_KEYS`` keys found
tampered with are logged one line each, and after that one summary line at most every
``SUMMARY_EVERY`` seconds ("store: 1,204 forged values on 3 keys in the last 10 s"), whatever
an attacker plants.

**Heartbeat keys** (``hb/<id>``): a reader that finds one tampered with puts the last valid beat
back (compare-and-set against exactly what it found; a sealed tombstone where it never read one),
so one bad value left behind reads as silence at the next read, and only an attacker writing the
key again and again shows as tampering at every read (``coordinator.membership`` then judges the
member by its peers, never by its silence alone).

**Limits.** An attacker can still delete or overwrite everything: a reader that never read a key
before sees it absent, and a key it keeps overwriting (``hb/<id>``) shows the reader only the last
valid value, which ages. A copy of a key's last valid bytes written back over every newer value
faster than the reader reads is, to the reader, the silence of the key's writer. The rendezvous
keys under ``prefixed`` are c10d's own and not sealed (``docs/architecture.md``, threat model).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import Any

import torch.distributed as dist

from liveshard.runtime.contract.env import Env
from liveshard.runtime.contract.keys import INCARNATION_ENV, SECRET_ENV, Keys
from liveshard.runtime.control.barrier import Backoff, wait_until
from liveshard.runtime.control.protocol import WorldPlan
from liveshard.runtime.errors import ConfigError

EVERY_INTERFACE = ("", "0.0.0.0", "::")


def serve_store(host: str, port: int, timeout: float = 30.0) -> dist.TCPStore:
    """Start the store server (the coordinator's) on ``host``; ``port=0`` picks a free port. A
    port that cannot be listened on is the caller's ``--port`` (``ConfigError``, one line).

    c10d's TCPStore server listens on every interface whatever host it is given; for an address
    of its own (``--host 127.0.0.1``, ``$LIVESHARD_BIND``) the socket is bound here and handed to
    it (``master_listen_fd``), so the store listens there only."""
    listen_fd = None if host in EVERY_INTERFACE else _listen(host, port)
    if listen_fd is not None:
        port = listen_fd[1]
    try:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout),
                             master_listen_fd=listen_fd[0] if listen_fd is not None else None)
    except dist.DistNetworkError as e:
        if listen_fd is not None:
            with contextlib.suppress(OSError):
                os.close(listen_fd[0])
        why = "address already in use" if "EADDRINUSE" in str(e) else str(e).splitlines()[0]
        raise ConfigError("--port", f"cannot listen on {host}:{port}: {why}",
                          "choose a free port, or 0 for any") from None


def _listen(host: str, port: int) -> tuple[int, int]:
    """A socket listening on ``host:port`` (its file descriptor, handed over, and its port)."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ConfigError("--host", f"cannot listen on {host}: {e.strerror or e}",
                          "give an address of this machine, or 0.0.0.0 for every interface") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as c10d's own server does
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError("--port", f"cannot listen on {host}:{port}: address already in use",
                              "choose a free port, or 0 for any") from None
        raise ConfigError("--host", f"cannot listen on {host}:{port}: {e.strerror or e}",
                          "give an address of this machine, or 0.0.0.0 for every interface") from None
    bound = int(sock.getsockname()[1])
    return sock.detach(), bound  # the store owns the descriptor from here


def connect_store(host: str, port: int, timeout: float = 30.0) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout))


log = logging.getLogger("liveshard.store")


def job_secret() -> bytes | None:
    """The job's secret from the environment. In a pod the operator built (``LIVESHARD_ROLE``
    set) it is required: a ``ConfigError`` rather than a job anyone on the network can steer."""
    value = os.environ.get(SECRET_ENV, "")
    if not value and os.environ.get(Env.ROLE):
        raise ConfigError(SECRET_ENV, "not set: the job's store would accept values from anyone",
                          "run the pod as the operator builds it (the job's Secret is mounted as this variable)")
    return value.encode() if value else None


class Seen(StrEnum):
    """What a read found under a key (see the module docstring)."""

    VALID = "valid"
    ABSENT = "absent"
    FORGED = "forged"
    REPLAYED = "replayed"
    DELETED = "deleted"


TAMPERING = (Seen.FORGED, Seen.REPLAYED, Seen.DELETED)


@dataclass(frozen=True)
class StoreRead:
    """One read: ``value`` is the last valid value this ``JobStore`` accepted for the key (None if
    none, or a tombstone); ``seen`` is what the key held at the moment of the read."""

    value: str | None
    seen: Seen

    @property
    def tampered(self) -> bool:
        return self.seen in TAMPERING


_WRITE_ONCE = re.compile(r"(gen/\d+/(decision|outcome|result/.+)|plan/\d+)")
_HEARTBEAT = re.compile(r"hb/[^/]+")  # tampered with: a reader puts the last valid beat back (``_clear``)
# Reads go through compare_set(key, _PROBE, _PROBE): one round trip that never waits (c10d's get
# waits for an absent key, and a key deleted between check() and get() would block a reader for
# the store's whole timeout). An absent key answers _PROBE itself; _PROBE is no valid seal.
_PROBE = b"\0liveshard-probe"
_SEQ = re.compile(r"[0-9]{1,30}")
_VERSION = "v2"
_FLAGS = ("s", "r", "d")  # a value, a value going back in its own order (rewind), a tombstone
LIST_GAP = 4  # slots in a row without a valid entry that end an indexed list (``entries``)
DECIDE_ATTEMPTS = 32  # compare-and-set tries against planted values before decide gives up
LOGGED_KEYS = 20  # (key, kind) pairs of tampering logged one line each; then summaries only
KEPT_KEYS = 1000  # keys ``tampered_keys`` names at most
SUMMARY_EVERY = 10.0  # seconds between two summary lines of tampering


def write_once(key: str) -> bool:
    """Whether the protocol writes ``key`` once (its first accepted value is final)."""
    return _WRITE_ONCE.fullmatch(key) is not None


def value_order(key: str, value: str) -> int | None:
    """The order a value of ``key`` carries itself (a checkpoint's step, the latest generation)."""
    try:
        if key == Keys.CHECKPOINT:
            step = json.loads(value).get("step")
            return None if step is None else int(step)
        if key in (Keys.LATEST, Keys.CURRENT):
            return int(value)
    except (ValueError, TypeError, AttributeError):
        return None
    return None


@dataclass(frozen=True)
class _Accepted:
    seq: int
    value: str | None  # None: a tombstone
    raw: bytes  # the sealed bytes, to put back over a tampered write-once key
    order: int | None


class JobStore:
    """Typed access to the protocol keys of one job; values authenticated with ``secret``
    (None: unauthenticated and unchecked, for in-process tests only). ``incarnation``: the job's
    incarnation bound into every MAC (None: ``$LIVESHARD_JOB_INCARNATION``, empty if unset).
    ``clock``: wall time in ns for the sequence (injected by tests of clock skew).

    What this ``JobStore`` accepted per key is remembered for its lifetime: a client that
    reconnects with a new ``JobStore`` starts with no memory (and so cannot tell a deletion from
    a key never written)."""

    def __init__(self, store: dist.Store, job: str = "job", secret: bytes | None = None,
                 incarnation: str | None = None, clock: Callable[[], int] = time.time_ns) -> None:
        self.raw = store
        self.store = dist.PrefixStore(f"liveshard/{job}/", store)
        self.job = job
        self.incarnation = os.environ.get(INCARNATION_ENV, "") if incarnation is None else incarnation
        self._secret = secret
        self._clock = clock
        self._lock = threading.Lock()
        self._accepted: dict[str, _Accepted] = {}
        self._last_bad: dict[str, tuple[Seen, bytes | None]] = {}  # to count each bad value once
        self._logged: set[tuple[str, Seen]] = set()
        self._tampered: dict[str, set[Seen]] = {}
        self._slot_hint: dict[str, int] = {}
        self.tampering: Counter[Seen] = Counter()
        self._window: Counter[Seen] = Counter()  # bad values since the last summary (``_summarize``)
        self._window_keys: set[str] = set()
        self._window_start: float | None = None

    # ---- sealing ----------------------------------------------------------------------------
    def _mac(self, key: str, seq: int, flag: str, value: str) -> str:
        assert self._secret is not None
        # Length-prefixed fields: no field's content can shift a boundary between two others.
        parts = ("liveshard-store-v2", self.job, self.incarnation, key, str(seq), flag, value)
        message = b"".join(b"%d:%s" % (len(p.encode()), p.encode()) for p in parts)
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def _next_seq(self, key: str) -> int:
        accepted = self._accepted.get(key)
        return max(self._clock(), accepted.seq + 1 if accepted else 0)

    def _seal(self, key: str, value: str, flag: str = "s") -> tuple[int, bytes]:
        seq = self._next_seq(key)
        return seq, f"{_VERSION}.{seq}.{flag}.{self._mac(key, seq, flag, value)}.{value}".encode()

    def _unseal(self, key: str, raw: bytes) -> tuple[int, str, str] | None:
        """(seq, flag, value) of a valid seal, else None (whatever the bytes: they may be anyone's)."""
        try:
            parts = raw.decode().split(".", 4)
        except UnicodeDecodeError:
            return None
        if len(parts) != 5 or parts[0] != _VERSION or parts[2] not in _FLAGS or not _SEQ.fullmatch(parts[1]):
            return None
        _, seq_text, flag, mac, value = parts
        seq = int(seq_text)
        if not hmac.compare_digest(mac.encode(), self._mac(key, seq, flag, value).encode()):
            return None
        return seq, flag, value

    # ---- reading ----------------------------------------------------------------------------
    def _cas(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """c10d's compare-and-set on raw bytes (it takes bytes as well as str; torch's stub says str)."""
        return self.store.compare_set(key, expected, desired)  # type: ignore[arg-type]

    def _probe(self, key: str) -> bytes | None:
        raw = self._cas(key, _PROBE, _PROBE)
        return None if raw == _PROBE else raw

    def read(self, key: str) -> StoreRead:
        """What ``key`` holds now, judged (never blocks); see ``Seen``."""
        raw = self._probe(key)
        if self._secret is None:
            return StoreRead(None, Seen.ABSENT) if raw is None else StoreRead(raw.decode(), Seen.VALID)
        return self._judge(key, raw)

    def _judge(self, key: str, raw: bytes | None) -> StoreRead:
        repair: tuple[bytes, bytes] | None = None
        with self._lock:
            accepted = self._accepted.get(key)
            last = accepted.value if accepted else None
            if raw is None:
                seen = Seen.DELETED if last is not None else Seen.ABSENT
            elif accepted is not None and raw == accepted.raw:
                seen = Seen.VALID
            else:
                opened = self._unseal(key, raw)
                if opened is None:
                    seen = Seen.FORGED
                else:
                    seq, flag, text = opened
                    value = None if flag == "d" else text
                    order = None if value is None else value_order(key, value)
                    if accepted is not None and (
                            seq <= accepted.seq
                            or (write_once(key) and accepted.value is not None and value != accepted.value)
                            or (flag != "r" and order is not None and accepted.order is not None
                                and order < accepted.order)):
                        seen = Seen.REPLAYED
                    else:
                        self._accepted[key] = _Accepted(seq, value, raw, order)
                        last, seen = value, (Seen.VALID if value is not None else Seen.ABSENT)
            if seen in TAMPERING:
                self._tampering(key, seen, raw)
                if accepted is not None and accepted.value is not None and write_once(key):
                    repair = (raw or b"", accepted.raw)
                elif _HEARTBEAT.fullmatch(key):
                    repair = self._clear(key, raw, accepted)
            else:
                self._last_bad.pop(key, None)
        if repair is not None:
            # Put the final value back for readers that come after this one: compare-and-set
            # against exactly the bytes judged here, so nothing written since is overwritten.
            landed = self._cas(key, *repair) == repair[1]
            if landed and repair[1] != (accepted.raw if accepted else None):  # a tombstone of ``_clear``
                opened = self._unseal(key, repair[1])
                if opened is not None:
                    with self._lock:
                        self._accepted[key] = _Accepted(opened[0], None, repair[1], None)
        return StoreRead(last, seen)

    def _clear(self, key: str, raw: bytes | None, accepted: _Accepted | None) -> tuple[bytes, bytes] | None:
        """The repair of a tampered heartbeat key (under the lock): the last valid value back (a
        sealed tombstone where there was none), so that tampering shows at a later read only if
        it is done again. One bad value left behind then reads as the silence it is, while an
        attacker overwriting the key all along shows as tampering at every read
        (``coordinator.membership``: contested members are not judged by silence alone)."""
        if accepted is not None:
            return raw or b"", accepted.raw
        if raw is None:
            return None
        return raw, self._seal(key, "", "d")[1]  # accepted once it lands (``_judge``)

    def _tampering(self, key: str, seen: Seen, raw: bytes | None) -> None:
        if self._last_bad.get(key) != (seen, raw):  # a new bad value, not the same one read again
            self._last_bad[key] = (seen, raw)
            self.tampering[seen] += 1
            if key in self._tampered or len(self._tampered) < KEPT_KEYS:
                self._tampered.setdefault(key, set()).add(seen)
            if not self._window:
                self._window_start = time.monotonic()  # a summary covers from its first bad value
            self._window[seen] += 1
            self._window_keys.add(key)
        if (key, seen) not in self._logged and len(self._logged) < LOGGED_KEYS:
            self._logged.add((key, seen))
            log.warning("store key %s is tampered with (%s): %s", key, seen.value,
                        "the last valid value stands" if key in self._accepted else "ignored")
        self._summarize()

    def _summarize(self, force: bool = False) -> None:
        """Log what was found since the last summary, at most every ``SUMMARY_EVERY`` seconds."""
        now = time.monotonic()
        start = now if self._window_start is None else self._window_start
        if not self._window or (not force and now - start < SUMMARY_EVERY):
            return
        counts = ", ".join(f"{n:,} {kind.value}" for kind, n in sorted(self._window.items()))
        log.warning("store: %s values on %s keys in the last %.0f s (the last valid values stand)",
                    counts, f"{len(self._window_keys):,}", now - start)
        self._window.clear()
        self._window_keys.clear()
        self._window_start = now

    def log_tampering(self) -> None:
        """Log the summary of tampering found since the last one if it is due (a reader calls it
        now and then: the summary does not wait for the next bad value)."""
        with self._lock:
            self._summarize()

    def tampered_keys(self) -> dict[str, frozenset[Seen]]:
        """Every key this ``JobStore`` saw tampered with, and how."""
        with self._lock:
            return {k: frozenset(v) for k, v in sorted(self._tampered.items())}

    def prefixed(self, prefix: str) -> dist.Store:
        return dist.PrefixStore(prefix, self.store)

    # ---- primitives -------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        """Whether ``key`` has an authentic value (now, or the last one read, if tampered with since)."""
        return self.get(key) is not None

    def get(self, key: str) -> str | None:
        """The last valid value of ``key`` (None if none was ever read); never blocks."""
        return self.read(key).value

    def _write(self, key: str, value: str, flag: str) -> None:
        if self._secret is None:
            self.store.set(key, value)
            return
        # Learn the newest valid seq first (the sequence rule, module docstring). A store that is
        # gone fails this read: the set below then behaves as a set always did there (c10d's set
        # to a dead server can even return without error), which callers handle, not this read.
        with contextlib.suppress(dist.DistError):
            self.read(key)
        seq, sealed = self._seal(key, value, flag)
        self.store.set(key, sealed)  # type: ignore[arg-type]  # c10d takes bytes; the stub says str
        with self._lock:
            stored = None if flag == "d" else value
            self._accepted[key] = _Accepted(seq, stored, sealed, None if stored is None else value_order(key, value))
            self._last_bad.pop(key, None)

    def set(self, key: str, value: str) -> None:
        self._write(key, value, "s")

    def rewind(self, key: str, value: str) -> None:
        """Write a value that is lower in its own order than the one before it (``checkpoint/latest``
        after a restore from an older checkpoint): readers accept it instead of calling it a replay."""
        self._write(key, value, "r")

    def delete(self, key: str) -> None:
        """Delete ``key`` as the protocol: a sealed tombstone (readers see ``ABSENT``, not ``DELETED``)."""
        if self._secret is None:
            self.store.delete_key(key)
        else:
            self._write(key, "", "d")

    def decide(self, key: str, value: str) -> str | None:
        """The commit point: write ``value`` unless ``key`` holds a valid value already; returns the
        value that stands (the first valid writer's: this one's or an earlier one's).

        Atomic in the store (compare-and-set), and a planted value cannot pre-empt it: a forged or
        replayed value, or a tombstone, is replaced by compare-and-set against exactly those bytes
        (tampering, counted), up to ``DECIDE_ATTEMPTS`` times. A valid value there is the decision;
        if this ``JobStore`` already accepted one, that one stands whatever the key holds now.
        None: only if an attacker kept replacing the key for all the attempts."""
        if self._secret is None:
            return self.store.compare_set(key, "", value).decode()
        accepted = self._accepted.get(key)
        if accepted is not None and accepted.value is not None:
            self.read(key)  # puts it back if it was tampered with since (write-once keys)
            return accepted.value
        seq, sealed = self._seal(key, value)
        expected = b""
        for _ in range(DECIDE_ATTEMPTS):
            current = self._cas(key, expected, sealed)
            if current == sealed:
                with self._lock:
                    self._accepted[key] = _Accepted(seq, value, sealed, value_order(key, value))
                    self._last_bad.pop(key, None)
                return value
            if expected and current == expected:
                # c10d answers a compare-and-set on an absent key with the expected value: the
                # planted value was deleted meanwhile; try the absent key again.
                expected = b""
                continue
            read = self._judge(key, current)
            if read.value is not None:
                return read.value  # a valid decision (or the one this store accepted before)
            expected = current
        log.warning("store key %s: no decision after %d tries against planted values", key, DECIDE_ATTEMPTS)
        return self.read(key).value

    def set_json(self, key: str, value: Any) -> None:
        self.set(key, json.dumps(value, sort_keys=True))

    def get_json(self, key: str) -> Any:
        text = self.get(key)
        return None if text is None else json.loads(text)

    def wait_for(self, key: str, timeout: float, poll: float = 0.01) -> str | None:
        """Poll every ``poll`` seconds until ``key`` has a valid value (None after ``timeout``
        seconds); a store that fails raises."""
        return wait_until(lambda: self.get(key), timeout=timeout, poll=Backoff.fixed(poll)).value

    # ---- indexed lists (instead of counters) --------------------------------------------------
    def append(self, slot: Callable[[int], str], value: str, lowest: bool = False) -> int:
        """Add ``value`` to the list ``slot(0), slot(1), ...`` in the first slot that holds no
        valid entry, claimed with a compare-and-set against exactly what it holds (nothing, or a
        forged value: a planted slot is nobody's entry, and taking it keeps the list dense, so
        readers stop at the first few slots without a valid entry; ``entries``). Value and claim
        are one write: no slot is ever claimed but empty. The search starts after this store's
        last entry, or at 0 with ``lowest`` (filling a slot an attacker emptied). Work: one
        round trip per valid entry passed over, plus at most ``DECIDE_ATTEMPTS`` per slot an
        attacker keeps rewriting. Returns the index."""
        i = 0 if lowest else self._slot_hint.get(slot(0), 0)
        while True:
            key = slot(i)
            if self._secret is None:
                if self.store.compare_set(key, "", value).decode() == value:
                    break
                i += 1
                continue
            seq, sealed = self._seal(key, value)
            expected, claimed = b"", False
            for _ in range(DECIDE_ATTEMPTS):
                held = self._cas(key, expected, sealed)
                if held == sealed:
                    claimed = True
                    break
                if expected and held == expected:
                    expected = b""  # the planted value was deleted meanwhile
                    continue
                if self._judge(key, held).value is not None:
                    break  # another's entry: passed over
                expected = held  # forged (counted by the judge): take the slot over
            if claimed:
                with self._lock:
                    self._accepted[key] = _Accepted(seq, value, sealed, None)
                    self._last_bad.pop(key, None)
                break
            i += 1
        self._slot_hint[slot(0)] = i + 1
        return i

    def entries(self, slot: Callable[[int], str], start: int = 0) -> list[tuple[int, str]]:
        """(index, value) of the valid entries of the list ``slot(start), slot(start+1), ...``,
        up to ``LIST_GAP`` slots in a row without a valid entry (absent or forged): bounded work
        whatever was planted (writers take planted slots over, ``append``, so the list stays
        dense). A deleted entry keeps the value this store read before, or reads as absent to a
        store that never read it: the gap lets a reader see past a few of those, and their
        writers fill them again (``registration_intact``, ``append(lowest=True)``)."""
        out: list[tuple[int, str]] = []
        i, missing = start, 0
        while missing < LIST_GAP:
            read = self.read(slot(i))
            missing = missing + 1 if read.value is None else 0
            if read.value is not None:
                out.append((i, read.value))
            i += 1
        return out

    # ---- membership -------------------------------------------------------------------------
    def register_member(self, worker: str, info: dict[str, Any], again: bool = False) -> int:
        """Announce ``worker`` (``members/<id>``, and its id in the list of registrations);
        returns its slot in that list (``registration_intact``). ``again``: its registration was
        deleted; it takes the lowest free slot (refilling the list's holes)."""
        self.set_json(Keys.member(worker), info)
        return self.append(Keys.member_index, worker, lowest=again)

    def registration_intact(self, worker: str, slot: int) -> bool:
        """Whether ``worker``'s registration (written by this ``JobStore`` in ``slot``) is still
        there and authentic. A client without the secret can delete it before the coordinator
        read it (a coordinator that never read a key sees its deletion as absence): the worker
        then registers again."""
        for key, value in ((Keys.member(worker), None), (Keys.member_index(slot), worker)):
            r = self.read(key)
            if r.tampered or r.value is None or (value is not None and r.value != value):
                return False
        return True

    def members(self) -> list[str]:
        """Registered workers, in registration order (a worker that registered twice, twice)."""
        return [name for _, name in self.entries(Keys.member_index)]

    # ---- plans ------------------------------------------------------------------------------
    def publish_plan(self, plan: WorldPlan) -> None:
        self.set(Keys.plan(plan.generation), plan.to_json())
        self.set(Keys.LATEST, str(plan.generation))

    def latest_generation(self) -> int:
        value = self.get(Keys.LATEST)
        return -1 if value is None else int(value)

    def plan(self, gen: int) -> WorldPlan | None:
        text = self.get(Keys.plan(gen))
        return None if text is None else WorldPlan.from_json(text)

    # ---- checkpoints ----------------------------------------------------------------------------
    def publish_checkpoint(self, record: dict[str, Any]) -> None:
        """Publish ``record`` (path, step, ...) as ``checkpoint/latest``. Its writer (rank 0, right
        after the save) knows it is the newest of the job's timeline: if the record there has a
        higher step, the job went back to an older checkpoint since, and this one is a ``rewind``."""
        before = value_order(Keys.CHECKPOINT, self.get(Keys.CHECKPOINT) or "{}")
        text = json.dumps(record, sort_keys=True)
        if before is not None and before > int(record["step"]):
            self.rewind(Keys.CHECKPOINT, text)
        else:
            self.set(Keys.CHECKPOINT, text)

    # ---- tampering report ---------------------------------------------------------------------
    def tampering_counts(self) -> Mapping[str, int]:
        """Tampering seen so far by kind (every kind present): what ``JobMetrics`` exports."""
        with self._lock:
            return {kind.value: self.tampering[kind] for kind in TAMPERING}
