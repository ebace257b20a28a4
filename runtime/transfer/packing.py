"""Packing chunks of several tensors into one byte buffer per peer, and back.

A staging buffer is ``uint8``; every (chunk, state) slice starts at a multiple of ``ALIGN`` bytes
and is reinterpreted in place as the state's dtype, so packing is one ``copy_`` from a strided
view of the source tensor and unpacking one ``copy_`` into a strided view of the destination:
no intermediate full copies, any dtype.
"""

from __future__ import annotations

import torch

from liveshard.runtime.dtypes import torch_dtype
from liveshard.runtime.transfer.storage import sub_box, view_of
from liveshard.runtime.vps.schedule import Chunk, aligned

# P2P rounds send a chunk of at least this many staging bytes as messages of its own (one per
# state), straight from the source tensor and into the destination tensor when those views are
# contiguous; smaller chunks to the same peer share one packed buffer. Both sides split the same
# way (it depends on the schedule only), so the messages pair up in order.
DIRECT_MIN_BYTES = 1 << 20


def split_direct(chunks: list[Chunk], min_bytes: int = DIRECT_MIN_BYTES) -> tuple[list[Chunk], list[Chunk]]:
    """(chunks packed into one buffer, chunks sent as messages of their own), in schedule order."""
    packed = [ch for ch in chunks if ch.staging < min_bytes]
    direct = [ch for ch in chunks if ch.staging >= min_bytes]
    return packed, direct


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 view (what goes on the wire)."""
    return t.reshape(-1).view(torch.uint8)


def piece(shards, state: str, view, rel, ch: Chunk) -> torch.Tensor:
    """The view of chunk ``ch`` inside ``shards``' local tensor, for one state."""
    t = shards.get(state, view[0])
    return sub_box(view_of(t, view), tuple(a + b for a, b in zip(rel, ch.offset)), ch.shape)


def slots(chunks: list[Chunk], plan) -> list[list[tuple[int, int]]]:
    """(byte offset, byte length) of each state's slice of each chunk, in buffer order."""
    out = []
    pos = 0
    for ch in chunks:
        g = plan.groups[plan.copies[ch.copy].group]
        numel = 1
        for s in ch.shape:
            numel *= s
        row = []
        for isz in g.itemsizes:
            n = numel * isz
            row.append((pos, n))
            pos += aligned(n)
        out.append(row)
    return out


def buffer_size(chunks: list[Chunk]) -> int:
    return sum(ch.staging for ch in chunks)


def typed(buf: torch.Tensor, offset: int, nbytes: int, dtype: str, shape) -> torch.Tensor:
    return buf[offset:offset + nbytes].view(torch_dtype(dtype)).view(shape)


def pack(buf: torch.Tensor, chunks: list[Chunk], plan, shards) -> None:
    for ch, row in zip(chunks, slots(chunks, plan)):
        c = plan.copies[ch.copy]
        g = plan.groups[c.group]
        for (off, n), state, dtype in zip(row, g.states, g.dtypes):
            typed(buf, off, n, dtype, ch.shape).copy_(piece(shards, state, c.src_view, c.src_rel, ch))


def unpack(buf: torch.Tensor, chunks: list[Chunk], plan, shards) -> None:
    for ch, row in zip(chunks, slots(chunks, plan)):
        c = plan.copies[ch.copy]
        g = plan.groups[c.group]
        for (off, n), state, dtype in zip(row, g.states, g.dtypes):
            piece(shards, state, c.dst_view, c.dst_rel, ch).copy_(typed(buf, off, n, dtype, ch.shape))


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_weights: dict[torch.device, torch.Tensor] = {}


def checksum(t: torch.Tensor) -> int:
    """A position-sensitive 64-bit checksum of ``t``'s bits (swapped elements change it)."""
    bits = t.contiguous().view(_INT_OF_SIZE[t.element_size()]).reshape(-1).to(torch.int64)
    n = bits.numel()
    w = _weights.get(bits.device)
    if w is None or w.numel() < n:
        size = max(n, 1 << 16, 0 if w is None else 2 * w.numel())
        w = (torch.arange(size, dtype=torch.int64, device=bits.device) * 2654435761) % 2147483647 + 1
        _weights[bits.device] = w
    return int(((bits + 0x5BD1E995) * w[:n]).sum())
