"""The two layouts' overlap by holder class, from the stage templates, without listing every box.

``transition.overlap_figures`` needs, for every pair of holder classes (``mapping``), the bytes
their boxes share: the parameter classes' (pp, tp, ep, etp) parameter boxes, and each rank's
distributed-optimizer shard boxes. Listing every box of both layouts (``boxes.build_geometry``,
every rank's shards) and intersecting them takes seconds at a thousand GPUs; a stage's ranks
differ only by whole-piece shifts of its template's boxes (``locate``), so one pass over each
stage template's parameters and shard portions gives the same figures:

* **flat ranges**, for the parameters both layouts split alike (``alike``): dense ones when the
  TP degrees are equal, expert ones when the expert-TP degrees are (pipeline, data, context and
  expert parallelism may differ: a node leaving or joining usually changes only those). Such a
  parameter's local tensor is one of the same local tensors in both layouts (the same global
  pieces in the same local rows): two parameter classes share its whole tensor or none of it,
  and two optimizer shards of it share the elements where their flat ranges ``[a, b)`` inside it
  meet (``locate.Side.rank_portions`` uses the same arithmetic). No boxes.
* **template boxes**, for the others: each parameter's boxes (its shard boxes from
  ``locate.Side.shard_regions``, shifted) against the other layout's boxes of the same parameter
  (layer, expert) only.

``class_overlap`` returns None where neither applies (a state group changes geometry, or a
distributed-optimizer layout keeps a parameter's shards on two stages); the caller then
intersects every box. Equal, figure for figure, to the box intersection
(tests/unit/test_overlap_fast.py). Pure: no torch.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict

from liveshard.runtime.vps.boxes import DOPT_GEOMETRY, PARAM_GEOMETRY, param_classes
from liveshard.runtime.vps.layout import Layout, LocalParam
from liveshard.runtime.vps.locate import LAYER_PREFIX, Side, index_of, split_count
from liveshard.runtime.vps.region import intersect, volume

ALL = frozenset((False, True))  # parameter kinds: expert or not


def alike(old: Layout, new: Layout) -> frozenset[bool]:
    """The parameter kinds (expert or not) the two layouts split alike: dense ones with equal TP
    degrees, expert ones with equal expert-TP degrees; their overlap comes from flat ranges."""
    a, b = old.cfg, new.cfg
    out = set()
    if a.tp == b.tp:
        out.add(False)
    if a.expert_tp == b.expert_tp:  # an expert's local tensor does not depend on the EP degree
        out.add(True)
    return frozenset(out)


class _Placements:
    """A layout's template parameters placed on every split and EP index, each with a signature
    shared with the other layout's and its holders.

    A signature is (``template_id``, suffix). With equal EP degrees the suffix is the split index
    and the EP indices go together (each moves a parameter by the same whole expert blocks in
    both layouts): one signature per split index, holders per EP index. With ``spread_experts``
    (the EP degrees differ, expert-TP alike) an expert parameter's template id leaves out which
    expert it is, and the suffix is (split index, global expert): one EP index per signature."""

    def __init__(self, layout: Layout, interner: dict, spread_experts: bool = False) -> None:
        self.layout = layout
        self.ix = index_of(layout)
        self._ids = interner
        self.spread = spread_experts
        self._tsig: dict[int, int] = {}
        self._holders: dict[tuple, list[tuple[object, tuple[tuple[int, ...], ...]]]] = {}

    def template_id(self, p: LocalParam) -> int:
        """The template parameter's local tensor (key, pieces, local shape) as a number both
        layouts share: with alike splits, equal numbers moved alike (``locate.Side.shift``) are
        equal local tensors."""
        hit = self._tsig.get(id(p))
        if hit is None:
            if self.spread and p.expert:  # the expert is in the suffix
                pieces = tuple(((pc.global_offset[0], 0, *pc.global_offset[2:]), pc.local_row) for pc in p.pieces)
            else:
                pieces = tuple((pc.global_offset, pc.local_row) for pc in p.pieces)
            hit = self._tsig[id(p)] = self._ids.setdefault((p.key, pieces, p.local_shape), len(self._ids))
        return hit

    def placed(self, geometry: str, stage: int, p: LocalParam, shard: int,
               ) -> list[tuple[object, tuple[tuple[int, ...], ...]]]:
        """(signature suffix, holder ranks at each EP index of the signature) of every placement
        of ``p`` at ``stage`` (in the optimizer geometry: of shard ``shard``)."""
        spread = self.spread and p.expert
        first = p.pieces[0].global_offset[1] if spread else 0
        k = (geometry, stage, p.expert, p.split_axis is not None, shard, first)
        hit = self._holders.get(k)
        if hit is None:
            cfg = self.layout.cfg
            splits = range(split_count(cfg, p))
            if spread:
                per = self.ix.local_experts
                hit = [((idx, first + ep * per), (tuple(self.ix.holders(geometry, stage, p, idx, ep, shard)),))
                       for ep in range(cfg.ep) for idx in splits]
            else:
                eps = range(cfg.ep) if p.expert else (0,)
                hit = [(idx, tuple(tuple(self.ix.holders(geometry, stage, p, idx, ep, shard)) for ep in eps))
                       for idx in splits]
            self._holders[k] = hit
        return hit


def _param_sides(pl: _Placements, rank_class: list[int], kinds: frozenset[bool]) -> dict[tuple, tuple[int, tuple[frozenset[int], ...]]]:
    """signature -> (elements, the parameter classes holding it at each EP index)."""
    out: dict[tuple, tuple[int, tuple[frozenset[int], ...]]] = {}
    classes_of: dict[tuple, tuple[frozenset[int], ...]] = {}
    for stage in range(pl.layout.cfg.pp):
        t = pl.ix.template(stage)
        for p in t.params:
            if p.expert not in kinds:
                continue
            tid = pl.template_id(p)
            numel = p.numel
            for suffix, per_ep in pl.placed(PARAM_GEOMETRY, stage, p, 0):
                classes = classes_of.get(per_ep)
                if classes is None:
                    classes = classes_of[per_ep] = tuple(frozenset(rank_class[r] for r in hs) for hs in per_ep)
                sig = (tid, suffix)
                hit = out.get(sig)
                if hit is None:
                    out[sig] = (numel, classes)
                else:  # held by two stages
                    out[sig] = (numel, tuple(a | b for a, b in zip(hit[1], classes)))
    return out


def _shard_sides(pl: _Placements, kinds: frozenset[bool]) -> dict[tuple, dict[int, list]]:
    """signature -> stage -> [(start, stop, holder ranks at each EP index)] of its optimizer
    shard portions, in flat order (one stage's portions of a local tensor never meet)."""
    out: dict[tuple, dict[int, list]] = {}
    for stage in range(pl.layout.cfg.pp):
        t = pl.ix.template(stage)
        for expert, (buf, _) in sorted(t.buffers.items()):
            if expert not in kinds:
                continue
            for j in range(buf.dp_size):
                for p, a, b in t.portions(expert, j):
                    tid = pl.template_id(p)
                    for suffix, holders in pl.placed(DOPT_GEOMETRY, stage, p, j):
                        by_stage = out.get((tid, suffix))
                        if by_stage is None:
                            by_stage = out[tid, suffix] = {}
                        xs = by_stage.get(stage)
                        if xs is None:
                            by_stage[stage] = [(a, b, holders)]
                        else:
                            xs.append((a, b, holders))
    return out


def _meet(xs: list, ys: list, acc: dict) -> None:
    """Add ``|[a, b) & [c, d)|`` to ``acc[(holders x, holders y)]`` for every meeting pair of two
    sorted lists of disjoint ranges."""
    i = j = 0
    while i < len(xs) and j < len(ys):
        a, b, hx = xs[i]
        c, d, hy = ys[j]
        lo, hi = max(a, c), min(b, d)
        if lo < hi:
            acc[hx, hy] += hi - lo
        if b <= d:
            i += 1
        else:
            j += 1


def class_overlap(old: Layout, new: Layout, groups) -> dict[tuple[int, int], int] | None:
    """``(new class, old class) -> bytes in common`` as ``transition`` intersects boxes for it
    (class ids as ``boxes.Geometry``: parameter classes, then one per rank for optimizer shards),
    or None where neither stage-template path applies (a state group changes geometry, or a
    distributed-optimizer layout has a parameter two stages hold): the caller intersects every box."""
    if any(g.old_geometry != g.new_geometry for g in groups) or _shared_shards(old) or _shared_shards(new):
        return None
    ranges = alike(old, new)
    out = _range_overlap(old, new, groups, ranges) if ranges else None
    if out is None:
        return _box_overlap(old, new, groups, ALL)
    if ranges != ALL:  # the other parameters (dense or expert) box by box
        for k, v in _box_overlap(old, new, groups, ALL - ranges).items():
            out[k] += v
    return out


def _shared_shards(layout: Layout) -> bool:
    """Whether a distributed-optimizer layout keeps shards of a parameter on two stages (tied
    embeddings): their boxes partly overlap, which box intersection handles its own way."""
    if not layout.cfg.dist_opt or layout.cfg.pp == 1:
        return False
    ix = index_of(layout)
    keys = {p.key for stage in (0, layout.cfg.pp - 1) for p in ix.template(stage).params}
    return any(not k.startswith(LAYER_PREFIX) and len(ix.key_stages(k)) > 1 for k in keys)


def _range_overlap(old: Layout, new: Layout, groups, kinds: frozenset[bool]) -> dict[tuple[int, int], int] | None:
    """``class_overlap`` of the parameters of ``kinds`` (expert or not) from flat ranges: the
    layouts split them alike."""
    param_bytes = sum(g.itemsum for g in groups if g.old_geometry == PARAM_GEOMETRY)
    shard_bytes = sum(g.itemsum for g in groups if g.old_geometry == DOPT_GEOMETRY)
    old_members, old_class = param_classes(old)
    new_members, new_class = param_classes(new)
    interner: dict = {}
    spread = old.cfg.ep != new.cfg.ep
    po, pn = _Placements(old, interner, spread), _Placements(new, interner, spread)
    overlap: dict[tuple[int, int], int] = defaultdict(int)
    if param_bytes:
        olds, news = _param_sides(po, old_class, kinds), _param_sides(pn, new_class, kinds)
        if olds.keys() != news.keys():
            return None
        by_eps: dict[tuple, int] = defaultdict(int)
        for sig, (numel, per_ep) in news.items():
            by_eps[per_ep, olds[sig][1]] += numel
        by_sets: dict[tuple[frozenset[int], frozenset[int]], int] = defaultdict(int)
        for (new_eps, old_eps), numel in by_eps.items():
            for cn, co in zip(new_eps, old_eps):
                by_sets[cn, co] += numel
        for (cns, cos), numel in by_sets.items():
            w = numel * param_bytes
            for a in cns:
                for b in cos:
                    overlap[a, b] += w
    if shard_bytes:
        olds_s, news_s = _shard_sides(po, kinds), _shard_sides(pn, kinds)
        if olds_s.keys() != news_s.keys():
            return None
        acc: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = defaultdict(int)
        for sig, by_stage in news_s.items():
            other = olds_s[sig]
            for xs in by_stage.values():
                for ys in other.values():
                    _meet(xs, ys, acc)
        nb, ob = len(new_members), len(old_members)
        by_holders: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = defaultdict(int)
        for (hn_ep, ho_ep), n in acc.items():
            for hn, ho in zip(hn_ep, ho_ep):
                by_holders[hn, ho] += n
        for (hn, ho), n in by_holders.items():
            w = n * shard_bytes
            for r in hn:
                for d in ho:
                    overlap[nb + r, ob + d] += w
    return overlap


def _box_overlap(old: Layout, new: Layout, groups, kinds: frozenset[bool]) -> dict[tuple[int, int], int]:
    """``class_overlap`` box by box, a parameter's boxes against the other layout's boxes of the
    same parameter (layer, expert) only, each box found from its stage template (``locate``)."""
    param_bytes = sum(g.itemsum for g in groups if g.old_geometry == PARAM_GEOMETRY)
    shard_bytes = sum(g.itemsum for g in groups if g.old_geometry == DOPT_GEOMETRY)
    old_members, old_class = param_classes(old)
    new_members, new_class = param_classes(new)
    overlap: dict[tuple[int, int], int] = defaultdict(int)
    if param_bytes:
        acc = _meet_boxes(_param_boxes(new, new_class, kinds), _param_boxes(old, old_class, kinds))
        for (cns, cos), n in acc.items():
            w = n * param_bytes
            for a in cns:
                for b in cos:
                    overlap[a, b] += w
    if shard_bytes:
        acc = _meet_boxes(_shard_boxes(new, kinds), _shard_boxes(old, kinds))
        nb, ob = len(new_members), len(old_members)
        for (hn, ho), n in acc.items():
            w = n * shard_bytes
            for r in hn:
                for d in ho:
                    overlap[nb + r, ob + d] += w
    return overlap


def _meet_boxes(news: dict, olds: dict) -> dict[tuple, int]:
    """(new holders, old holders) -> elements in common, over the boxes of each parameter. Boxes
    of one parameter share their prepended (layer, expert) coordinates; the old ones are sorted
    along the first local axis, so a new box looks only at those that can reach it."""
    acc: dict[tuple, int] = defaultdict(int)
    for inst, nboxes in news.items():
        oboxes = olds.get(inst)
        if not oboxes:
            continue
        ax = len(inst[1])  # the first local axis
        if ax >= len(oboxes[0][0]):
            for noff, nshape, hn in nboxes:
                for ooff, oshape, ho in oboxes:
                    common = intersect(noff, nshape, ooff, oshape)
                    if common is not None:
                        acc[hn, ho] += volume(common[1])
            continue
        oboxes = sorted(oboxes, key=lambda b: b[0][ax])
        starts = [b[0][ax] for b in oboxes]
        reach = max(b[1][ax] for b in oboxes)  # no old box is longer along the axis
        for noff, nshape, hn in nboxes:
            lo = bisect_right(starts, noff[ax] - reach)
            hi = bisect_left(starts, noff[ax] + nshape[ax])
            for ooff, oshape, ho in oboxes[lo:hi]:
                common = intersect(noff, nshape, ooff, oshape)
                if common is not None:
                    acc[hn, ho] += volume(common[1])
    return acc


def _param_boxes(layout: Layout, rank_class: list[int], kinds: frozenset[bool]) -> dict[tuple, list]:
    """(key, layer [, expert]) -> [(offset, shape, the parameter classes holding the box)]."""
    ix = index_of(layout)
    side = Side(layout, PARAM_GEOMETRY)
    cfg = layout.cfg
    out: dict[tuple, list] = {}
    classes_of: dict[tuple[int, ...], tuple[int, ...]] = {}
    for stage in range(cfg.pp):
        for p in ix.template(stage).params:
            if p.expert not in kinds:
                continue
            npre = len(p.global_shape) - len(p.local_shape)
            shape = (1,) * npre + (p.piece_rows, *p.local_shape[1:])
            for ep in (range(cfg.ep) if p.expert else (0,)):
                for idx in range(split_count(cfg, p)):
                    hs = tuple(ix.holders(PARAM_GEOMETRY, stage, p, idx, ep, 0))
                    classes = classes_of.get(hs)
                    if classes is None:
                        classes = classes_of[hs] = tuple(sorted({rank_class[r] for r in hs}))
                    add = side.shift(p, idx, ep)
                    for pc in p.pieces:
                        off = pc.global_offset if add is None else tuple(o + x for o, x in zip(pc.global_offset, add))
                        out.setdefault((p.key, off[:npre]), []).append((off, shape, classes))
    return out


def _shard_boxes(layout: Layout, kinds: frozenset[bool]) -> dict[tuple, list]:
    """(key, layer [, expert]) -> [(offset, shape, holder ranks)] of the optimizer shards' boxes."""
    ix = index_of(layout)
    side = Side(layout, DOPT_GEOMETRY)
    cfg = layout.cfg
    out: dict[tuple, list] = {}
    for stage in range(cfg.pp):
        t = ix.template(stage)
        for expert, (buf, _) in sorted(t.buffers.items()):
            if expert not in kinds:
                continue
            for j in range(buf.dp_size):
                for p, a, b in t.portions(expert, j):
                    npre = len(p.global_shape) - len(p.local_shape)
                    regions = side.shard_regions(stage, p, a, b)
                    for ep in (range(cfg.ep) if p.expert else (0,)):
                        for idx in range(split_count(cfg, p)):
                            hs = tuple(ix.holders(DOPT_GEOMETRY, stage, p, idx, ep, j))
                            add = side.shift(p, idx, ep)
                            for off, shape, _ in regions:
                                if add is not None:
                                    off = tuple(o + x for o, x in zip(off, add))
                                out.setdefault((p.key, off[:npre]), []).append((off, shape, hs))
    return out
