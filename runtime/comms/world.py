"""Process groups of a worker: the training world of a generation, and transition groups.

The training world is torch.distributed's default group (megatron's parallel groups are made on
it). Its communicators can be built ahead, while the previous world still trains
(``build_world_ahead``, from the list of groups megatron will ask for): making the world at the
commit then hands each group its communicator through a registered torch.distributed backend
(``AHEAD``), with no rendezvous and no connection set up in the pause. A transition group spans the old and the new members, joiners included, who are not in the
current default group; it is therefore a standalone ``ProcessGroup`` object built from the
job's store under a per-generation prefix, in a background thread while training goes on, and
used through its own methods (``send``/``recv``/``alltoall_base``/``allreduce``). Every group has
its own store prefix, so no world ever reads a previous world's addresses.

A world that lost a member is **cut off** (``cut_off``): the control thread aborts its
communicators, so that no thread stays blocked in one of its collectives. NCCL aborts its
communicators (``ProcessGroup.abort``); gloo has no abort for a collective in flight (its
``abort`` and ``shutdown`` return and the waiting thread stays blocked until the group's timeout;
a survivor blocked on another survivor, whose own collective already failed, is never released
by the dead peer's closed sockets), so the TCP connections the world's groups opened are shut
down instead (``shutdown(2)``): every pending receive on them fails at once. Which connections
are the world's is recorded while its groups connect (``noting_connections``): those that
appeared meanwhile, less any to the job's store.

Backend-specific lines are here and only here (and in ``comms.groups``, megatron's groups made by
their members): gloo on CPU, NCCL when CUDA is present.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("liveshard.worker")

# Communicators this process connected, by kind (each one a rendezvous with its peers):
# "transition" (a transition group), "ahead" (the next world's, during prepare), "world" (a
# default group made at the commit), "shrink" (the survivors' default group on gloo, see
# ``World.shrink``), "group" (a megatron group made at the commit). A switch
# records what it connected while preparing and inside its pause.
CONNECTED: Counter[str] = Counter()


def connected_since(before: Counter[str]) -> dict[str, int]:
    """Communicators connected since ``before`` (a copy of ``CONNECTED``), by kind."""
    return {k: n for k, n in (CONNECTED - before).items() if n}


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_training_world(store: dist.Store, prefix: str, rank: int, size: int, timeout: float,
                        ahead: WorldAhead | None = None, name: str | None = None) -> None:
    """Make the default process group for one generation's training world (from its
    communicator built ahead, if ``ahead`` has one). ``name``: what ``cut_off`` knows the world
    by (its store prefix unless given)."""
    td = timedelta(seconds=timeout)
    _live.begin(name or prefix)
    if ahead is not None and ahead.default is not None:
        _register_ahead_backends()
        _live.add(ahead.connections)
        with handing_over(ahead.default):
            dist.init_process_group(AHEAD, store=dist.PrefixStore(prefix, store), rank=rank, world_size=size,
                                    timeout=td)
        ahead.default = None  # torch.distributed holds it now
        return
    CONNECTED["world"] += 1
    kwargs: dict[str, Any] = {}
    if torch.cuda.is_available():
        kwargs["device_id"] = device()  # eager NCCL init: pay it here, not in the first step
    with noting_world_connections(store):
        dist.init_process_group(backend(), store=dist.PrefixStore(prefix, store), rank=rank, world_size=size,
                                timeout=td, **kwargs)


def destroy_training_world(defer_free: bool = False) -> None:
    """Shut the default group down (``defer_free``: its object is freed by ``release.later``,
    off a switch's pause, as ``megatron.build.destroy`` does with megatron's groups)."""
    _live.begin(None)  # nothing is cut off from here on: its connections may be closed and reused
    if dist.is_initialized():
        from liveshard.runtime.comms import release

        default = dist.group.WORLD
        dist.destroy_process_group()
        if defer_free:
            release.later(default)


def build_transition_group(store: dist.Store, prefix: str, rank: int, size: int, timeout: float) -> Any:
    """A standalone group over old and new members (blocks until all of them have joined)."""
    CONNECTED["transition"] += 1
    return _connected(dist.PrefixStore(prefix, store), rank, size, timeout, gloo=False)


def _connected(store: dist.Store, rank: int, size: int, timeout: float, gloo: bool) -> Any:
    """A standalone communicator over ``store``, connected (blocks until every member has
    joined): NCCL on a GPU unless ``gloo``, else gloo."""
    if torch.cuda.is_available() and not gloo:
        opts = dist.ProcessGroupNCCL.Options()
        pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        flag = torch.ones(1, device=device())
        pg.allreduce([flag]).wait()  # NCCL creates its communicator lazily: force it now
        return pg
    pg = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout))
    flag = torch.ones(1)
    pg.allreduce([flag]).wait()
    return pg


# ---- the next training world's communicators, built ahead -----------------------------------
# The torch.distributed backend name under which communicators built ahead are handed over.
AHEAD = "liveshard_ahead"


@dataclass(frozen=True)
class GroupRequest:
    """One process group megatron asks for while it sets up its parallel state, in its order:
    every rank of the world asks for every group, members or not."""

    desc: str  # megatron's group description, e.g. TENSOR_MODEL_PARALLEL_GROUP
    ranks: tuple[int, ...]
    gloo: bool  # asked for with backend="gloo" (CPU-side groups); else the world's backend
    timeout: float | None = None  # seconds megatron asks its collectives to wait (None: torch's default)

    @classmethod
    def asked(cls, ranks: Any, backend: Any, kwargs: dict[str, Any]) -> GroupRequest:
        """The request a ``torch.distributed.new_group(ranks, backend=..., **kwargs)`` call makes."""
        timeout = kwargs.get("timeout")
        return cls(str(kwargs.get("group_desc") or ""), tuple(ranks or ()), backend == "gloo",
                   timeout.total_seconds() if isinstance(timeout, timedelta) else timeout)


@dataclass
class WorldAhead:
    """The communicators of one rank of a training world, built before the world is made."""

    rank: int
    size: int
    default: Any = None  # the default group's communicator (until it is handed over)
    groups: dict[GroupRequest, Any] = field(default_factory=dict)  # this rank's megatron groups, until handed over
    seconds: float = 0.0  # building them took (while the previous world trained)
    handed: int = 0  # how many were handed over when the world was made
    missed: list[GroupRequest] = field(default_factory=list)  # asked for, not built ahead: made then
    # the TCP connections its gloo groups opened (``noting_connections``): the world's once handed over
    connections: set[tuple[int, int]] = field(default_factory=set)

    def take(self, request: GroupRequest) -> Any:
        """The communicator built for ``request`` (None: not built ahead), at most once."""
        pg = self.groups.pop(request, None)
        if pg is None:
            self.missed.append(request)
        else:
            self.handed += 1
        return pg


class Cancelled(RuntimeError):
    """Connecting a world ahead was called off (its generation was decided meanwhile)."""


def build_world_ahead(store: dist.Store, prefix: str, rank: int, size: int, requests: Sequence[GroupRequest],
                      timeout: float, stop: threading.Event | None = None) -> WorldAhead:
    """Connect this rank's communicators of a world: the default group and every group of
    ``requests`` it is a member of, each with the timeout megatron asks for (``timeout`` for the
    default group and where it names none). Every rank walks ``requests`` in the same order, so
    the members of each group meet there in the same sequence (no rank waits on a group whose
    other members are still blocked in an earlier one); each group has its own store prefix.
    ``store`` should be a client no other thread uses: a connection waiting for a missing peer
    blocks every other request on it. Raises ``Cancelled`` between groups once ``stop`` is set."""
    start = time.perf_counter()
    ahead = WorldAhead(rank, size)
    with noting_connections(ahead.connections, store):
        ahead.default = _connected(dist.PrefixStore(f"{prefix}default/", store), rank, size, timeout, gloo=False)
        CONNECTED["ahead"] += 1
        CREATED["ahead"] += 1
        for i, req in enumerate(requests):
            if stop is not None and stop.is_set():
                raise Cancelled(f"connecting the world ahead was called off at group {i} of {len(requests)}")
            if rank in req.ranks:
                # a group's ranks are numbered in the order of their world ranks (as new_group does)
                ahead.groups[req] = _connected(dist.PrefixStore(f"{prefix}{i}/", store),
                                               sorted(req.ranks).index(rank), len(req.ranks),
                                               req.timeout or timeout, gloo=req.gloo)
                CONNECTED["ahead"] += 1
                CREATED["ahead"] += 1
    ahead.seconds = time.perf_counter() - start
    return ahead


_handing = threading.local()


class handing_over:
    """While active, the next process group torch.distributed creates with the ``AHEAD``
    backend (in this thread) gets ``communicator``."""

    def __init__(self, communicator: Any) -> None:
        self.communicator = communicator

    def __enter__(self) -> None:
        _handing.communicator = self.communicator

    def __exit__(self, *exc: Any) -> None:
        _handing.communicator = None


def _hand_over(gloo: bool) -> Callable[..., Any]:
    """The ``AHEAD`` backend's constructor: the communicator being handed over; for a group
    made later without one (a library's own ``new_group`` on this world), a new communicator
    connected as torch.distributed's own backend would."""

    def create(store: Any, rank: int, size: int, timeout: Any) -> Any:
        pg = getattr(_handing, "communicator", None)
        _handing.communicator = None
        if pg is None:
            if gloo or not torch.cuda.is_available():
                return dist.ProcessGroupGloo(store, rank, size, timeout)
            return dist.ProcessGroupNCCL(store, rank, size, dist.ProcessGroupNCCL.Options())
        if pg.rank() != rank or pg.size() != size:
            raise RuntimeError(f"communicator built ahead is rank {pg.rank()} of {pg.size()}, "
                               f"asked for rank {rank} of {size}")
        return pg

    return create


_registered: list[str] = []


def _register_ahead_backends() -> None:
    """Register ``AHEAD`` once per process, for the device the world's communicators serve."""
    if not _registered:
        devices = ["cuda"] if torch.cuda.is_available() else ["cpu"]
        dist.Backend.register_backend(AHEAD, _hand_over(gloo=False), devices=devices)
        if torch.cuda.is_available():
            dist.Backend.register_backend(AHEAD_GLOO, _hand_over(gloo=True), devices=["cpu"])
        _registered.append(AHEAD)


# CPU-side groups (megatron's backend="gloo" ones) beside an NCCL world.
AHEAD_GLOO = "liveshard_ahead_gloo"


def ahead_backend(request: GroupRequest) -> str:
    """The backend name a group built ahead is created under."""
    return AHEAD_GLOO if request.gloo and torch.cuda.is_available() else AHEAD


def run_heartbeating(work: Callable[[threading.Event], Any], beat: Callable[[], None],
                     cancelled: Callable[[], str | None], poll: float = 0.25) -> Any:
    """Run ``work(stop)`` in a thread and wait for it, calling ``beat`` meanwhile (a worker
    connecting to slow peers must not look dead); raises ``Cancelled`` if ``cancelled`` says why
    to stop waiting, after setting ``stop`` (the thread ends at its next check, or on its own
    timeout when it waits for a peer that is gone)."""
    box: dict[str, Any] = {}
    stop = threading.Event()

    def run() -> None:
        try:
            box["value"] = work(stop)
        except BaseException as e:  # handed to the waiting thread
            box["error"] = e

    thread = threading.Thread(target=run, name="liveshard-connect", daemon=True)
    thread.start()
    while True:
        thread.join(poll)
        if not thread.is_alive():
            break
        reason = cancelled()
        if reason:
            stop.set()
            raise Cancelled(reason)
        beat()
    if "error" in box:
        raise box["error"]
    return box["value"]


def group_all_ok(pg: Any, ok: bool) -> bool:
    """True only if every member of ``pg`` says ok (a MIN all-reduce of one flag)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device())
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    pg.allreduce([flag], opts).wait()
    return bool(flag.item())




# ---- cutting a world off ---------------------------------------------------------------------
def tcp_connections() -> set[tuple[int, int]]:
    """This process's established TCP connections as (local port, remote port); empty where
    ``/proc`` does not tell (not Linux)."""
    inodes = _socket_fds()
    out = set()
    for local, remote, state, inode in _tcp_table():
        if state == _ESTABLISHED and inode in inodes:
            out.add((local, remote))
    return out


_ESTABLISHED = "01"


def _socket_fds() -> dict[int, int]:
    """This process's sockets: inode -> file descriptor."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(name)
    return out


def _tcp_table() -> list[tuple[int, int, str, int]]:
    """(local port, remote port, state, inode) of every TCP socket in this network namespace."""
    rows = []
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/self/net/{name}") as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    rows.append((int(cols[1].rsplit(":", 1)[1], 16), int(cols[2].rsplit(":", 1)[1], 16),
                                 cols[3], int(cols[9])))
        except (OSError, ValueError, IndexError):
            continue
    return rows


