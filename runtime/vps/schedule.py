"""Rounds of a transition under a per-device staging budget.

A network copy is packed by its source into a staging buffer (one per peer per round) and
unpacked by its destination from one. ``schedule(plan, budget)`` splits copies into chunks
(row-major flat ranges of the piece, as boxes) and gives each chunk a round so that for every
device and round

    bytes staged to send + bytes staged to receive <= budget.

Pairwise (every budget but tiny ones): the copies between two devices ``s -> d`` are laid out
in one order both know (state group, key, offset) and cut into rounds of at most
``A = e + (budget - 2 * (n - 1) * e) * W / M`` staging bytes, where ``W`` is the pair's data
bytes, ``M`` the larger of the two devices' load bounds (``plan.device_bound``: what a device
can send plus what it receives, known without planning its peers), ``n`` the number of devices
and ``e`` the staging of one element. A device has at most ``n - 1`` peers each way and its
pairs' ``W`` add up to at most its bound, so its rounds stay within the budget; a pair's rounds
follow from the pair alone, so each device schedules its own pairs and gets the same rounds as
the whole plan (``vps.device_plan``). Every pair spreads over about ``M / budget`` rounds, the
busiest devices keep their links busy in every round.

Greedy (budgets under ``4 * (n - 1) * e``, where the pairs cannot all move an element per round):
each chunk goes in the first round where both its devices still have room, in plan order.

Each round is executed as one batched P2P group or one all-to-all, so no ordering of messages
can deadlock. ``last_read`` says after which round each old local tensor is no longer read,
so an executor may free it then (local copies run before round 0: their reads count as -1).
Staging sizes include the alignment the executor uses between slices (``ALIGN`` bytes).
Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from liveshard.runtime.errors import ConfigError
from liveshard.runtime.vps.region import Shape, flat_range_to_boxes, volume

if TYPE_CHECKING:
    from liveshard.runtime.vps.plan_view import TransitionPlanView

ALIGN = 16  # bytes; every slice in a staging buffer starts at a multiple of this
DEFAULT_BUDGET = 1 << 30  # 1 GiB of staging per device
CHUNKS_PER_BUDGET = 8  # pieces are split into chunks of at most budget / 8


class Chunk(NamedTuple):
    copy: int  # index into plan.copies
    offset: Shape  # start inside the copy's piece (local dims)
    shape: Shape
    nbytes: int  # data bytes, all states
    staging: int  # staging bytes, all states, aligned
    round: int


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def staging_bytes(numel: int, itemsizes: tuple[int, ...]) -> int:
    total = 0
    for s in itemsizes:
        total += -(-(numel * s) // ALIGN) * ALIGN
    return total


@dataclass
class Schedule:
    budget: int
    chunks: list[Chunk]
    rounds: int
    peak_staging: list[int]  # per device
    last_read: dict[tuple[int, int, str], int]  # (device, state group, local name) -> round

    @property
    def peak_staging_bytes(self) -> int:
        return max(self.peak_staging, default=0)

    def for_device(self, device: int, copies) -> list[tuple[dict[int, list[Chunk]], dict[int, list[Chunk]]]]:
        """Per round: (sends by peer, receives by peer), chunks in schedule order on both sides."""
        out: list[tuple[dict[int, list[Chunk]], dict[int, list[Chunk]]]] = [({}, {}) for _ in range(self.rounds)]
        for ch in self.chunks:
            c = copies[ch.copy]
            if c.src == device:
                out[ch.round][0].setdefault(c.dst, []).append(ch)
            elif c.dst == device:
                out[ch.round][1].setdefault(c.src, []).append(ch)
        return out


def element_staging(groups) -> int:
    """Staging bytes of one element of the widest state group: the least a round must hold."""
    return max(staging_bytes(1, g.itemsizes) for g in groups) if groups else ALIGN


def pairwise(num_devices: int, groups, budget: int) -> bool:
    """Whether ``budget`` leaves every pair of devices an element per round (pairwise rounds)."""
    return budget >= 4 * max(num_devices - 1, 1) * element_staging(groups)


def schedule(plan: TransitionPlanView, budget: int = DEFAULT_BUDGET) -> Schedule:
    """Rounds for ``plan``'s network copies, staging at most ``budget`` bytes per device per round."""
    groups = plan.groups
    smallest = element_staging(groups)
    if budget < smallest:
        raise ConfigError("budget", f"{budget} bytes cannot stage even one element of every state "
                                      f"({smallest} bytes with {ALIGN}-byte alignment)",
                          f"give at least {smallest} bytes")
    if pairwise(plan.devices.num_devices, groups, budget):
        return _pairwise(plan, budget)
    return plan.greedy_schedule(budget)  # the whole plan's greedy rounds (one device's part: its slice)


def canonical(c) -> tuple:
    """The order of a pair's copies on both of its devices."""
    return (c.group, c.key, c.offset)


