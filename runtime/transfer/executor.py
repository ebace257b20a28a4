"""Run a transition plan on real tensors over torch.distributed.

Every process of the transition (old ranks, joiners, standbys, leavers; device ``d`` is process
``ranks[d]`` of ``group``) calls ``execute`` with the same plan and schedule, or each with its
own device's part of it (``vps.device_plan``: the same copies and rounds as its slice of the
whole plan; all-to-all rounds then agree on their number first, one small all-reduce):

1. a new local tensor that is exactly an old tensor kept in place is the old tensor itself (no
   copy); the others are allocated on the old shards' device when first written;
2. local copies (pieces a device already holds) are copied;
3. each round exchanges all its messages in one batched P2P group (``batch_isend_irecv``) or
   one ``all_to_all_single``. All-to-all packs one staging buffer per peer; P2P packs small
   chunks the same way but sends large ones as messages of their own, read from and written to
   the state tensors directly when those views are contiguous (no staging copy). P2P rounds
   are posted ahead of time while the staging they really allocate (packed buffers, copies of
   strided views; direct contiguous messages need none) fits the budget together, so a device
   does not hold its peers up between rounds; the local copies of step 2 run while the posted
   rounds are on the wire. Messages between two devices pair up in posting order, which is the
   schedule's order on both sides whatever each posts ahead;
4. small objects (step, scheduler, data position, RNG states) travel encoded by ``objects``
   (JSON with tagged tensors: nothing received is unpickled);
5. with ``verify``, every piece is checksummed at its source and its destination and the
   checksums compared; all ranks agree on the verdict (an all-reduce) before success.

The old shards are only read, never written: a failure at any point (exception, dead peer,
checksum mismatch) leaves the old state intact, and the caller commits by swapping in the
returned shards. ``release_old`` drops each old tensor from the old shards after its last read
(less peak memory, no rollback).

What each step moves on a device (the pieces, the chunks of each round and their messages, what
is freed when) is worked out by the pure functions of ``rounds``; this module runs it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from liveshard.runtime.dtypes import torch_dtype
from liveshard.runtime.transfer import objects, packing, rounds, transport
from liveshard.runtime.transfer.rounds import A2A, P2P, ByPeer, Direct, Kept, Message, NewTensor, Round
from liveshard.runtime.transfer.storage import LocalShards
from liveshard.runtime.vps.plan_view import TransitionPlanView
from liveshard.runtime.vps.schedule import Chunk, Schedule

MODES = (P2P, A2A)
DEFAULT_MODE = P2P


class TransferError(RuntimeError):
    """The transition failed; the old state is untouched."""


@dataclass
class TransferStats:
    seconds: float = 0.0
    local_seconds: float = 0.0
    rounds_seconds: float = 0.0
    verify_seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    local_bytes: int = 0
    aliased_bytes: int = 0
    peak_staging_bytes: int = 0  # measured: send + receive buffers alive at once (all posted rounds)
    peak_extra_bytes: int = 0  # new tensors + staging - released old tensors, at its highest
    max_rounds_in_flight: int = 0  # rounds posted and not yet complete, at most
    verified: bool = False
    round_seconds: list[float] = field(default_factory=list)  # from the previous round's completion


@dataclass
class TransferResult:
    shards: LocalShards
    objects: dict[str, Any]
    stats: TransferStats


def execute(plan: TransitionPlanView, sched: Schedule, device_id: int, old: LocalShards,
            old_objects: dict[str, Any] | None = None, *, mode: str = DEFAULT_MODE, verify: bool = False,
            group: dist.ProcessGroup | None = None, ranks: list[int] | None = None,
            release_old: bool = False, tensor_device: torch.device | str | None = None,
            direct_min_bytes: int = packing.DIRECT_MIN_BYTES,
            destinations: LocalShards | None = None) -> TransferResult:
    """Run the transition as device ``device_id``; returns its new shards (empty for non-members).

    ``destinations``: new tensors allocated ahead of time (``allocate_destinations``), written
    in place instead of allocating them during the transfer.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    t_start = time.perf_counter()
    run = _Transfer.begin(plan, sched, device_id, old, verify=verify, group=group, ranks=ranks,
                          release_old=release_old, tensor_device=tensor_device, destinations=destinations)
    per_round = rounds.device_rounds(plan, sched, device_id)
    if mode == A2A and rounds.own_part(plan):
        per_round = _as_many_rounds_as_everyone(per_round, group, run.dev)
    _move_tensors(run, per_round, mode, direct_min_bytes)
    new_objects = (_move_objects(plan, device_id, old_objects or {}, run.rank_of, group, run.dev)
                   if run.member else {})
    if verify:
        _verify_everywhere(run, per_round)
    run.stats.seconds = time.perf_counter() - t_start
    return TransferResult(run.result_shards(), new_objects, run.stats)


