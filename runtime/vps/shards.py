"""The local tensors a rank holds in a layout: their names and shapes, per state.

Parameter-geometry regions are boxes of an N-d local tensor (SwiGLU: two boxes stacked on dim
0); distributed-optimizer regions are flat ranges of a 1-d shard (``local_offset`` is then one
flat index while ``local_shape`` is the box). Pure: no torch.
"""

from __future__ import annotations

from liveshard.runtime.vps.layout import Layout
from liveshard.runtime.vps.region import Shape, volume


def is_flat(local_offset: Shape, local_shape: Shape) -> bool:
    """Whether a region lives in a flat (1-d) shard rather than in a box of an N-d tensor."""
    return len(local_offset) != len(local_shape)


def local_tensor_shapes(layout: Layout, rank: int, states: tuple[str, ...] | None = None) -> dict[str, dict[str, Shape]]:
    """state -> local tensor name -> shape, for everything ``rank`` holds in ``layout``."""
    out: dict[str, dict[str, Shape]] = {}
    for state in layout.states if states is None else states:
        extents: dict[str, Shape] = {}
        flat: set[str] = set()
        for reg in layout.regions(rank, (state,)):
            loff, lshape = reg.local_offset, reg.local_shape
            if is_flat(loff, lshape):
                flat.add(reg.local_name)
                end: Shape = (loff[0] + volume(lshape),)
            else:
                end = (loff[0] + lshape[0], *lshape[1:])
            prev = extents.get(reg.local_name)
            extents[reg.local_name] = end if prev is None or prev[0] < end[0] else prev
        for name in flat:
            extents[name] = (extents[name][0],)
        out[state] = extents
    return out