def _pairwise(plan: TransitionPlanView, budget: int) -> Schedule:
    groups = plan.groups
    e = element_staging(groups)
    max_chunk = max(e, budget // CHUNKS_PER_BUDGET)
    share = budget - 2 * max(plan.devices.num_devices - 1, 1) * e
    pairs: dict[tuple[int, int], list[int]] = {}
    last_read: dict[tuple[int, int, str], int] = {}
    copies = plan.copies
    for ci, c in enumerate(copies):
        if c.src == c.dst:
            last_read.setdefault((c.src, c.group, c.src_view[0]), -1)
        else:
            pairs.setdefault((c.src, c.dst), []).append(ci)
    bound = plan.device_bound
    usage: dict[tuple[int, int], int] = {}
    chunks: list[Chunk] = []
    add = chunks.append
    new_chunk = tuple.__new__
    staged: dict[tuple[int, int], int] = {}  # (group, elements) -> staging bytes
    for (src, dst), cis in sorted(pairs.items()):
        cis.sort(key=lambda i: canonical(copies[i]))
        total = sum(copies[i].nbytes for i in cis)
        allowance = e + share * total // max(bound(src), bound(dst))
        r, used = 0, 0
        rounds_used: dict[int, int] = {}
        for ci in cis:
            c = copies[ci]
            g = groups[c.group]
            n = volume(c.shape)
            st = staged.get((c.group, n))
            if st is None:
                st = staged[c.group, n] = staging_bytes(n, g.itemsizes)
            room = allowance - used
            if st <= room and st <= max_chunk:  # the whole copy in this round (the usual case)
                add(new_chunk(Chunk, (ci, (0,) * len(c.shape), c.shape, c.nbytes, st, r)))
                used += st
                rounds_used[r] = used
            else:
                sizes = g.itemsizes
                pos = 0
                while pos < n:
                    k = _fitting(n - pos, min(allowance - used, max_chunk), sizes, g.itemsum)
                    if k == 0:
                        r, used = r + 1, 0
                        continue
                    if pos == 0 and k == n:
                        off, shp = (0,) * len(c.shape), c.shape
                    else:
                        off, shp = flat_range_to_boxes(c.shape, pos, pos + k)[0]
                    numel = volume(shp)
                    cst = staging_bytes(numel, sizes)
                    add(new_chunk(Chunk, (ci, off, shp, numel * g.itemsum, cst, r)))
                    used += cst
                    rounds_used[r] = used
                    pos += numel
            key = (src, c.group, c.src_view[0])
            if last_read.get(key, -1) < r:
                last_read[key] = r
        for rr, u in rounds_used.items():
            for dev in (src, dst):
                usage[dev, rr] = usage.get((dev, rr), 0) + u
    peak = [0] * plan.devices.num_devices
    for (dev, _), u in usage.items():
        if u > peak[dev]:
            peak[dev] = u
    own = plan.device
    if own is not None:  # one device's plan: its peers' figures here would be partial
        peak = [u if dev == own else 0 for dev, u in enumerate(peak)]
        last_read = {k: v for k, v in last_read.items() if k[0] == own}
    rounds = max((ch.round for ch in chunks), default=-1) + 1
    return Schedule(budget, chunks, rounds, peak, last_read)


def _fitting(remaining: int, limit: int, itemsizes: tuple[int, ...], itemsum: int) -> int:
    """The most elements, up to ``remaining``, whose staging fits ``limit`` bytes."""
    k = min(remaining, limit // itemsum)  # staging is at least the data; alignment adds < 16 per state
    while k > 0 and staging_bytes(k, itemsizes) > limit:
        k -= 1
    return k


def greedy_rounds(plan: TransitionPlanView, budget: int) -> Schedule:
    groups = plan.groups
    smallest = element_staging(groups)
    max_chunk = max(smallest, budget // CHUNKS_PER_BUDGET)
    per_elem = [max(1, (max_chunk - ALIGN * len(g.itemsizes)) // g.itemsum) for g in groups]
    # a round stays open for a device while it has room for the largest chunk
    max_staging = max(staging_bytes(n, g.itemsizes) for n, g in zip(per_elem, groups))

    n = plan.devices.num_devices
    usage: list[list[int]] = [[] for _ in range(n)]
    nxt: list[list[int]] = [[] for _ in range(n)]  # union-find "next open round" per device
    chunks: list[Chunk] = []
    last_read: dict[tuple[int, int, str], int] = {}
    for ci, c in enumerate(plan.copies):
        if c.src == c.dst:
            key = (c.src, c.group, c.src_view[0])
            last_read.setdefault(key, -1)
            continue
        g = groups[c.group]
        total = volume(c.shape)
        if staging_bytes(total, g.itemsizes) <= max_chunk:
            pieces: list[tuple[Shape, Shape]] = [((0,) * len(c.shape), c.shape)]
        else:
            step = per_elem[c.group]
            pieces = []
            for start in range(0, total, step):
                pieces.extend(flat_range_to_boxes(c.shape, start, min(start + step, total)))
        ns, nd = nxt[c.src], nxt[c.dst]
        us, ud = usage[c.src], usage[c.dst]
        key = (c.src, c.group, c.src_view[0])
        for off, shp in pieces:
            numel = volume(shp)
            st = staging_bytes(numel, g.itemsizes)
            r = _open(ns, 0)
            while True:  # the first round open on both sides
                r2 = _open(nd, r)
                if r2 == r:
                    break
                r = _open(ns, r2)
            for u, nx in ((us, ns), (ud, nd)):
                while len(u) <= r:
                    nx.append(len(u))
                    u.append(0)
                u[r] += st
                if u[r] + max_staging > budget:
                    nx[r] = r + 1
            chunks.append(Chunk(ci, off, shp, numel * g.itemsum, st, r))
            if last_read.get(key, -1) < r:
                last_read[key] = r
    rounds = max((len(u) for u in usage), default=0)
    return Schedule(budget, chunks, rounds, [max(u, default=0) for u in usage], last_read)


def _open(nxt: list[int], r: int) -> int:
    """First round >= r still open (rounds past the end are empty), with path compression."""
    root = r
    while root < len(nxt) and nxt[root] != root:
        root = nxt[root]
    while r < len(nxt) and nxt[r] != r:
        nxt[r], r = root, nxt[r]
    return root
