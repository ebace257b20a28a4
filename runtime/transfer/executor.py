"""Run a transition plan on real tensors over torch.distributed.

Every process of the transition (old ranks, joiners, standbys, leavers; device ``d`` is process
``ranks[d]`` of ``group``) calls ``execute`` with the same plan and schedule:

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
4. small objects (step, scheduler, data position, RNG states) travel as pickled bytes;
5. with ``verify``, every piece is checksummed at its source and its destination and the
   checksums compared; all ranks agree on the verdict (an all-reduce) before success.

The old store is only read, never written: a failure at any point (exception, dead peer,
checksum mismatch) leaves the old state intact, and the caller commits by swapping in the
returned store. ``release_old`` drops each old tensor from the old store after its last read
(less peak memory, no rollback).
"""

from __future__ import annotations

import pickle
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from liveshard.runtime.dtypes import torch_dtype
from liveshard.runtime.transfer import packing, transport
from liveshard.runtime.transfer.storage import DictStore
from liveshard.runtime.vps.schedule import Chunk, Schedule
from liveshard.runtime.vps.shards import local_tensor_shapes
from liveshard.runtime.vps.transition import TransitionPlan

MODES = ("p2p", "a2a")


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
    store: DictStore
    objects: dict[str, Any]
    stats: TransferStats


