"""Distinct boxes of a layout, with everyone who holds each, and a fast overlap index.

A layout lists regions per rank; a transition needs the transpose: for each distinct box of a
logical tensor, which ranks hold it and where in their local tensors. Two geometries exist per
layout: ``"param"`` (whole local tensors: model weights, and optimizer state without the
distributed optimizer) and ``"dopt"`` (distributed-optimizer shards). Every optimizer state of a
layout shares one geometry, so boxes are computed once per geometry, not per state.

Ranks with the same (pp, tp, ep, etp) coordinate hold the same parameter boxes at the same local
positions, so the ``"param"`` geometry is built from one representative rank per such class:
at 1024 GPUs that is 64 ranks' worth of regions, not 1024.
Pure: no torch.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from liveshard.runtime.vps.layout import Layout
from liveshard.runtime.vps.region import PARAM, Shape, intersect

PARAM_GEOMETRY = "param"
DOPT_GEOMETRY = "dopt"

# Where a box lives on a holder: (local tensor name, region local_offset, region local_shape).
View = tuple[str, Shape, Shape]


@dataclass(eq=False)
class Box:
    """One distinct box of logical tensor ``key`` and the ranks holding it."""

    key: str
    offset: Shape  # global offset (all dims, prepended layer/expert axes included)
    shape: Shape  # box extent in global dims (prepended axes have extent 1)
    npre: int  # number of prepended axes
    # (class id, ranks, view): ranks of one class hold the box at the same local position
    groups: list[tuple[int, tuple[int, ...], View]] = field(default_factory=list)
    _views: dict[int, View] | None = None
    # its holders that hold old state under the device map being planned (``transition``)
    sources: tuple[int, ...] | None = None

    @property
    def local_shape(self) -> Shape:
        return self.shape[self.npre:]

    def views(self) -> dict[int, View]:
        """rank -> view; one entry per holder."""
        if self._views is None:
            self._views = {r: v for _, ranks, v in self.groups for r in ranks}
        return self._views


def geometry_of(layout: Layout, state: str) -> str:
    return DOPT_GEOMETRY if state != PARAM and layout.cfg.dist_opt else PARAM_GEOMETRY


@dataclass
class Geometry:
    """All distinct boxes of one layout geometry, per key, and its rank classes."""

    boxes: dict[str, dict[tuple[Shape, Shape], Box]]
    class_members: list[tuple[int, ...]]  # class id -> ranks
    rank_class: list[int]  # rank -> class id of its parameter class
    singleton_base: int  # class id of rank r's own class is singleton_base + r (dopt boxes)

    def index(self, key: str) -> BoxIndex:
        return BoxIndex(list(self.boxes.get(key, {}).values()))


def param_classes(layout: Layout) -> tuple[list[tuple[int, ...]], list[int]]:
    """Ranks grouped by (pp, tp, ep, etp): each group holds identical parameter boxes."""
    cfg = layout.cfg
    by_coord: dict[tuple[int, int, int, int], list[int]] = {}
    for r in range(cfg.world_size):
        c = cfg.coord(r)
        by_coord.setdefault((c.pp, c.tp, c.ep, c.etp), []).append(r)
    members = [tuple(v) for v in by_coord.values()]
    rank_class = [0] * cfg.world_size
    for cid, ranks in enumerate(members):
        for r in ranks:
            rank_class[r] = cid
    return members, rank_class


def build_geometry(layout: Layout, kind: str) -> Geometry:
    members, rank_class = param_classes(layout)
    base = len(members)
    boxes: dict[str, dict[tuple[Shape, Shape], Box]] = {}
    views: dict[View, View] = {}  # intern: one tuple object per distinct view

    def add(reg, cid: int, ranks: tuple[int, ...]) -> None:
        npre = len(reg.global_shape) - len(reg.local_shape)
        shape = (1,) * npre + reg.local_shape
        per_key = boxes.get(reg.key)
        if per_key is None:
            per_key = boxes[reg.key] = {}
        box = per_key.get((reg.global_offset, shape))
        if box is None:
            box = per_key[reg.global_offset, shape] = Box(reg.key, reg.global_offset, shape, npre)
        v = (reg.local_name, reg.local_offset, reg.local_shape)
        box.groups.append((cid, ranks, views.setdefault(v, v)))

    if kind == PARAM_GEOMETRY:
        for cid, ranks in enumerate(members):
            for reg in layout.param_regions(ranks[0], PARAM):
                add(reg, cid, ranks)
    else:
        state = layout.optimizer_states[0]  # every optimizer state has this geometry
        for r in range(layout.world_size):
            for reg in layout.dist_opt_regions(r, state):
                add(reg, base + r, (r,))
    return Geometry(boxes, members, rank_class, base)


class BoxIndex:
    """Boxes of one key, grouped by their prepended (layer, expert) coordinates and sorted along
    the first local axis, so an overlap query looks only at boxes that can touch."""

    def __init__(self, boxes: list[Box]) -> None:
        groups: dict[Shape, list[Box]] = {}
        for b in boxes:
            groups.setdefault(b.offset[: b.npre], []).append(b)
        self._groups: dict[Shape, tuple[list[int], list[Box]]] = {}
        for pre, bs in groups.items():
            ax = len(pre)
            if ax < len(bs[0].offset):
                bs.sort(key=lambda b: b.offset[ax])
                starts = [b.offset[ax] for b in bs]
            else:
                starts = [0] * len(bs)
            self._groups[pre] = (starts, bs)

    def overlaps(self, box: Box) -> list[tuple[Box, Shape, Shape]]:
        """(other box, common offset, common shape) for every indexed box overlapping ``box``."""
        entry = self._groups.get(box.offset[: box.npre])
        if entry is None:
            return []
        starts, bs = entry
        ax = box.npre
        if ax < len(box.offset):
            stop = bisect_left(starts, box.offset[ax] + box.shape[ax])
        else:
            stop = len(bs)
        out = []
        off, shp = box.offset, box.shape
        for b in bs[:stop]:
            common = intersect(off, shp, b.offset, b.shape)
            if common is not None:
                out.append((b, common[0], common[1]))
        return out