def allocate_destinations(plan: TransitionPlanView, device_id: int, device: torch.device | str = "cpu") -> LocalShards:
    """Every new tensor of a device that is not an old tensor kept in place, allocated and
    written once. Done while the job still trains (the new tensors then live beside the old
    state a little earlier), it takes the first-touch cost of fresh memory (page faults on CPU,
    the allocator on GPU) out of the transfer. Pass it as ``destinations``."""
    new_rank = rounds.new_rank_of(plan, device_id)
    if new_rank is None:
        return LocalShards()
    kept = rounds.kept_in_place(plan, device_id, new_rank)
    out = LocalShards()
    for nt in rounds.new_tensors(plan, new_rank):
        if (nt.state, nt.name) not in kept:
            # written, not only allocated: the pages must really be mapped now
            t = torch.empty(nt.shape, dtype=torch_dtype(nt.dtype), device=device).zero_()
            out.tensors.setdefault(nt.state, {})[nt.name] = t
    return out


# 1. the new tensors


@dataclass
class _Transfer:
    """One device's transfer under way: its shards, its stats and the memory accounting."""

    plan: TransitionPlanView
    sched: Schedule
    device_id: int
    member: bool  # a device of the plan (old, joining, standby or leaving), not a spare process
    new_rank: int | None
    old: LocalShards
    new: _NewShards
    kept: Kept  # new tensors that are old tensors kept in place (and held by ``old``)
    frees: dict[int, list[tuple[str, str]]]  # with release_old: round -> old tensors last read in it
    verify: bool
    release_old: bool
    rank_of: Callable[[int], int]
    group: Any
    dev: torch.device
    stats: TransferStats = field(default_factory=TransferStats)
    released: int = 0  # bytes of old tensors released so far
    peak_extra: int = 0  # new tensors + staging - released, at its highest so far
    local_ok: bool = True  # with verify: every local copy's checksums matched
    sent_sums: dict[int, list[int]] = field(default_factory=dict)  # with verify: per peer, in send order
    round_clock: float = 0.0  # when the previous round completed

    @classmethod
    def begin(cls, plan: TransitionPlanView, sched: Schedule, device_id: int, old: LocalShards, *, verify: bool,
              group: Any, ranks: list[int] | None, release_old: bool,
              tensor_device: torch.device | str | None, destinations: LocalShards | None) -> _Transfer:
        """Step 1: the new tensors. An old tensor kept whole and in place is reused; the others
        are allocated when first written, so that with release_old memory is handed over tensor
        by tensor (or taken from ``destinations``)."""
        stats = TransferStats()
        dev = torch.device(tensor_device) if tensor_device is not None else _device_of(old)
        new_rank = rounds.new_rank_of(plan, device_id)
        kept = _kept_in_shards(plan, device_id, new_rank, old)
        new = _new_shards(plan, new_rank, kept, old, destinations, dev, stats)
        frees = rounds.release_schedule(plan, sched, device_id, kept) if release_old else {}
        return cls(plan, sched, device_id, device_id < plan.devices.num_devices, new_rank, old, new, kept,
                   frees, verify, release_old, (lambda d: d) if ranks is None else ranks.__getitem__,
                   group, dev, stats)

    def note_peak(self, staging: int = 0) -> None:
        """Account the memory held now beyond the old state: new tensors and ``staging``, less
        the old tensors released."""
        self.peak_extra = max(self.peak_extra, self.new.allocated - self.released + staging)

    def release_after(self, r: int) -> None:
        """With release_old, drop the old tensors last read in round ``r`` (-1: the local copies)."""
        if self.release_old and self.member:
            self.released += _release(self.old, self.frees.get(r, ()))

    def record_sent(self, sends: ByPeer) -> None:
        """With verify, checksum what is about to be sent, at its source."""
        if self.verify:
            for p, chs in sends.items():
                self.sent_sums.setdefault(p, []).extend(_chunk_sums(chs, self.plan, self.old, src_side=True))

    def end_round(self, r: int, sends: ByPeer, recvs: ByPeer) -> None:
        """After round ``r`` completed: count its bytes, release what it read last, time it."""
        self.stats.bytes_sent += rounds.round_bytes(sends)
        self.stats.bytes_received += rounds.round_bytes(recvs)
        self.release_after(r)
        now = time.perf_counter()
        self.stats.round_seconds.append(now - self.round_clock)
        self.round_clock = now

    def result_shards(self) -> LocalShards:
        return LocalShards(self.new.tensors) if self.new_rank is not None else LocalShards()