def _store_port(store: Any) -> int | None:
    """The port of the TCP store under ``store`` (through prefix stores), if it has one."""
    while store is not None:
        port = getattr(store, "port", None)
        if isinstance(port, int):
            return port
        store = getattr(store, "underlying_store", None)
    return None


@contextlib.contextmanager
def noting_connections(into: set[tuple[int, int]], store: Any = None) -> Iterator[None]:
    """Add to ``into`` the TCP connections this process opens meanwhile (gloo's connections of
    the groups being made), less those to ``store``'s port. Groups made meanwhile by another
    thread are noted too: only ever a group of a plan that follows the same world, which the
    death that cuts this world off dooms as well."""
    before = tcp_connections()
    try:
        yield
    finally:
        skip = _store_port(store)
        into.update(c for c in tcp_connections() - before if c[1] != skip)


class _LiveWorld:
    """The training world torch.distributed holds now, by its store prefix, and the TCP
    connections of its groups."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.prefix: str | None = None
        self.connections: set[tuple[int, int]] = set()
        self.cut = False

    def begin(self, prefix: str | None) -> None:
        with self.lock:
            self.prefix, self.connections, self.cut = prefix, set(), False

    def add(self, connections: set[tuple[int, int]]) -> None:
        with self.lock:
            self.connections |= connections


_live = _LiveWorld()


@contextlib.contextmanager
def noting_world_connections(store: Any = None) -> Iterator[None]:
    """``noting_connections`` for the groups of the training world being made (megatron's)."""
    found: set[tuple[int, int]] = set()
    if store is None and dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
    try:
        with noting_connections(found, store):
            yield
    finally:
        _live.add(found)


def cut_off(prefix: str) -> int | None:
    """Abort the communicators of the training world made under store prefix ``prefix``
    (``init_training_world``), so that a collective blocked in it, in any thread, fails now
    instead of at its timeout. None when that world is not the one torch.distributed holds (it
    was retired, or is not made yet) or was cut off already; else how many of its connections
    were shut down. The world's groups stay registered: the thread using them finds them broken
    and tears them down as it does after any failed collective."""
    with _live.lock:
        if _live.prefix != prefix or _live.cut:
            return None
        _live.cut = True
        connections = set(_live.connections)
    if backend() != "gloo" and dist.is_initialized():
        for pg in list(dist.distributed_c10d._world.pg_map):
            try:
                pg.abort()  # NCCL: ncclCommAbort, which releases a collective waiting in another thread
            except Exception as e:  # a group torn down meanwhile
                log.debug("aborting a process group failed: %s", e)
    return shut_down(connections)


def shut_down(connections: set[tuple[int, int]]) -> int:
    """``shutdown(2)`` this process's established TCP connections among ``connections``; how many."""
    if not connections:
        return 0
    inodes = _socket_fds()
    done = 0
    for local, remote, state, inode in _tcp_table():
        fd = inodes.get(inode)
        if state != _ESTABLISHED or fd is None or (local, remote) not in connections:
            continue
        try:
            # on a duplicate of gloo's descriptor: shutting it down acts on the socket they share
            # (its reader sees end-of-file), closing the duplicate leaves gloo's open
            with socket.socket(fileno=os.dup(fd)) as s:
                s.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:  # closed meanwhile
            continue
    return done


class Start:
    """A world being made from scratch in this process (its rendezvous, megatron's groups, the
    rest of the build), which another thread can abort: the first world of a job, or one made
    again after a failed start or a restore. Its rendezvous and groups wait on a store client of
    its own (``client``, made by ``connect``), one store wait and one gloo connection per group
    and peer, each bounded by the collective timeout: a member lost meanwhile would hold the
    others in each of them in turn. ``abort`` (the control thread, once the coordinator decided
    the generation against it) shuts down the TCP connections the creation opened, that client's
    and gloo's (``shutdown(2)``): whatever it waits on fails now. Used as a context manager
    around the creation; one at a time (``current``)."""

    _current: Start | None = None
    _lock = threading.Lock()

    def __init__(self, generation: int, connect: Callable[[], Any], store_port: int | None) -> None:
        self.generation = generation
        self.store_port = store_port
        self.before = tcp_connections()
        self.client = connect()
        self.own = tcp_connections() - self.before  # the client's connection to the store
        self.aborted: str | None = None
        self.ended = False

    @classmethod
    def current(cls) -> Start | None:
        """The creation under way in this process (None: none)."""
        return cls._current

    def __enter__(self) -> Start:
        with Start._lock:
            Start._current = self
        return self

    def __exit__(self, *exc: Any) -> None:
        with Start._lock:
            self.ended = True
            if Start._current is self:
                Start._current = None

    def abort(self, why: str) -> int | None:
        """Make the creation fail now (once, while it is under way; None otherwise): how many
        connections were shut down."""
        with Start._lock:
            if self.ended or self.aborted is not None:
                return None
            self.aborted = why
            opened = {c for c in tcp_connections() - self.before if c[1] != self.store_port}
            return shut_down(self.own | opened)


# ---- the world object ------------------------------------------------------------------------
# Communicators created, by how (``World``): "scratch" (a default group from a rendezvous of every
# member, a first world or a rebuild), "ahead" (connected while the previous world trained:
# ``build_world_ahead``), "shrink" (the default group shrunk from the running world, survivors
# only), "split" (a megatron group made on the world: ``split_group`` of an eagerly initialised
# NCCL parent, ``new_group`` on gloo), "recreate" (a world made again after a change that could not
# shrink, or after a loss).
KINDS = ("scratch", "ahead", "shrink", "split", "recreate")
CREATED: Counter[str] = Counter()

# A test hook: a shrink fails where this names it ("fail": at once; "hang": past its bound).
SHRINK_FAULT_ENV = "LIVESHARD_FAULT_SHRINK"


def created_since(before: Counter[str]) -> dict[str, int]:
    """Communicators created since ``before`` (a copy of ``CREATED``), by kind."""
    return {k: n for k, n in (CREATED - before).items() if n}


class ShrinkFailed(RuntimeError):
    """The running world could not be shrunk (the backend refused, a survivor did not come
    within the bound, or the fault hook): the change falls back to a rebuild."""


def supports_shrinking() -> bool:
    """Whether the running default group's backend shrinks itself (NCCL ≥ 2.27 under torch ≥
    2.13: ``torch.distributed.shrink_group``); gloo does not, and is shrunk here instead."""
    if not dist.is_initialized() or not hasattr(dist, "shrink_group"):
        return False
    pg = dist.distributed_c10d._get_default_group()
    try:
        return bool(pg._get_backend(device()).supports_shrinking)
    except Exception:
        return False


class World:
    """The training world of one generation in this process: torch.distributed's default group
    and megatron's groups made on it, with a lifecycle (torchft's ``ProcessGroup`` is the model):

    * made by one of its constructors: ``scratch`` (every member meets on the store),
      ``from_ahead`` (communicators connected while the previous world trained are handed over),
      ``shrink`` (survivors only, from the running world: ``torch.distributed.shrink_group`` on
      NCCL; on gloo a survivors-only communicator finalised by torch's own shrink code),
      ``recreate`` (made again from scratch, after a shrink that failed or a loss);
    * megatron's groups for a config are split from it by ``megatron.build.init_parallel``
      (or handed over from the communicators built ahead): megatron builds on comms, not the
      other way round;
    * ``errored`` (cut off, or no longer the default group), ``abort`` (``cut_off``: a collective
      blocked in it fails now) and ``shutdown`` (every group destroyed, this process's side).

    Every communicator a constructor or ``init_parallel`` creates is counted in ``CREATED`` by kind.
    One world is torch.distributed's at a time (``current``)."""

    _current: World | None = None

    def __init__(self, name: str, rank: int, size: int, how: str) -> None:
        self.name, self.rank, self.size, self.how = name, rank, size, how
        self.down = False

    @classmethod
    def current(cls) -> World | None:
        """The world torch.distributed holds now (None: none)."""
        world = cls._current
        return world if world is not None and not world.down and dist.is_initialized() else None

    @classmethod
    def _made(cls, world: World) -> World:
        cls._current = world
        return world

    # ---- constructors ------------------------------------------------------------------------
    @classmethod
    def scratch(cls, store: dist.Store, prefix: str, rank: int, size: int, timeout: float,
                name: str | None = None, how: str = "scratch") -> World:
        """Every member meets under ``prefix`` in ``store`` and makes the default group."""
        init_training_world(store, prefix, rank, size, timeout, name=name)
        CREATED[how] += 1
        return cls._made(cls(name or prefix, rank, size, how))

    @classmethod
    def recreate(cls, store: dist.Store, prefix: str, rank: int, size: int, timeout: float,
                 name: str | None = None) -> World:
        """``scratch``, for a world made again (a shrink that failed, a loss)."""
        return cls.scratch(store, prefix, rank, size, timeout, name=name, how="recreate")

    @classmethod
    def from_ahead(cls, store: dist.Store, prefix: str, rank: int, size: int, timeout: float,
                   ahead: WorldAhead) -> World:
        """The default group from the communicator built ahead (counted as "ahead" when it was
        connected, ``build_world_ahead``); a new one (at the commit) when ``ahead`` has none."""
        made_now = ahead.default is None
        init_training_world(store, prefix, rank, size, timeout, ahead=ahead)
        if made_now:
            CREATED["scratch"] += 1
        return cls._made(cls(prefix, rank, size, "scratch" if made_now else "ahead"))

    def shrink(self, excluded: Sequence[int], name: str, bound: float) -> World:
        """The world of the survivors (every rank not in ``excluded``, in their order), made from
        this one by the survivors alone (an excluded rank must not call it: it shuts its own side
        down). Megatron's groups must be gone first (shrinking the default group destroys every
        other group). On NCCL: ``torch.distributed.shrink_group`` (default flags, no resource
        sharing); on gloo, which cannot shrink, the survivors connect a communicator of their own
        on the running world's store (what ``new_group(ranks, use_local_synchronization=True)``
        does) and torch's own shrink code makes it the default group. Raises ``ShrinkFailed``
        after ``bound`` seconds at most; this world is then still the default group, unless the
        backend destroyed it (``errored``)."""
        c10d = dist.distributed_c10d
        gone = sorted(set(excluded))
        if self.rank in gone or not gone:
            raise ValueError(f"rank {self.rank} shrinking away {gone}")
        survivors = [r for r in range(self.size) if r not in gone]
        fault = os.environ.get(SHRINK_FAULT_ENV, "")
        if fault == "fail":
            raise ShrinkFailed("shrink made to fail (" + SHRINK_FAULT_ENV + ")")
        found_now: set[tuple[int, int]] = set()
        try:
            if supports_shrinking() and fault != "hang":
                new_pg = _bounded(lambda: dist.shrink_group(gone), bound)
            else:
                _, store = c10d._world.pg_map[c10d._get_default_group()]
                if fault == "hang":  # a survivor that never comes: the others wait out the bound
                    survivors = [*survivors, self.size]
                found: set[tuple[int, int]] = set()
                with noting_connections(found, store):
                    backend_ = dist.ProcessGroupGloo(dist.PrefixStore(f"{name}shrink/", store),
                                                     survivors.index(self.rank), len(survivors),
                                                     timedelta(seconds=bound))
                    flag = torch.ones(1)
                    backend_.allreduce([flag]).wait()  # every survivor connected
                CONNECTED["shrink"] += 1
                info = c10d._prepare_shrink_target_group(None)
                new_pg = c10d._finalize_shrunk_group(info, set(gone), backend_)
                found_now = found
        except ShrinkFailed:
            raise
        except Exception as e:
            raise ShrinkFailed(f"{type(e).__name__}: {e}") from e
        # the survivors are numbered 0..n-1: the default group's ranks are the world's ranks;
        # groups made on it meet under a store prefix of their own (torch keeps the parent's,
        # where its groups, numbered from 0 again, left their peers' addresses)
        c10d._world.pg_group_ranks[new_pg] = {i: i for i in range(len(survivors))}
        backend_name, parent_store = c10d._world.pg_map[new_pg]
        c10d._world.pg_map[new_pg] = (backend_name, dist.PrefixStore(f"{name}shrunk/", parent_store))
        self.down = True
        _live.begin(name)  # what cuts this world off from here on: the shrunk group's connections
        _live.add(found_now)
        CREATED["shrink"] += 1
        return World._made(World(name, survivors.index(self.rank), len(survivors), "shrink"))

    # ---- state and ending --------------------------------------------------------------------
    def errored(self) -> bool:
        """Cut off, shut down, or no longer torch.distributed's world."""
        with _live.lock:
            cut = _live.cut or _live.prefix != self.name
        return self.down or cut or not dist.is_initialized()

    def abort(self) -> int | None:
        """``cut_off``: a collective blocked in this world, in any thread, fails now."""
        return cut_off(self.name)

    def shutdown(self, defer_free: bool = False, groups_only: bool = False) -> None:
        """Destroy megatron's groups and (unless ``groups_only``) the default group: this
        process's side only (no collective)."""
        _destroy_megatron_groups(defer_free)
        if not groups_only:
            self.down = True
            destroy_training_world(defer_free)


def shutdown_current(defer_free: bool = False, groups_only: bool = False) -> None:
    """Shut down whatever world torch.distributed holds (also one made outside ``World``, or one
    half made: a build that failed leaves its groups behind)."""
    world = World._current
    if world is not None and not world.down:
        world.shutdown(defer_free, groups_only)
        return
    _destroy_megatron_groups(defer_free)
    if not groups_only:
        destroy_training_world(defer_free)


def _destroy_megatron_groups(defer_free: bool) -> None:
    """Megatron's parallel state and groups go (``megatron.build.destroy``); none exist where
    the model builder was never imported."""
    build = sys.modules.get("liveshard.runtime.megatron.build")
    if build is not None:
        build.destroy(defer_free)


def _bounded(work: Callable[[], Any], bound: float) -> Any:
    """``work()`` in a thread; ``ShrinkFailed`` if it has not returned within ``bound`` seconds
    (the world is aborted then, so that the thread's collective fails)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = work()
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=run, name="liveshard-shrink", daemon=True)
    thread.start()
    thread.join(bound)
    if thread.is_alive():
        with contextlib.suppress(Exception):
            dist.distributed_c10d._get_default_group().abort()
        raise ShrinkFailed(f"no shrink within {bound:.0f} s")
    if "error" in box:
        raise box["error"]
    return box["value"]
