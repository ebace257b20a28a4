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

Backend-specific lines are here and only here: gloo on CPU, NCCL when CUDA is present.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_training_world(store: dist.Store, prefix: str, rank: int, size: int, timeout: float,
                        ahead: WorldAhead | None = None) -> None:
    """Make the default process group for one generation's training world (from its
    communicator built ahead, if ``ahead`` has one)."""
    td = timedelta(seconds=timeout)
    if ahead is not None and ahead.default is not None:
        _register_ahead_backends()
        with handing_over(ahead.default):
            dist.init_process_group(AHEAD, store=dist.PrefixStore(prefix, store), rank=rank, world_size=size,
                                    timeout=td)
        ahead.default = None  # torch.distributed holds it now
        return
    kwargs: dict[str, Any] = {}
    if torch.cuda.is_available():
        kwargs["device_id"] = device()  # eager NCCL init: pay it here, not in the first step
    dist.init_process_group(backend(), store=dist.PrefixStore(prefix, store), rank=rank, world_size=size,
                            timeout=td, **kwargs)


def destroy_training_world(defer_free: bool = False) -> None:
    """Shut the default group down (``defer_free``: its object is freed by ``release.later``,
    off a switch's pause, as ``megatron.build.destroy`` does with megatron's groups)."""
    if dist.is_initialized():
        from liveshard.runtime.agent import release

        default = dist.group.WORLD
        dist.destroy_process_group()
        if defer_free:
            release.later(default)


def build_transition_group(store: dist.Store, prefix: str, rank: int, size: int, timeout: float) -> Any:
    """A standalone group over old and new members (blocks until all of them have joined)."""
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
    ahead.default = _connected(dist.PrefixStore(f"{prefix}default/", store), rank, size, timeout, gloo=False)
    for i, req in enumerate(requests):
        if stop is not None and stop.is_set():
            raise Cancelled(f"connecting the world ahead was called off at group {i} of {len(requests)}")
        if rank in req.ranks:
            # a group's ranks are numbered in the order of their world ranks (as new_group does)
            ahead.groups[req] = _connected(dist.PrefixStore(f"{prefix}{i}/", store), sorted(req.ranks).index(rank),
                                           len(req.ranks), req.timeout or timeout, gloo=req.gloo)
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