def _kept_in_shards(plan: TransitionPlanView, device_id: int, new_rank: int | None, old: LocalShards) -> Kept:
    """The old tensors kept in place as new ones, among those ``old`` holds."""
    if new_rank is None:
        return {}
    kept = rounds.kept_in_place(plan, device_id, new_rank)
    return {k: src for k, src in kept.items() if old.has(k[0], src)}


def _new_shards(plan: TransitionPlanView, new_rank: int | None, kept: Kept, old: LocalShards,
               destinations: LocalShards | None, dev: torch.device, stats: TransferStats) -> _NewShards:
    """The device's new tensors: kept old tensors, ``destinations``, the rest allocated on first write."""
    new = _NewShards(dev)
    if new_rank is None:
        return new
    for nt in rounds.new_tensors(plan, new_rank):
        dtype = torch_dtype(nt.dtype)
        src = kept.get((nt.state, nt.name))
        if src is not None:
            t = new.put(nt.state, nt.name, old.get(nt.state, src))
            stats.aliased_bytes += t.numel() * t.element_size()
        elif destinations is not None and destinations.has(nt.state, nt.name):
            t = new.put(nt.state, nt.name, _destination(destinations, nt, dtype))
            new.allocated += t.numel() * t.element_size()  # new memory, if allocated earlier
        else:
            new.expect(nt.state, nt.name, nt.shape, dtype)
    return new


def _destination(destinations: LocalShards, nt: NewTensor, dtype: torch.dtype) -> torch.Tensor:
    """The tensor allocated ahead for ``nt``, checked against the plan."""
    t = destinations.get(nt.state, nt.name)
    if tuple(t.shape) != tuple(nt.shape) or t.dtype != dtype:
        raise TransferError(f"destination {nt.state}/{nt.name} is {t.dtype} {tuple(t.shape)}, "
                            f"the plan needs {dtype} {tuple(nt.shape)}")
    return t


