"""Regions: axis-aligned boxes of logical tensors, and the geometry on them.

A ``Region`` says: rank R holds the box ``[global_offset, global_offset + box_shape)`` of logical
tensor ``key`` (state ``state``), stored in its local tensor ``local_name`` starting at
``local_offset``. Field names follow megatron-core's ``ShardedTensor`` (``global_shape``,
``global_offset``, ``local_shape``; prepended layer/expert axes are in ``global_*`` only).
Pure: no torch.
"""

from __future__ import annotations

from typing import NamedTuple

Shape = tuple[int, ...]

# Training-state kinds. "param" is the model weight (params_dtype); the rest are fp32 optimizer
# state: main weights (only when params are 16-bit) and Adam's two moments.
PARAM = "param"
MAIN_PARAM = "main_param"
EXP_AVG = "exp_avg"
EXP_AVG_SQ = "exp_avg_sq"
OPTIMIZER_STATES = (MAIN_PARAM, EXP_AVG, EXP_AVG_SQ)


class Region(NamedTuple):
    rank: int
    key: str
    state: str
    global_shape: Shape
    global_offset: Shape
    local_shape: Shape
    primary: bool
    # Where the box lives on the rank: the local tensor's name (megatron parameter name, local
    # layer numbering) and the box's start inside it. For a distributed-optimizer shard the
    # local tensor is the flat shard of that parameter and the offset is one flat index.
    local_name: str
    local_offset: Shape

    @property
    def box_shape(self) -> Shape:
        """The box in global coordinates: prepended axes have extent 1."""
        return (1,) * (len(self.global_shape) - len(self.local_shape)) + self.local_shape

    @property
    def numel(self) -> int:
        return volume(self.local_shape)

    def as_row(self) -> dict:
        return {
            "rank": self.rank,
            "key": self.key,
            "state": self.state,
            "global_shape": list(self.global_shape),
            "global_offset": list(self.global_offset),
            "local_shape": list(self.local_shape),
            "primary": self.primary,
        }


def volume(shape: Shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def intersect(off_a: Shape, shape_a: Shape, off_b: Shape, shape_b: Shape) -> tuple[Shape, Shape] | None:
    """The common box of two boxes (offset, shape), or None if they do not overlap."""
    lo: list[int] = []
    ext: list[int] = []
    for oa, sa, ob, sb in zip(off_a, shape_a, off_b, shape_b, strict=True):
        start = oa if oa > ob else ob
        stop = min(oa + sa, ob + sb)
        if stop <= start:
            return None
        lo.append(start)
        ext.append(stop - start)
    return tuple(lo), tuple(ext)


def flat_range_to_boxes(shape: Shape, start: int, stop: int) -> list[tuple[Shape, Shape]]:
    """Decompose the row-major flat range ``[start, stop)`` of a tensor into boxes.

    Each returned (offset, shape) box is contiguous in the flat order, and together they cover
    the range exactly in order. At most ``2 * ndim - 1`` boxes.
    """
    if start >= stop:
        return []
    if len(shape) == 0:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = volume(shape[1:])
    out: list[tuple[Shape, Shape]] = []
    row0, col0 = divmod(start, inner)
    row1, col1 = divmod(stop, inner)
    if row0 == row1:  # within one row: recurse into it
        for off, shp in flat_range_to_boxes(shape[1:], col0, col1):
            out.append(((row0, *off), (1, *shp)))
        return out
    if col0:
        for off, shp in flat_range_to_boxes(shape[1:], col0, inner):
            out.append(((row0, *off), (1, *shp)))
        row0 += 1
    if row1 > row0:
        out.append(((row0,) + (0,) * (len(shape) - 1), (row1 - row0, *shape[1:])))
    if col1:
        for off, shp in flat_range_to_boxes(shape[1:], 0, col1):
            out.append(((row1, *off), (1, *shp)))
    return out
