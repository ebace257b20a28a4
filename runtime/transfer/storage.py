"""Where a rank keeps its shards: a mapping (state, local tensor name) -> tensor.

The executor reads old shards and writes new ones only through a ``LocalShards`` (the runtime
fills one with views of megatron's parameters and optimizer shards; tests, ``reshard-local``
and the benchmarks with reference values). ``view_of`` turns a region's
``(local_name, local_offset, local_shape)`` into a tensor view: a box of the local tensor, or,
for distributed-optimizer shards (a flat tensor), a flat slice reshaped to the box.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from liveshard.runtime.dtypes import torch_dtype
from liveshard.runtime.vps.layout import Layout
from liveshard.runtime.vps.region import Shape, volume
from liveshard.runtime.vps.shards import is_flat, local_tensor_shapes


class LocalShards:
    """One rank's shards, ``tensors[state][local_name] -> tensor`` (not the job's c10d store)."""

    def __init__(self, tensors: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
        self.tensors: dict[str, dict[str, torch.Tensor]] = tensors if tensors is not None else {}

    def get(self, state: str, name: str) -> torch.Tensor:
        return self.tensors[state][name]

    def has(self, state: str, name: str) -> bool:
        return name in self.tensors.get(state, {})

    def release(self, state: str, name: str) -> None:
        self.tensors.get(state, {}).pop(name, None)

    def items(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        for state, per in self.tensors.items():
            for name, t in per.items():
                yield state, name, t

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, _, t in self.items())


def allocate(layout: Layout, rank: int, device: torch.device | str = "cpu") -> LocalShards:
    """Uninitialised tensors for everything ``rank`` holds in ``layout``."""
    shapes = local_tensor_shapes(layout, rank)
    return LocalShards({state: {name: torch.empty(shape, dtype=torch_dtype(layout.dtype(state)), device=device)
                              for name, shape in per.items()}
                      for state, per in shapes.items()})


def view_of(t: torch.Tensor, view: tuple[str, Shape, Shape]) -> torch.Tensor:
    """The region ``view`` = (name, local_offset, local_shape) inside its local tensor ``t``."""
    _, loff, lshape = view
    if not is_flat(loff, lshape) and len(lshape) == t.dim():
        return t[tuple(slice(o, o + s) for o, s in zip(loff, lshape))]
    start = loff[0]
    return t.view(-1)[start:start + volume(lshape)].view(lshape)


def sub_box(v: torch.Tensor, offset: Shape, shape: Shape) -> torch.Tensor:
    return v[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