class _NewShards(LocalShards):
    """The new shards: reused old tensors, plus tensors allocated on first access."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.allocated = 0
        self._pending: dict[tuple[str, str], tuple] = {}

    def put(self, state: str, name: str, t: torch.Tensor) -> torch.Tensor:
        self.tensors.setdefault(state, {})[name] = t
        return t

    def expect(self, state: str, name: str, shape, dtype) -> None:
        self._pending[state, name] = (shape, dtype)

    def get(self, state: str, name: str) -> torch.Tensor:
        t = self.tensors.get(state, {}).get(name)
        if t is None:
            shape, dtype = self._pending.pop((state, name))
            t = self.put(state, name, torch.empty(shape, dtype=dtype, device=self.device))
            self.allocated += t.numel() * t.element_size()
        return t

    def allocate_rest(self) -> None:
        for state, name in list(self._pending):
            self.get(state, name)


def _device_of(shards: LocalShards) -> torch.device:
    for _, _, t in shards.items():
        return t.device
    return torch.device("cpu")


# 2. local copies and 3. rounds


def _move_tensors(run: _Transfer, per_round: list[Round], mode: str, direct_min_bytes: int) -> None:
    """The local copies and every round (in P2P mode the local copies overlap the first rounds)."""
    t0 = time.perf_counter()
    overlap = rounds.local_copies_overlap_rounds(mode, len(per_round))
    if not overlap:
        _copy_locally(run)
        run.release_after(-1)
    if mode == P2P:
        _p2p_rounds(run, per_round, direct_min_bytes, copy_locally=overlap and run.member)
    else:
        _a2a_rounds(run, per_round)
    run.stats.rounds_seconds = time.perf_counter() - t0
    run.new.allocate_rest()  # every element is written by the plan; this only guards empty tensors
    run.stats.peak_extra_bytes = max(run.peak_extra, run.new.allocated - run.released)


def _copy_locally(run: _Transfer) -> None:
    """Copy the pieces the device already holds from its old tensors into its new ones."""
    t0 = time.perf_counter()
    plan = run.plan
    for ci in rounds.local_copies(plan, run.device_id, run.kept):
        c = plan.copies[ci]
        ch = rounds.whole_copy(plan, ci)
        for state in plan.groups[c.group].states:
            dst = packing.piece(run.new, state, c.dst_view, c.dst_rel, ch)
            src = packing.piece(run.old, state, c.src_view, c.src_rel, ch)
            dst.copy_(src)
            if run.verify and packing.checksum(dst) != packing.checksum(src):  # before any release
                run.local_ok = False
        run.stats.local_bytes += c.nbytes
    run.stats.local_seconds += time.perf_counter() - t0
    run.note_peak()


def _release(old: LocalShards, tensors) -> int:
    """Drop ``tensors`` (state, name) from the old shards, those they hold; returns the bytes released."""
    freed = 0
    for state, name in tensors:
        try:
            t = old.get(state, name)
        except KeyError:
            continue
        freed += t.numel() * t.element_size()
        old.release(state, name)
    return freed


def _p2p_rounds(run: _Transfer, per_round: list[Round], direct_min_bytes: int, copy_locally: bool) -> None:
    """P2P rounds in order, later ones posted ahead within the budget; with ``copy_locally`` the
    local copies run while the first posted rounds are on the wire."""
    pipe = _P2PPipeline(run, per_round, direct_min_bytes)
    run.round_clock = time.perf_counter()
    for r, (sends, recvs) in enumerate(per_round):
        pipe.post_through(r)
        if copy_locally and r == 0:
            _copy_locally(run)
            run.release_after(-1)
        pipe.complete_oldest()
        run.end_round(r, sends, recvs)
    run.stats.peak_staging_bytes = max(run.stats.peak_staging_bytes, pipe.window.peak_live)
    run.stats.max_rounds_in_flight = max(run.stats.max_rounds_in_flight, pipe.window.max_in_flight)


class _P2PPipeline:
    """The P2P rounds of one device on the wire (``rounds.PostingWindow`` decides how many).
    Not ahead with release_old: posting ahead allocates new tensors before the old ones they
    replace are released."""

    def __init__(self, run: _Transfer, per_round: list[Round], direct_min_bytes: int) -> None:
        self.run = run
        self.per_round = per_round
        self.direct_min_bytes = direct_min_bytes
        self.window = rounds.PostingWindow(len(per_round), run.sched.budget, ahead=not run.release_old)
        self.ready: _P2PRound | None = None  # the next round, prepared, when it did not fit the budget yet

    def post_through(self, r: int) -> None:
        """Post round ``r`` unless it is on the wire already, then later rounds while they fit."""
        run, window = self.run, self.window
        while (nxt := window.next_to_post(r)) is not None:
            sends, recvs = self.per_round[nxt]
            rnd = self.ready if self.ready is not None else _P2PRound.prepare(
                run.plan, sends, recvs, run.old, run.new, self.direct_min_bytes)
            self.ready = None
            if not window.fits(r, nxt, rnd.staging):
                self.ready = rnd
                return
            run.record_sent(sends)
            rnd.post(run.plan, run.old, run.new, run.dev, run.rank_of, run.group)
            window.posted(rnd, rnd.staging)
            run.note_peak(window.live)

    def complete_oldest(self) -> None:
        self.window.complete_oldest().complete()
        self.run.note_peak(self.window.live)


@dataclass
class _P2PRound:
    """One P2P round's messages: per peer one packed buffer of small chunks, then one message per
    (large chunk, state), straight from/into the state tensors where those views are contiguous.
    ``prepare`` resolves the views and sizes the staging without allocating it, so the caller can
    decide whether the round fits the budget before posting it; both sides list the messages in
    the same order (it depends on the schedule only), so they pair up in order."""

    sends: list[tuple[int, list[Chunk] | torch.Tensor]]  # (peer, chunks to pack | view to send)
    recvs: list[tuple[int, list[Chunk] | torch.Tensor]]  # (peer, chunks to unpack | view to fill)
    staging: int  # bytes of staging ``post`` allocates: packed buffers, copies of strided views
    works: list[Any] = field(default_factory=list)
    finish: list[Callable[[], None]] = field(default_factory=list)  # after the wait: unpack, copy back
    buffers: list[torch.Tensor] = field(default_factory=list)  # what is on the wire, kept alive

    @classmethod
    def prepare(cls, plan, sends: dict[int, list[Chunk]], recvs: dict[int, list[Chunk]], old, new,
                direct_min_bytes: int) -> _P2PRound:
        out, out_staging = _resolve(rounds.message_layout(plan, sends, direct_min_bytes, src_side=True), old)
        into, in_staging = _resolve(rounds.message_layout(plan, recvs, direct_min_bytes, src_side=False), new)
        return cls(out, into, out_staging + in_staging)

    def post(self, plan, old, new, dev: torch.device, rank_of: Callable[[int], int], group) -> None:
        """Allocate and fill the staging, then start every send and receive of the round."""
        out_msgs: list[tuple[int, torch.Tensor]] = []
        in_msgs: list[tuple[int, torch.Tensor]] = []
        for p, what in self.sends:
            if isinstance(what, list):
                buf = torch.empty(packing.buffer_size(what), dtype=torch.uint8, device=dev)
                packing.pack(buf, what, plan, old)
            else:
                buf = packing.as_bytes(what if what.is_contiguous() else what.contiguous())
            out_msgs.append((p, buf))
        for p, what in self.recvs:
            if isinstance(what, list):
                buf = torch.empty(packing.buffer_size(what), dtype=torch.uint8, device=dev)
                self.finish.append(lambda buf=buf, chs=what: packing.unpack(buf, chs, plan, new))
            elif what.is_contiguous():
                buf = packing.as_bytes(what)
            else:
                tmp = torch.empty(what.shape, dtype=what.dtype, device=dev)
                self.finish.append(lambda v=what, tmp=tmp: v.copy_(tmp))
                buf = packing.as_bytes(tmp)
            in_msgs.append((p, buf))
        self.buffers = [b for _, b in out_msgs] + [b for _, b in in_msgs]
        self.works = transport.post(out_msgs, in_msgs, rank_of, group)

    def complete(self) -> None:
        """Wait for the round's messages, then unpack what was staged. Drops the staging and every
        view of the state tensors, so that released old tensors are freed."""
        transport.wait(self.works)
        for finish in self.finish:
            finish()
        self.sends, self.recvs, self.works, self.finish, self.buffers = [], [], [], [], []


def _resolve(messages: list[Message], shards: LocalShards) -> tuple[list[tuple[int, list[Chunk] | torch.Tensor]], int]:
    """A message layout on ``shards``' tensors: packed chunk lists as they are (packed when
    posted), direct messages as views of the state tensors; and the staging posting them
    allocates (packed buffers, copies of strided views)."""
    msgs: list[tuple[int, list[Chunk] | torch.Tensor]] = []
    staging = 0
    for m in messages:
        if isinstance(m, Direct):
            v = packing.piece(shards, m.state, m.view, m.rel, m.chunk)
            if not v.is_contiguous():
                staging += v.numel() * v.element_size()
            msgs.append((m.peer, v))
        else:
            msgs.append((m.peer, m.chunks))
            staging += m.staging
    return msgs, staging


def _a2a_rounds(run: _Transfer, per_round: list[Round]) -> None:
    """All-to-all rounds, one at a time."""
    group_size = transport.group_size(run.group)
    run.round_clock = time.perf_counter()
    for r, (sends, recvs) in enumerate(per_round):
        run.record_sent(sends)
        _a2a_round(run, sends, recvs, group_size)
        run.end_round(r, sends, recvs)


def _as_many_rounds_as_everyone(per_round: list[Round], group, dev) -> list[Round]:
    """``per_round`` padded with empty rounds to the most rounds any device has. A device's
    own plan schedules its own pairs only, so it knows its own last round, not the others';
    an all-to-all needs every process in every round (P2P rounds pair up peer by peer and need
    no such agreement)."""
    n = torch.tensor([len(per_round)], dtype=torch.int64, device=dev)
    transport.all_reduce(n, dist.ReduceOp.MAX, group)
    return per_round + [({}, {})] * (int(n.item()) - len(per_round))


def _a2a_round(run: _Transfer, sends: ByPeer, recvs: ByPeer, group_size: int) -> None:
    """One staging buffer per peer each way: pack, one all_to_all_single, unpack."""
    send_bufs = {p: torch.empty(packing.buffer_size(chs), dtype=torch.uint8, device=run.dev)
                 for p, chs in sends.items()}
    recv_bufs = {p: torch.empty(packing.buffer_size(chs), dtype=torch.uint8, device=run.dev)
                 for p, chs in recvs.items()}
    staging = sum(b.numel() for b in send_bufs.values()) + sum(b.numel() for b in recv_bufs.values())
    run.stats.peak_staging_bytes = max(run.stats.peak_staging_bytes, staging)
    run.stats.max_rounds_in_flight = 1
    for p, chs in sends.items():
        packing.pack(send_bufs[p], chs, run.plan, run.old)
    _exchange_a2a(send_bufs, recv_bufs, run.rank_of, run.group, group_size, run.dev)
    for p, chs in recvs.items():
        packing.unpack(recv_bufs[p], chs, run.plan, run.new)
    run.note_peak(staging)


def _exchange_a2a(send_bufs, recv_bufs, rank_of, group, group_size: int, dev) -> None:
    in_splits = [0] * group_size
    out_splits = [0] * group_size
    order_in = sorted((rank_of(p), buf) for p, buf in send_bufs.items())
    order_out = sorted((rank_of(p), buf) for p, buf in recv_bufs.items())
    for gr, buf in order_in:
        in_splits[gr] = buf.numel()
    for gr, buf in order_out:
        out_splits[gr] = buf.numel()
    send = torch.cat([b for _, b in order_in]) if order_in else torch.empty(0, dtype=torch.uint8, device=dev)
    recv = torch.empty(sum(out_splits), dtype=torch.uint8, device=dev)
    transport.all_to_all(recv, send, out_splits, in_splits, group)
    pos = 0
    for _, buf in order_out:
        buf.copy_(recv[pos:pos + buf.numel()])
        pos += buf.numel()


# 4. small objects


def _move_objects(plan: TransitionPlanView, device_id: int, old_objects: dict[str, Any], rank_of,
                  group, dev) -> dict[str, Any]:
    """Small objects (``objects.encode``): a round of sizes, then a round of payloads (P2P)."""
    out: dict[str, Any] = {}
    outgoing: dict[int, list[bytes]] = {}
    incoming: dict[int, list[str]] = {}
    for m in plan.objects:
        if m.src == device_id and m.dst == device_id:
            out[m.name] = objects.decode(objects.encode(old_objects.get(m.name)))
        elif m.src == device_id:
            outgoing.setdefault(m.dst, []).append(objects.encode(old_objects.get(m.name)))
        elif m.dst == device_id:
            incoming.setdefault(m.src, []).append(m.name)
    size_send = {p: torch.tensor([len(b) for b in bs], dtype=torch.int64, device=dev) for p, bs in outgoing.items()}
    size_recv = {p: torch.empty(len(names), dtype=torch.int64, device=dev) for p, names in incoming.items()}
    _exchange_p2p(size_send, size_recv, rank_of, group)
    data_send = {p: torch.frombuffer(bytearray(b"".join(bs)), dtype=torch.uint8).to(dev)
                 for p, bs in outgoing.items() if sum(map(len, bs))}
    data_recv = {p: torch.empty(int(size_recv[p].sum()), dtype=torch.uint8, device=dev) for p in incoming
                 if int(size_recv[p].sum())}
    _exchange_p2p(data_send, data_recv, rank_of, group)
    for p, names in incoming.items():
        raw = data_recv[p].cpu().numpy().tobytes() if p in data_recv else b""
        pos = 0
        for name, n in zip(names, size_recv[p].tolist()):
            out[name] = objects.decode(raw[pos:pos + n])
            pos += n
    return out


def _exchange_p2p(send_bufs, recv_bufs, rank_of, group) -> None:
    transport.exchange(send_bufs, recv_bufs, rank_of, group)


# 5. verification


def _verify_everywhere(run: _Transfer, per_round: list[Round]) -> None:
    """Compare checksums at sources and destinations; every rank agrees on the verdict."""
    t0 = time.perf_counter()
    ok = _verify(run.plan, per_round, run.new, run.sent_sums, run.rank_of, run.group, run.dev) if run.member else True
    ok = ok and run.local_ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=run.dev)
    transport.all_reduce(flag, dist.ReduceOp.MIN, run.group)
    run.stats.verify_seconds = time.perf_counter() - t0
    if not int(flag.item()):
        raise TransferError("checksums differ between sources and destinations"
                            + ("" if ok else f" (device {run.device_id} saw a mismatch)"))
    run.stats.verified = True


def _verify(plan, per_round, new, sent_sums, rank_of, group, dev) -> bool:
    """Compare each received chunk's checksums with those its source computed before sending."""
    ok = True
    received = rounds.received_by_peer(per_round)
    send_bufs = {p: torch.tensor(v, dtype=torch.int64, device=dev) for p, v in sent_sums.items()}
    recv_bufs = {p: torch.empty(sum(len(plan.groups[plan.copies[ch.copy].group].states) for ch in chs),
                                dtype=torch.int64, device=dev) for p, chs in received.items()}
    _exchange_p2p(send_bufs, recv_bufs, rank_of, group)
    for p, chs in received.items():
        if recv_bufs[p].tolist() != _chunk_sums(chs, plan, new, src_side=False):
            ok = False
    return ok


def _chunk_sums(chs: list[Chunk], plan, shards: LocalShards, src_side: bool) -> list[int]:
    return [packing.checksum(packing.piece(shards, state, view, rel, ch))
            for ch in chs for state, view, rel in rounds.piece_refs(plan, ch, src_side)]
