"""Boxes of one layout geometry around a query, with all their holders, without the whole layout.

``boxes.build_geometry`` lists every distinct box of a layout; planning one device needs only the
boxes that touch its own. ``Side(layout, geometry)`` answers

* ``overlapping(key, offset, shape)``: every box of ``key`` that overlaps the query;
* ``rank_boxes(rank)``: the boxes a rank holds;
* ``holder_boxes(holders)``: every box held by exactly that set of ranks (a pool's boxes);

each as a ``boxes.Box`` whose views list every holder, exactly as ``build_geometry`` would; and,
lighter, a rank's boxes as tuples (``rank_pieces``), its optimizer shards as flat ranges of
parameters (``rank_portions``), its holder sets (``rank_holder_sets``) and how many ranks hold
each element of a key (``nrep``).

How: the ranks of one pipeline stage differ only by their (expert-)TP and EP coordinates, and
those move a parameter's pieces by whole piece extents (``LocalParam.split_axis``) and its
experts by whole expert blocks, under the same local names; a distributed-optimizer shard is a
DP rank's slice of the stage's buffer, whose index arithmetic does not depend on those
coordinates either. So stage ``p``'s rank with coordinates 0 (its *template*) and arithmetic on
its parameters give any rank's boxes, and which ranks hold a box is a coordinate condition
(same stage and TP index, or same stage, EP and expert-TP index, ... and for a shard the DP
index). Building one template costs what building one rank's parameters does.
Pure: no torch.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from liveshard.runtime.vps.boxes import DOPT_GEOMETRY, Box, View
from liveshard.runtime.vps.layout import GradBuffer, Layout, LocalParam, flat_regions
from liveshard.runtime.vps.region import PARAM, Shape, intersect

LAYER_PREFIX = "decoder.layers."

# What a parameter's holders share besides the stage: (expert, split). A dense split tensor is
# held by the ranks with its TP index, a dense replicated one by the whole stage, an expert
# split one by the ranks with its EP and expert-TP index, an expert replicated one by its EP index.
Kind = tuple[bool, bool]
# A kind and whether two stages hold the parameter (tied embeddings): what decides its holders.
Family = tuple[bool, bool, bool]


def kind_of(p: LocalParam) -> Kind:
    return (p.expert, p.split_axis is not None)


@dataclass
class Template:
    """Stage ``stage``'s rank with TP, EP and expert-TP index 0."""

    stage: int
    params: tuple[LocalParam, ...]
    by_pre: dict[tuple[str, Shape], list[LocalParam]]  # (key, layer [, local expert]) -> params
    keys: frozenset[str]
    local_experts: int
    buffers: dict[bool, tuple[GradBuffer, dict[str, tuple[int, int]]]]  # expert -> (buffer, name -> (start, bucket))
    _portions: dict[tuple[bool, int], list[tuple[LocalParam, int, int]]] = field(default_factory=dict)
    _spans: dict = field(default_factory=dict)

    def portions(self, expert: bool, shard: int) -> list[tuple[LocalParam, int, int]]:
        """(parameter, start, stop) of every parameter's part in DP shard ``shard`` of the
        dense or expert buffer (flat indices inside the parameter), in buffer order."""
        hit = self._portions.get((expert, shard))
        if hit is None:
            hit = []
            entry = self.buffers.get(expert)
            if entry is not None:
                buf = entry[0]
                spans = self._spans.get(expert)
                if spans is None:  # per bucket: parameter starts (ascending) and (param, start, end)
                    spans = self._spans[expert] = {}
                    for bp in sorted(buf.params, key=lambda x: x.start):
                        starts, items = spans.setdefault(bp.bucket, ([], []))
                        starts.append(bp.start)
                        items.append((bp.param, bp.start, bp.start + bp.param.numel))
                for bucket in range(len(buf.buckets)):
                    lo, hi = buf.shard(bucket, shard)
                    starts, items = spans.get(bucket, ([], []))
                    i = max(0, bisect_right(starts, lo) - 1)
                    while i < len(items) and items[i][1] < hi:
                        p, start, end = items[i]
                        a, b = max(lo, start), min(hi, end)
                        if a < b:
                            hit.append((p, a - start, b - start))
                        i += 1
            self._portions[expert, shard] = hit
        return hit


