"""Deterministic reference values for every element of every logical tensor.

``reference_box`` computes the values of any box of a logical tensor from the tensor's key,
state and each element's global flat index (a 64-bit mix of the index and a per-(key, state)
seed), so any rank can fill or check any shard without ever materialising the full tensor.
Every element differs from its neighbours, so a misplaced element is caught bit for bit.
Used by ``reshard-local``, the tests and the benchmarks.
"""

from __future__ import annotations

import hashlib

import torch

from liveshard.runtime.dtypes import torch_dtype
from liveshard.runtime.transfer.storage import LocalShards, allocate, view_of
from liveshard.runtime.vps.layout import Layout
from liveshard.runtime.vps.region import Shape

_MUL1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed 64-bit integer
_MUL2 = -4658895280553007687  # 0xBF58476D1CE4E5B9


def _seed(key: str, state: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{key}/{state}".encode()).digest()[:7], "little")


def reference_box(key: str, state: str, global_shape: Shape, offset: Shape, box_shape: Shape,
                  dtype: str) -> torch.Tensor:
    """Values of box ``[offset, offset + box_shape)`` (global dims), returned with the box's shape."""
    stride = 1
    idx = torch.zeros((), dtype=torch.int64)
    shape_nd = len(global_shape)
    for ax in range(shape_nd - 1, -1, -1):
        r = torch.arange(offset[ax], offset[ax] + box_shape[ax], dtype=torch.int64) * stride
        idx = idx + r.view((-1,) + (1,) * (shape_nd - 1 - ax))
        stride *= global_shape[ax]
    x = (idx + _seed(key, state)) * _MUL1
    x = x ^ ((x >> 29) & ((1 << 35) - 1))
    x = x * _MUL2
    x = x ^ ((x >> 32) & ((1 << 32) - 1))
    vals = ((x >> 8) & 0xFFFFFF).to(torch.float32) / float(1 << 23) - 1.0
    return vals.to(torch_dtype(dtype))


def fill_reference(layout: Layout, rank: int, device: torch.device | str = "cpu") -> LocalShards:
    """``rank``'s shards in ``layout``, every element set to its reference value."""
    shards = allocate(layout, rank, device)
    for reg in layout.regions(rank):
        v = view_of(shards.get(reg.state, reg.local_name), (reg.local_name, reg.local_offset, reg.local_shape))
        ref = reference_box(reg.key, reg.state, reg.global_shape, reg.global_offset, reg.box_shape,
                            layout.dtype(reg.state))
        v.copy_(ref.view(reg.local_shape))
    return shards


def check_reference(layout: Layout, rank: int, shards: LocalShards) -> list[str]:
    """Regions of ``rank`` whose values differ bit for bit from the reference (empty: all match)."""
    bad: list[str] = []
    for reg in layout.regions(rank):
        try:
            t = shards.get(reg.state, reg.local_name)
        except KeyError:
            bad.append(f"{reg.state} {reg.local_name}: missing")
            continue
        v = view_of(t, (reg.local_name, reg.local_offset, reg.local_shape))
        ref = reference_box(reg.key, reg.state, reg.global_shape, reg.global_offset, reg.box_shape,
                            layout.dtype(reg.state)).view(reg.local_shape).to(v.device)
        if v.dtype != ref.dtype or not torch.equal(_bits(v), _bits(ref)):
            bad.append(f"{reg.state} {reg.key} at {list(reg.global_offset)} ({reg.local_name})")
    return bad


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
