"""Rounds of a transition under a per-device staging budget.

A network copy is packed by its source into a staging buffer (one per peer per round) and
unpacked by its destination from one. ``schedule(plan, budget)`` splits copies into chunks
(row-major flat ranges of the piece, as boxes) and puts each chunk in the first round where both
its source and its destination still have room, so that for every device and round

    bytes staged to send + bytes staged to receive <= budget.

Each round is executed as one batched P2P group or one all-to-all, so no ordering of messages
can deadlock. ``last_read`` says after which round each old local tensor is no longer read,
so an executor may free it then (local copies run before round 0: their reads count as -1).
Staging sizes include the alignment the executor uses between slices (``ALIGN`` bytes).
Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from liveshard.runtime.errors import ConfigError
from liveshard.runtime.vps.region import Shape, flat_range_to_boxes, volume

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
    return sum(aligned(numel * s) for s in itemsizes)


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


def schedule(plan, budget: int = DEFAULT_BUDGET) -> Schedule:
    """Rounds for ``plan``'s network copies, staging at most ``budget`` bytes per device per round."""
    groups = plan.groups
    smallest = max(staging_bytes(1, g.itemsizes) for g in groups) if groups else ALIGN
    if budget < smallest:
        raise ConfigError("budget", f"{budget} bytes cannot stage even one element of every state "
                                      f"({smallest} bytes with {ALIGN}-byte alignment)",
                          f"give at least {smallest} bytes")
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