def execute(plan: TransitionPlan, sched: Schedule, device_id: int, old: DictStore,
            old_objects: dict[str, Any] | None = None, *, mode: str = "p2p", verify: bool = False,
            group: dist.ProcessGroup | None = None, ranks: list[int] | None = None,
            release_old: bool = False, tensor_device: torch.device | str | None = None,
            direct_min_bytes: int = packing.DIRECT_MIN_BYTES,
            destinations: DictStore | None = None) -> TransferResult:
    """Run the transition as device ``device_id``; returns its new shards (empty for non-members).

    ``destinations``: new tensors allocated ahead of time (``allocate_destinations``), written
    in place instead of allocating them during the transfer.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    t_start = time.perf_counter()
    stats = TransferStats()
    member = device_id < plan.devices.num_devices
    rank_of = (lambda d: d) if ranks is None else ranks.__getitem__
    dev = torch.device(tensor_device) if tensor_device is not None else _device_of(old)
    new_rank = plan.device_to_rank.get(device_id) if member else None
    copies = plan.copies

    # 1. new tensors: an old tensor kept whole and in place is reused; the others are allocated
    #    when first written, so that with release_old memory is handed over tensor by tensor
    new = _NewStore(dev)
    alias = _aliases(plan, device_id, new_rank) if new_rank is not None else {}
    alias = {k: src for k, src in alias.items() if old.has(k[0], src)}
    if new_rank is not None:
        for state, per in local_tensor_shapes(plan.new_layout, new_rank).items():
            dtype = torch_dtype(plan.new_layout.dtype(state))
            for name, shape in per.items():
                src = alias.get((state, name))
                if src is not None:
                    t = new.put(state, name, old.get(state, src))
                    stats.aliased_bytes += t.numel() * t.element_size()
                elif destinations is not None and destinations.has(state, name):
                    t = destinations.get(state, name)
                    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                        raise TransferError(f"destination {state}/{name} is {t.dtype} {tuple(t.shape)}, "
                                            f"the plan needs {dtype} {tuple(shape)}")
                    new.put(state, name, t)
                    new.allocated += t.numel() * t.element_size()  # new memory, if allocated earlier
                else:
                    new.expect(state, name, shape, dtype)
    released = 0
    peak_extra = 0

    # 2. local copies (in P2P mode they overlap round 0, see below)
    aliased_names = {name for (_, name) in alias}
    local_ok = [True]

    def local_copies() -> None:
        t0 = time.perf_counter()
        for ci, c in enumerate(copies):
            if c.src != device_id or c.dst != device_id:
                continue
            g = plan.groups[c.group]
            if c.dst_view[0] in aliased_names and all((s, c.dst_view[0]) in alias for s in g.states):
                continue
            ch = Chunk(ci, (0,) * len(c.shape), c.shape, c.nbytes, 0, -1)
            for state in g.states:
                dst = packing.piece(new, state, c.dst_view, c.dst_rel, ch)
                src = packing.piece(old, state, c.src_view, c.src_rel, ch)
                dst.copy_(src)
                if verify and packing.checksum(dst) != packing.checksum(src):  # before any release
                    local_ok[0] = False
            stats.local_bytes += c.nbytes
        stats.local_seconds += time.perf_counter() - t0
        nonlocal peak_extra
        peak_extra = max(peak_extra, new.allocated - released)

    # 3. rounds
    t0 = time.perf_counter()
    per_round = sched.for_device(device_id, copies) if member else [({}, {})] * sched.rounds
    sent_sums: dict[int, list[int]] = {}
    group_size = transport.group_size(group)
    pending_local = member
    if mode != "p2p" or not per_round:
        local_copies()
        pending_local = False
    if release_old and member and not pending_local:
        released += _release(plan, sched, device_id, old, -1, alias)
    posted: deque[_P2PRound] = deque()  # P2P rounds on the wire, oldest first
    live = 0  # staging bytes of the posted rounds
    ready: _P2PRound | None = None  # the next round, prepared, when it did not fit the budget yet

    def post_rounds(r: int) -> None:
        """Post round ``r`` unless it is on the wire already, then later rounds while the staging
        of every posted round fits the budget. Not with ``release_old``: posting ahead allocates
        new tensors before the old ones they replace are released."""
        nonlocal live, ready, peak_extra
        nxt = r + len(posted)  # rounds before r are complete
        while nxt < len(per_round) and (nxt == r or not release_old):
            rnd = ready if ready is not None else _P2PRound.prepare(plan, *per_round[nxt], old, new,
                                                                    direct_min_bytes)
            ready = None
            if nxt > r and live + rnd.staging > sched.budget:
                ready = rnd
                return
            if verify:
                for p, chs in per_round[nxt][0].items():
                    sent_sums.setdefault(p, []).extend(_chunk_sums(chs, plan, old, src_side=True))
            rnd.post(plan, old, new, dev, rank_of, group)
            posted.append(rnd)
            live += rnd.staging
            nxt += 1
            stats.peak_staging_bytes = max(stats.peak_staging_bytes, live)
            stats.max_rounds_in_flight = max(stats.max_rounds_in_flight, len(posted))
            peak_extra = max(peak_extra, new.allocated - released + live)

    tr = time.perf_counter()
    for r, (sends, recvs) in enumerate(per_round):
        if mode == "p2p":
            post_rounds(r)
            if pending_local:  # the local copies run while the posted rounds are on the wire
                local_copies()
                pending_local = False
                if release_old:
                    released += _release(plan, sched, device_id, old, -1, alias)
            done = posted.popleft()
            done.complete()
            live -= done.staging
            peak_extra = max(peak_extra, new.allocated - released + live)
        else:
            if verify:
                for p, chs in sends.items():
                    sent_sums.setdefault(p, []).extend(_chunk_sums(chs, plan, old, src_side=True))
            send_bufs = {p: torch.empty(packing.buffer_size(chs), dtype=torch.uint8, device=dev)
                         for p, chs in sends.items()}
            recv_bufs = {p: torch.empty(packing.buffer_size(chs), dtype=torch.uint8, device=dev)
                         for p, chs in recvs.items()}
            staging = sum(b.numel() for b in send_bufs.values()) + sum(b.numel() for b in recv_bufs.values())
            stats.peak_staging_bytes = max(stats.peak_staging_bytes, staging)
            stats.max_rounds_in_flight = 1
            for p, chs in sends.items():
                packing.pack(send_bufs[p], chs, plan, old)
            _exchange_a2a(send_bufs, recv_bufs, rank_of, group, group_size, dev)
            for p, chs in recvs.items():
                packing.unpack(recv_bufs[p], chs, plan, new)
            peak_extra = max(peak_extra, new.allocated - released + staging)
            del send_bufs, recv_bufs
        stats.bytes_sent += sum(ch.nbytes for chs in sends.values() for ch in chs)
        stats.bytes_received += sum(ch.nbytes for chs in recvs.values() for ch in chs)
        if release_old and member:
            released += _release(plan, sched, device_id, old, r, alias)
        now = time.perf_counter()
        stats.round_seconds.append(now - tr)
        tr = now
    stats.rounds_seconds = time.perf_counter() - t0
    new.allocate_rest()  # every element is written by the plan; this only guards empty tensors
    stats.peak_extra_bytes = max(peak_extra, new.allocated - released)

    # 4. small objects
    new_objects = _move_objects(plan, device_id, old_objects or {}, rank_of, group, dev) if member else {}

    # 5. verification
    if verify:
        t0 = time.perf_counter()
        ok = _verify(plan, per_round, new, sent_sums, rank_of, group, dev) if member else True
        ok = ok and local_ok[0]
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=dev)
        transport.all_reduce(flag, dist.ReduceOp.MIN, group)
        stats.verify_seconds = time.perf_counter() - t0
        if not int(flag.item()):
            raise TransferError("checksums differ between sources and destinations"
                                + ("" if ok else f" (device {device_id} saw a mismatch)"))
        stats.verified = True
    stats.seconds = time.perf_counter() - t_start
    return TransferResult(DictStore(new.tensors) if new_rank is not None else DictStore(), new_objects, stats)


def allocate_destinations(plan: TransitionPlan, device_id: int, device: torch.device | str = "cpu") -> DictStore:
    """Every new tensor of a device that is not an old tensor kept in place, allocated and
    written once. Done while the job still trains (the new tensors then live beside the old
    state a little earlier), it takes the first-touch cost of fresh memory (page faults on CPU,
    the allocator on GPU) out of the transfer. Pass it as ``destinations``."""
    new_rank = plan.device_to_rank.get(device_id) if device_id < plan.devices.num_devices else None
    if new_rank is None:
        return DictStore()
    kept = _aliases(plan, device_id, new_rank)
    out = DictStore()
    for state, per in local_tensor_shapes(plan.new_layout, new_rank).items():
        dtype = torch_dtype(plan.new_layout.dtype(state))
        for name, shape in per.items():
            if (state, name) not in kept:
                # written, not only allocated: the pages must really be mapped now
                out.tensors.setdefault(state, {})[name] = torch.empty(shape, dtype=dtype, device=device).zero_()
    return out


class _NewStore(DictStore):
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


def _device_of(store: DictStore) -> torch.device:
    for _, _, t in store.items():
        return t.device
    return torch.device("cpu")


def _aliases(plan: TransitionPlan, device_id: int, new_rank: int) -> dict[tuple[str, str], str]:
    """(state, new name) -> old name, for new tensors that are an old tensor kept whole, in place.
    Pure (shapes from the layouts): ``allocate_destinations`` leaves these out ahead of time."""
    if device_id >= plan.devices.old_world:
        return {}
    incoming: dict[tuple[int, str], list] = {}
    for c in plan.copies:
        if c.dst == device_id:
            incoming.setdefault((c.group, c.dst_view[0]), []).append(c)
    new_shapes = local_tensor_shapes(plan.new_layout, new_rank)
    old_shapes = local_tensor_shapes(plan.old_layout, device_id)  # old rank i is device i
    out: dict[tuple[str, str], str] = {}
    for (gi, name), cs in incoming.items():
        src_name = cs[0].src_view[0]
        if not all(c.src == device_id and c.src_view == c.dst_view and c.src_rel == c.dst_rel
                   and c.src_view[0] == src_name for c in cs):
            continue
        g = plan.groups[gi]
        covered = sum(_numel(c.shape) for c in cs)
        if all(tuple(old_shapes.get(state, {}).get(src_name, ())) == tuple(new_shapes[state][name])
               and covered == _numel(new_shapes[state][name]) for state in g.states):
            for state in g.states:
                out[state, name] = src_name
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _release(plan, sched: Schedule, device_id: int, old: DictStore, after_round: int, alias) -> int:
    """Drop old tensors last read in ``after_round``; returns the bytes released."""
    kept = set(alias.values())
    freed = 0
    for (d, gi, name), last in sched.last_read.items():
        if d != device_id or last != after_round or name in kept:
            continue
        for state in plan.groups[gi].states:
            try:
                t = old.get(state, name)
            except KeyError:
                continue
            freed += t.numel() * t.element_size()
            old.release(state, name)
    return freed


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
        out: list[tuple[int, list[Chunk] | torch.Tensor]] = []
        into: list[tuple[int, list[Chunk] | torch.Tensor]] = []
        staging = 0
        for msgs, by_peer, store, src_side in ((out, sends, old, True), (into, recvs, new, False)):
            for p, chs in sorted(by_peer.items()):
                packed, direct = packing.split_direct(chs, direct_min_bytes)
                if packed:
                    msgs.append((p, packed))
                    staging += packing.buffer_size(packed)
                for ch in direct:
                    c = plan.copies[ch.copy]
                    view, rel = (c.src_view, c.src_rel) if src_side else (c.dst_view, c.dst_rel)
                    for state in plan.groups[c.group].states:
                        v = packing.piece(store, state, view, rel, ch)
                        if not v.is_contiguous():
                            staging += v.numel() * v.element_size()
                        msgs.append((p, v))
        return cls(out, into, staging)

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


def _exchange_p2p(send_bufs, recv_bufs, rank_of, group) -> None:
    transport.exchange(send_bufs, recv_bufs, rank_of, group)


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


def _chunk_sums(chs: list[Chunk], plan, store, src_side: bool) -> list[int]:
    out = []
    for ch in chs:
        c = plan.copies[ch.copy]
        view, rel = (c.src_view, c.src_rel) if src_side else (c.dst_view, c.dst_rel)
        for state in plan.groups[c.group].states:
            out.append(packing.checksum(packing.piece(store, state, view, rel, ch)))
    return out


def _verify(plan, per_round, new, sent_sums, rank_of, group, dev) -> bool:
    """Compare each received chunk's checksums with those its source computed before sending."""
    ok = True
    received: dict[int, list[Chunk]] = {}
    for _, recvs in per_round:
        for p, chs in recvs.items():
            received.setdefault(p, []).extend(chs)
    send_bufs = {p: torch.tensor(v, dtype=torch.int64, device=dev) for p, v in sent_sums.items()}
    recv_bufs = {p: torch.empty(sum(len(plan.groups[plan.copies[ch.copy].group].states) for ch in chs),
                                dtype=torch.int64, device=dev) for p, chs in received.items()}
    _exchange_p2p(send_bufs, recv_bufs, rank_of, group)
    for p, chs in received.items():
        if recv_bufs[p].tolist() != _chunk_sums(chs, plan, new, src_side=False):
            ok = False
    return ok


def _move_objects(plan: TransitionPlan, device_id: int, old_objects: dict[str, Any], rank_of,
                  group, dev) -> dict[str, Any]:
    """Pickled small objects: a round of sizes, then a round of payloads (P2P)."""
    out: dict[str, Any] = {}
    outgoing: dict[int, list[bytes]] = {}
    incoming: dict[int, list[str]] = {}
    for m in plan.objects:
        if m.src == device_id and m.dst == device_id:
            out[m.name] = pickle.loads(pickle.dumps(old_objects.get(m.name)))
        elif m.src == device_id:
            outgoing.setdefault(m.dst, []).append(pickle.dumps(old_objects.get(m.name)))
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
            out[name] = pickle.loads(raw[pos:pos + n])
            pos += n
    return out