class LayoutIndex:
    """Ranks by coordinates and stage templates of one layout (shared by its geometries)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        cfg = self.cfg = layout.cfg
        spec = layout.spec
        self.stage_of_layer: list[int] = []
        for p, n in enumerate(cfg.stage_layers(spec.num_layers)):
            self.stage_of_layer.extend([p] * n)
        self.local_experts = (spec.num_moe_experts or 0) // cfg.ep
        self.stage: dict[int, list[int]] = {}
        self.dense: dict[tuple[int, int], list[int]] = {}
        self.expert: dict[tuple[int, int, int], list[int]] = {}
        self.expert_ep: dict[tuple[int, int], list[int]] = {}
        self.dense_shard: dict[tuple[int, int, int], int] = {}  # (pp, tp, dp*cp index) -> rank
        self.expert_shard: dict[tuple[int, int, int, int], int] = {}  # (pp, ep, etp, edp) -> rank
        for r in range(cfg.world_size):
            c = cfg.coord(r)
            self.stage.setdefault(c.pp, []).append(r)
            self.dense.setdefault((c.pp, c.tp), []).append(r)
            self.expert.setdefault((c.pp, c.ep, c.etp), []).append(r)
            self.expert_ep.setdefault((c.pp, c.ep), []).append(r)
            self.dense_shard[c.pp, c.tp, c.cp + cfg.cp * c.dp] = r
            self.expert_shard[c.pp, c.ep, c.etp, c.edp] = r
        self._templates: dict[int, Template] = {}
        self._key_stages: dict[str, tuple[int, ...]] = {}

    def template(self, stage: int) -> Template:
        t = self._templates.get(stage)
        if t is None:
            rank0 = self.cfg.rank_of(pp=stage)
            params = self.layout.local_params(rank0)
            by_pre: dict[tuple[str, Shape], list[LocalParam]] = {}
            for p in params:
                npre = len(p.global_shape) - len(p.local_shape)
                by_pre.setdefault((p.key, p.pieces[0].global_offset[:npre]), []).append(p)
            buffers = {}
            if self.cfg.dist_opt:
                for buf in self.layout.buffers(rank0):
                    starts = {bp.param.name: (bp.start, bp.bucket) for bp in buf.params}
                    buffers[buf.params[0].param.expert] = (buf, starts)
            t = self._templates[stage] = Template(stage, params, by_pre, frozenset(p.key for p in params),
                                                 self.local_experts, buffers)
        return t

    def key_stages(self, key: str, layer: int | None = None) -> tuple[int, ...]:
        """The stages holding ``key`` (at ``layer``, for a per-layer key)."""
        if key.startswith(LAYER_PREFIX):
            return (self.stage_of_layer[layer],) if layer is not None else ()
        st = self._key_stages.get(key)
        if st is None:
            ends = sorted({0, self.cfg.pp - 1})
            st = self._key_stages[key] = tuple(p for p in ends if key in self.template(p).keys)
        return st

    def holders(self, geometry: str, stage: int, p: LocalParam, idx: int, ep: int, shard: int) -> tuple[int, ...]:
        """The ranks holding ``p`` of stage ``stage`` moved to split index ``idx`` and EP index
        ``ep`` (and, for a distributed-optimizer shard, with DP index ``shard``)."""
        split = p.split_axis is not None
        if geometry != DOPT_GEOMETRY:
            if p.expert:
                return tuple(self.expert[stage, ep, idx] if split else self.expert_ep[stage, ep])
            return tuple(self.dense[stage, idx] if split else self.stage[stage])
        if p.expert:
            etps = (idx,) if split else range(self.cfg.expert_tp)
            return tuple(self.expert_shard[stage, ep, et, shard] for et in etps)
        tps = (idx,) if split else range(self.cfg.tp)
        return tuple(self.dense_shard[stage, t, shard] for t in tps)


def index_of(layout: Layout) -> LayoutIndex:
    idx = layout.locate_index
    if idx is None:
        idx = layout.locate_index = LayoutIndex(layout)
    return idx


def split_count(cfg, p: LocalParam) -> int:
    return (cfg.expert_tp if p.expert else cfg.tp) if p.split_axis is not None else 1


class Side:
    """The boxes of one geometry (``"param"`` or ``"dopt"``) of one layout, found on demand."""

    def __init__(self, layout: Layout, geometry: str) -> None:
        self.layout = layout
        self.geometry = geometry
        self.ix = index_of(layout)
        self.cfg = layout.cfg
        self._regions: dict[tuple[str, int, int, int], list[tuple[Shape, Shape, View]]] = {}
        self._query: dict[tuple[str, Shape, Shape], list[Box]] = {}
        self._holder_boxes: dict[tuple[int, ...], list[Box]] = {}
        self._combos: dict[int, dict[frozenset, list[tuple]]] = {}
        self._nrep: dict[str, int] = {}
        self._pieces: dict = {}
        self._holder_sets: dict = {}
        self._families: dict[str, Family] = {}

    # ---- parameters of any rank of a stage ----------------------------------------------------
    def shift(self, p: LocalParam, idx: int, ep: int) -> Shape | None:
        """What to add to the global offsets of template parameter ``p``'s boxes for the rank
        with split index ``idx`` and EP index ``ep`` (None: nothing)."""
        if idx == 0 and ep == 0:
            return None
        npre = len(p.global_shape) - len(p.local_shape)
        box = (1,) * npre + (p.piece_rows, *p.local_shape[1:])
        add = [0] * len(p.global_shape)
        if p.split_axis is not None:
            add[p.split_axis] = idx * box[p.split_axis]
        if p.expert:
            add[1] = ep * self.ix.local_experts
        return tuple(add)

    def shard_regions(self, stage: int, p: LocalParam, a: int, b: int) -> list[tuple[Shape, Shape, View]]:
        """(global offset, box shape, view) of elements ``[a, b)`` of template parameter ``p``
        kept as one distributed-optimizer shard (the same for every TP and EP index of a stage,
        up to ``shift``)."""
        k = (p.name, stage, a, b)
        hit = self._regions.get(k)
        if hit is None:
            pre1 = (1,) * (len(p.global_shape) - len(p.local_shape))
            hit = self._regions[k] = [(reg.global_offset, pre1 + reg.local_shape,
                                       (reg.local_name, reg.local_offset, reg.local_shape))
                                      for reg in flat_regions(-1, PARAM, p, a, b, False)]
        return hit

    def _boxes_of(self, stage: int, p: LocalParam, idx: int, ep: int, shard: int | None,
                  query: tuple[Shape, Shape] | None, out: dict) -> None:
        """Boxes of template parameter ``p`` moved to (``idx``, ``ep``) (for a shard: DP index
        ``shard``, all of its shards when None), those overlapping ``query`` when given, into
        ``out`` ((offset, shape) -> [holder groups])."""
        add = self.shift(p, idx, ep)
        if self.geometry != DOPT_GEOMETRY:
            ranks = self.ix.holders(self.geometry, stage, p, idx, ep, 0)
            npre = len(p.global_shape) - len(p.local_shape)
            local = (p.piece_rows, *p.local_shape[1:])
            shape = (1,) * npre + local
            zeros = (0,) * (len(local) - 1)
            for pc in p.pieces:
                off = pc.global_offset if add is None else tuple(o + x for o, x in zip(pc.global_offset, add))
                if query is not None and intersect(off, shape, *query) is None:
                    continue
                view = (p.name, (pc.local_row, *zeros), local)
                out.setdefault((off, shape), []).append((stage, ranks, view))
            return
        buf, starts = self.ix.template(stage).buffers[p.expert]
        start, bucket = starts[p.name]
        lo_b, hi_b = buf.buckets[bucket]
        size = (hi_b - lo_b) // buf.dp_size
        if shard is None:
            first = (start - lo_b) // size
            last = min(buf.dp_size - 1, (start + p.numel - 1 - lo_b) // size)
            shards = range(first, last + 1)
        else:
            shards = (shard,)
        for j in shards:
            lo, hi = buf.shard(bucket, j)
            a, b = max(lo, start), min(hi, start + p.numel)
            if a >= b:
                continue
            ranks = self.ix.holders(self.geometry, stage, p, idx, ep, j)
            for off, shape, view in self.shard_regions(stage, p, a - start, b - start):
                if add is not None:
                    off = tuple(o + x for o, x in zip(off, add))
                if query is not None and intersect(off, shape, *query) is None:
                    continue
                out.setdefault((off, shape), []).append((stage, ranks, view))

    @staticmethod
    def _make(key: str, found: dict, npre: int) -> list[Box]:
        out = []
        for (off, shape), groups in found.items():
            out.append(Box(key, off, shape, npre, [(-1, ranks, view) for _, ranks, view in groups]))
        return out

    # ---- queries ------------------------------------------------------------------------------
    def overlapping(self, key: str, offset: Shape, shape: Shape) -> list[Box]:
        """Every box of ``key`` overlapping the box (``offset``, ``shape``) (global dims; the
        prepended axes of the query have extent 1)."""
        ck = (key, offset, shape)
        hit = self._query.get(ck)
        if hit is not None:
            return hit
        ix = self.ix
        found: dict = {}
        npre = 0
        layer = offset[0] if key.startswith(LAYER_PREFIX) else None
        for stage in ix.key_stages(key, layer):
            t = ix.template(stage)
            for params in _candidates(t, key, offset):
                for p in params:
                    npre = len(p.global_shape) - len(p.local_shape)
                    ep = offset[1] // t.local_experts if p.expert else 0
                    for idx in _split_range(self.cfg, p, offset, shape):
                        self._boxes_of(stage, p, idx, ep, None, (offset, shape), found)
        boxes = self._query[ck] = self._make(key, found, npre)
        return boxes

    def family(self, p: LocalParam) -> Family:
        """(expert, split, held by two stages): parameters of one family of one rank share holders."""
        f = self._families.get(p.key)
        if f is None:
            multi = not p.key.startswith(LAYER_PREFIX) and len(self.ix.key_stages(p.key)) > 1
            f = self._families[p.key] = (p.expert, p.split_axis is not None, multi)
        return f

    def family_key(self, rank: int, family: Family | None) -> tuple:
        """What a rank's boxes of ``family`` (all, for None) depend on: the coordinates that move
        them, and in the optimizer geometry the shard; ranks with equal keys hold equal boxes."""
        c = self.cfg.coord(rank)
        dopt = self.geometry == DOPT_GEOMETRY
        if family is None or family[2]:
            return (family, rank) if dopt else (family, c.pp, c.tp, c.ep, c.etp)
        expert, split, _ = family
        if expert:
            k = (c.pp, c.ep, c.etp) if split else (c.pp, c.ep)
            return (family, *k, c.edp) if dopt else (family, *k)
        k = (c.pp, c.tp) if split else (c.pp,)
        return (family, *k, c.cp + self.cfg.cp * c.dp) if dopt else (family, *k)

    def rank_pieces(self, rank: int, family: Family | None = None,
                    ) -> list[tuple[str, Shape, Shape, tuple[int, ...], View, Kind]]:
        """(key, offset, shape, holders, view on ``rank``, kind) of every box ``rank`` holds (of
        one family when given); holders sorted. Arithmetic on the stage template: no other rank's
        parameters are built. In the parameter geometry every rank of a class gets the same
        answer (cached per class)."""
        c = self.cfg.coord(rank)
        dopt = self.geometry == DOPT_GEOMETRY
        ck = self.family_key(rank, family)
        hit = self._pieces.get(ck)
        if hit is not None:
            return hit
        ix = self.ix
        t = ix.template(c.pp)
        out = []
        if dopt:
            for expert, shard in ((False, c.cp + self.cfg.cp * c.dp), (True, c.edp)):
                for p, a, b in t.portions(expert, shard):
                    fam = self.family(p)
                    if family is not None and fam != family:
                        continue
                    idx = (c.etp if p.expert else c.tp) if p.split_axis is not None else 0
                    ep = c.ep if p.expert else 0
                    add = self.shift(p, idx, ep)
                    holders = tuple(sorted(ix.holders(self.geometry, c.pp, p, idx, ep, shard)))
                    kind = fam[:2]
                    for off, shape, view in self.shard_regions(c.pp, p, a, b):
                        if add is not None:
                            off = tuple(o + x for o, x in zip(off, add))
                        hs = self._merged_holders(p.key, off, shape) if fam[2] else holders
                        out.append((p.key, off, shape, hs, view, kind))
        else:
            for p in t.params:
                fam = self.family(p)
                if family is not None and fam != family:
                    continue
                idx = (c.etp if p.expert else c.tp) if p.split_axis is not None else 0
                ep = c.ep if p.expert else 0
                found: dict = {}
                self._boxes_of(c.pp, p, idx, ep, 0, None, found)
                kind = fam[:2]
                for (off, shape), groups in found.items():
                    hs = self._merged_holders(p.key, off, shape) if fam[2] else tuple(sorted(groups[0][1]))
                    out.append((p.key, off, shape, hs, groups[0][2], kind))
        self._pieces[ck] = out
        return out

    def rank_portions(self, rank: int, family: Family) -> list[tuple[str, Shape, tuple, int, int, tuple[int, ...]]]:
        """Distributed-optimizer geometry: (key, layer [, expert], the parameter's pieces as
        (global offset, local row), start, stop, holders) of each parameter part in ``rank``'s
        shards of ``family``: ``[start, stop)`` are flat indices inside the parameter. Two parts
        of equal pieces share elements exactly where their ranges meet."""
        assert not family[2], "parameters two stages hold are found box by box (rank_pieces)"
        ck = ("portions", self.family_key(rank, family))
        hit = self._pieces.get(ck)
        if hit is not None:
            return hit
        c = self.cfg.coord(rank)
        t = self.ix.template(c.pp)
        out = []
        expert = family[0]
        shard = c.edp if expert else c.cp + self.cfg.cp * c.dp
        idx = (c.etp if expert else c.tp) if family[1] else 0
        ep = c.ep if expert else 0
        holders = None
        for p, a, b in t.portions(expert, shard):
            if self.family(p) != family:
                continue
            if holders is None:
                holders = tuple(sorted(self.ix.holders(self.geometry, c.pp, p, idx, ep, shard)))
            add = self.shift(p, idx, ep)
            if add is None:
                pieces = tuple((pc.global_offset, pc.local_row) for pc in p.pieces)
            else:
                pieces = tuple((tuple(o + x for o, x in zip(pc.global_offset, add)), pc.local_row)
                               for pc in p.pieces)
            npre = len(p.global_shape) - len(p.local_shape)
            out.append((p.key, pieces[0][0][:npre], (pieces, p.local_shape), a, b, holders))
        self._pieces[ck] = out
        return out

    def rank_numel(self, rank: int) -> int:
        """Elements ``rank`` holds in this geometry (shifts move boxes, not their sizes)."""
        c = self.cfg.coord(rank)
        t = self.ix.template(c.pp)
        if self.geometry != DOPT_GEOMETRY:
            return sum(p.numel for p in t.params)
        return sum(b - a for expert, shard in ((False, c.cp + self.cfg.cp * c.dp), (True, c.edp))
                   for _, a, b in t.portions(expert, shard))

    def rank_holder_sets(self, rank: int) -> dict[tuple[int, ...], list[Family]]:
        """The holder sets of ``rank``'s boxes, each with the families of its boxes there; from
        coordinates alone, except for parameters two stages hold."""
        c = self.cfg.coord(rank)
        dopt = self.geometry == DOPT_GEOMETRY
        ck = rank if dopt else (c.pp, c.tp, c.ep, c.etp)
        hit = self._holder_sets.get(ck)
        if hit is not None:
            return hit
        t = self.ix.template(c.pp)
        out: dict[tuple[int, ...], list[Family]] = {}
        fams: dict[Family, LocalParam] = {}
        if dopt:
            for expert, shard in ((False, c.cp + self.cfg.cp * c.dp), (True, c.edp)):
                for p, _, _ in t.portions(expert, shard):
                    fams.setdefault(self.family(p), p)
        else:
            for p in t.params:
                fams.setdefault(self.family(p), p)
        for fam, p in fams.items():
            if fam[2]:
                hss = {hs for _, _, _, hs, _, _ in self.rank_pieces(rank, fam)}
            else:
                idx = (c.etp if p.expert else c.tp) if p.split_axis is not None else 0
                shard = (c.edp if p.expert else c.cp + self.cfg.cp * c.dp) if dopt else 0
                hss = {tuple(sorted(self.ix.holders(self.geometry, c.pp, p, idx, c.ep if p.expert else 0, shard)))}
            for hs in hss:
                out.setdefault(hs, []).append(fam)
        self._holder_sets[ck] = out
        return out

    def _merged_holders(self, key: str, off: Shape, shape: Shape) -> tuple[int, ...]:
        """Holders of a box of a key that several stages hold (tied embeddings)."""
        box = next(b for b in self.overlapping(key, off, shape) if b.offset == off and b.shape == shape)
        return tuple(sorted(box.views()))

    def rank_boxes(self, rank: int) -> list[tuple[Box, View]]:
        """The boxes ``rank`` holds (every holder in their views) and its view of each."""
        out = []
        for key, off, shape, _, view, _ in self.rank_pieces(rank):
            box = next(b for b in self.overlapping(key, off, shape) if b.offset == off and b.shape == shape)
            out.append((box, view))
        return out

    def holder_boxes(self, holders: tuple[int, ...]) -> list[Box]:
        """Every box whose holders are exactly ``holders`` (sorted ranks)."""
        hit = self._holder_boxes.get(holders)
        if hit is not None:
            return hit
        want = set(holders)
        out: list[Box] = []
        seen: set[tuple[str, Shape, Shape]] = set()
        coord = self.cfg.coord
        for stage in sorted({coord(r).pp for r in holders}):
            part = frozenset(r for r in holders if coord(r).pp == stage)
            t = self.ix.template(stage)
            for kind, idx, ep, shard in self._stage_combos(stage).get(part, ()):
                for p in t.params:
                    if kind_of(p) != kind:
                        continue
                    found: dict = {}
                    self._boxes_of(stage, p, idx, ep, shard, None, found)
                    for off, shape in found:
                        if (p.key, off, shape) in seen:
                            continue
                        seen.add((p.key, off, shape))
                        for b in self.overlapping(p.key, off, shape):
                            if b.offset == off and b.shape == shape and set(b.views()) == want:
                                out.append(b)
        self._holder_boxes[holders] = out
        return out

    def _stage_combos(self, stage: int) -> dict[frozenset, list[tuple]]:
        """Holder set -> the (kind, split index, EP index, shard) whose boxes it holds, at ``stage``."""
        combos = self._combos.get(stage)
        if combos is not None:
            return combos
        combos = self._combos[stage] = {}
        cfg = self.cfg
        ix = self.ix
        dopt = self.geometry == DOPT_GEOMETRY
        dense_shards = cfg.dp * cfg.cp if dopt else 1
        expert_shards = cfg.expert_dp if dopt else 1
        probe_dense = [LocalParam("", "", (), (), (), False, False, split_axis=a) for a in (0, None)]
        probe_expert = [LocalParam("", "", (), (), (), False, True, split_axis=a) for a in (0, None)]
        for p in probe_dense:
            for idx in range(split_count(cfg, p)):
                for j in range(dense_shards):
                    hs = frozenset(ix.holders(self.geometry, stage, p, idx, 0, j))
                    combos.setdefault(hs, []).append((kind_of(p), idx, 0, j if dopt else 0))
        if ix.local_experts:
            for p in probe_expert:
                for e in range(cfg.ep):
                    for idx in range(split_count(cfg, p)):
                        for j in range(expert_shards):
                            hs = frozenset(ix.holders(self.geometry, stage, p, idx, e, j))
                            combos.setdefault(hs, []).append((kind_of(p), idx, e, j if dopt else 0))
        return combos

    def nrep(self, key: str, kind: Kind, layer: int | None) -> int:
        """How many ranks hold each element of ``key`` (the same for all its elements)."""
        n = self._nrep.get(key)
        if n is None:
            cfg = self.cfg
            expert, split = kind
            dopt = self.geometry == DOPT_GEOMETRY
            if expert:
                per = (1 if split else cfg.expert_tp) * (1 if dopt else cfg.expert_dp)
            else:
                per = (1 if split else cfg.tp) * (1 if dopt else cfg.dp * cfg.cp)
            n = self._nrep[key] = per * len(self.ix.key_stages(key, layer if layer is not None else 0))
        return n


def _candidates(t: Template, key: str, offset: Shape):
    """The template parameters of ``key`` at the query's layer (and expert)."""
    out = []
    for npre in (0, 1, 2):
        if npre > len(offset):
            break
        pre = offset[:npre]
        if npre == 2 and t.local_experts:
            pre = (offset[0], offset[1] % t.local_experts)
        params = t.by_pre.get((key, pre))
        if params:
            out.append(params)
    return out


def _split_range(cfg, p: LocalParam, offset: Shape, shape: Shape) -> range:
    """The split indices whose pieces of ``p`` can overlap the query along the split axis."""
    count = split_count(cfg, p)
    if count == 1:
        return range(1)
    a = p.split_axis
    npre = len(p.global_shape) - len(p.local_shape)
    step = (p.piece_rows, *p.local_shape[1:])[a - npre]
    lo = min(pc.global_offset[a] for pc in p.pieces)
    hi = max(pc.global_offset[a] for pc in p.pieces) + step
    q0, q1 = offset[a], offset[a] + shape[a]
    # piece i of index k covers [base_i + k * step, ...); any piece can overlap when the query
    # meets [lo + k * step, hi + k * step)
    first = max(0, (q0 - hi) // step)
    last = min(count - 1, (q1 - 1 - lo) // step)
    return range(first, last + 1)


__all__ = ["LAYER_PREFIX", "Kind", "LayoutIndex", "Side", "View", "index_of", "kind_of"]
