"""Transition plan: for every piece of training state each new rank needs, where it comes from.

``plan_transition(spec, old_cfg, new_cfg, devices)`` intersects the old and new layouts and
returns a ``TransitionPlan``: the device that runs each new rank, and a list of ``Copy``s (one
box of one logical tensor, for every state of a state group, from a source device's local
tensor to a destination device's new local tensor). Source choice:

1. keep data where it is: a device that already holds a piece copies it locally;
2. otherwise the piece comes from the pool of its old box (the surviving holders that stay,
   DP replicas, TP-replicated norms, tied-embedding copies and standbys included; leaving
   devices only when no other holder survives): a one-member pool sends everything it alone
   holds (its *forced* load), a larger pool shares the demands on its boxes out by
   water-filling on its members' forced loads, destinations on a member's node first
   (``sources``).

The rule reads nothing beyond a piece's boxes and their holders, so one device's part of the
plan can be computed on its own, with the same result (``device_plan``): that is what a running
job plans. The whole plan is the tests' and the CLI's oracle; both implement
``plan_view.TransitionPlanView``. The rank order a world planner picks comes from the layouts'
overlap by holder class (``overlap_figures``, computed from stage templates by ``overlap``),
not from a plan.

The plan is a pure function of its inputs: every rank computes the same plan with no
communication, and ``checksum`` (sha256 over the canonical plan) lets ranks confirm it before
data moves. Plans are cached per (model, old config, new config, device map).
Pure: no torch.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from operator import itemgetter
from typing import NamedTuple

from liveshard.runtime.errors import ConfigError
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.spec import ModelSpec
from liveshard.runtime.vps.boxes import BoxIndex, Geometry, View, build_geometry, geometry_of, param_classes
from liveshard.runtime.vps.devices import DeviceMap
from liveshard.runtime.vps.layout import Layout
from liveshard.runtime.vps.mapping import assign_devices
from liveshard.runtime.vps.overlap import class_overlap
from liveshard.runtime.vps.region import Shape, flat_range_to_boxes, volume
from liveshard.runtime.vps.sources import Demand, pool_of, split, targets


class NoSurvivingCopy(Exception):
    """Some piece of state is held only by dead devices: the job needs its last checkpoint.

    Not a ``ConfigError``: nothing a person wrote is wrong, the state is gone."""


@dataclass(frozen=True)
class StateGroup:
    """States that share one geometry in the old layout and one in the new: they move together."""

    states: tuple[str, ...]
    dtypes: tuple[str, ...]
    itemsizes: tuple[int, ...]
    old_geometry: str
    new_geometry: str

    @property
    def itemsum(self) -> int:
        return sum(self.itemsizes)


class Copy(NamedTuple):
    """Box ``[offset, offset + shape)`` of ``key``, every state of ``group``, src -> dst.

    A view is (local tensor name, region local_offset, region local_shape) as in ``Region``;
    ``*_rel`` is the piece's start inside that region (local dims). ``shape`` has local dims.
    """

    src: int
    dst: int
    group: int
    key: str
    offset: Shape
    shape: Shape
    src_view: View
    src_rel: Shape
    dst_view: View
    dst_rel: Shape
    nbytes: int  # all states of the group together


class ObjectMove(NamedTuple):
    """A small object (step, RNG state, ...) held as ``name`` by old rank ``src_rank``."""

    name: str
    src: int  # device
    dst: int  # device
    src_rank: int  # old rank whose object it is (== src device)
    dst_rank: int  # new rank that gets it


# Small objects a training rank carries. Global ones are the same on every rank (any old rank
# can serve them); per-rank ones belong to one old rank.
GLOBAL_OBJECTS = ("step", "scheduler", "data_cursor", "loss_scaler")  # loss_scaler: fp16's scale, skipped steps
PER_RANK_OBJECTS = ("rng",)


@dataclass
class TransitionPlan:
    """The whole plan: every device's copies (``plan_view.TransitionPlanView``). The runtime plans
    per device (``device_plan``); the whole plan is the tests' and the CLI's oracle."""

    spec: ModelSpec
    old_cfg: ParallelConfig
    new_cfg: ParallelConfig
    devices: DeviceMap
    groups: tuple[StateGroup, ...]
    rank_to_device: tuple[int, ...]
    copies: list[Copy]  # local (src == dst) and network copies
    objects: list[ObjectMove]
    lower_bound: dict = field(default_factory=dict)  # see bound.lower_bound
    plan_seconds: float = 0.0
    forced: list[int] = field(default_factory=list)  # per device: bytes only it can send (sources)
    pool_shares: dict = field(default_factory=dict)  # (geometry, holders) -> PoolShares

    @cached_property
    def old_layout(self) -> Layout:
        return Layout(self.spec, self.old_cfg)

    @cached_property
    def new_layout(self) -> Layout:
        return Layout(self.spec, self.new_cfg)

    @cached_property
    def device_to_rank(self) -> dict[int, int]:
        return {d: r for r, d in enumerate(self.rank_to_device)}

    @property
    def standbys(self) -> tuple[int, ...]:
        used = set(self.rank_to_device)
        return tuple(d for d in self.devices.available if d not in used)

    @cached_property
    def network_copies(self) -> list[Copy]:
        return [c for c in self.copies if c.src != c.dst]

    @cached_property
    def link_bytes(self) -> tuple[list[int], list[int]]:
        """(bytes each device sends, bytes each device receives) over links."""
        n = self.devices.num_devices
        send, recv = [0] * n, [0] * n
        for c in self.network_copies:
            send[c.src] += c.nbytes
            recv[c.dst] += c.nbytes
        return send, recv

    @property
    def bytes_moved(self) -> int:
        return sum(self.link_bytes[0])

    @property
    def local_copy_bytes(self) -> int:
        return sum(c.nbytes for c in self.copies if c.src == c.dst)

    @property
    def bottleneck_bytes(self) -> int:
        send, recv = self.link_bytes
        return max(max(send, default=0), max(recv, default=0))

    @cached_property
    def device_bounds(self) -> list[int]:
        """Per device: bytes it receives plus the most it can send (its forced load, and for each
        pool it is in, its share plus two elements: ``sources``). ``schedule`` sizes rounds with it."""
        out = [self.forced[d] + r for d, r in enumerate(self.lower_bound["must_receive"])]
        for ps in self.pool_shares.values():
            if ps.total:
                for s, x in zip(ps.pool, ps.shares):
                    out[s] += x + 2 * ps.elem
        return out

    def device_bound(self, device: int) -> int:
        return self.device_bounds[device]

    @property
    def device(self) -> None:
        """The whole plan is no one device's part (``plan_view.TransitionPlanView``)."""
        return None

    @cached_property
    def digest(self) -> str:
        """sha256 over the plan's inputs (``device_plan.inputs_digest``): what every device's own
        plan of the same transition reports too. Not ``checksum``, which hashes every copy."""
        from liveshard.runtime.vps.device_plan import inputs_digest

        return inputs_digest(self.spec, self.old_cfg, self.new_cfg, self.devices, self.rank_to_device)

    def greedy_schedule(self, budget: int):
        """The greedy rounds of every copy (``schedule.greedy_rounds``)."""
        from liveshard.runtime.vps.schedule import greedy_rounds

        return greedy_rounds(self, budget)

    @cached_property
    def checksum(self) -> str:
        """sha256 over the canonical plan: inputs, rank -> device map, every copy and object move.

        Copies are encoded as integers (names and views through tables in first-use order), so
        hashing a 10^5-copy plan costs a fraction of planning it.
        """
        h = hashlib.sha256()
        h.update(repr((str(self.old_cfg), str(self.new_cfg), sorted(self.spec.to_dict().items()),
                       sorted(self.devices.describe().items()), self.rank_to_device,
                       [(g.states, g.dtypes, g.old_geometry, g.new_geometry) for g in self.groups])).encode())
        ids: dict = {}
        setid = ids.setdefault
        ints = array("q")
        put = ints.extend
        for src, dst, group, key, off, shape, sview, srel, dview, drel, nbytes in self.copies:
            put((src, dst, group, setid(key, len(ids)), setid(sview, len(ids)), setid(dview, len(ids)),
                 nbytes, len(shape), *off, *shape, *srel, *drel))
        h.update(ints.tobytes())
        h.update(repr(list(ids)).encode())
        h.update(repr([tuple(m) for m in self.objects]).encode())
        return h.hexdigest()


def state_groups(old: Layout, new: Layout) -> tuple[StateGroup, ...]:
    by_geom: dict[tuple[str, str], list[str]] = {}
    for s in old.states:
        by_geom.setdefault((geometry_of(old, s), geometry_of(new, s)), []).append(s)
    return tuple(
        StateGroup(tuple(states), tuple(old.dtype(s) for s in states),
                   tuple(old.itemsize(s) for s in states), og, ng)
        for (og, ng), states in by_geom.items())


def plan_transition(spec: ModelSpec, old_cfg: ParallelConfig, new_cfg: ParallelConfig,
                    devices: DeviceMap | None = None,
                    rank_to_device: tuple[int, ...] | None = None, *, cached: bool = True) -> TransitionPlan:
    """The transition plan (cached: the same inputs return the same plan object).

    ``rank_to_device``: the device each new rank runs on, as the world plan fixed it; without
    one, ranks go to the devices that already hold most of their state (``mapping``).
    ``cached=False``: planned anew and not kept (a plan of a thousand devices holds hundreds of
    MiB; a caller that only reads a figure off it should not keep it alive)."""
    if devices is None:
        devices = DeviceMap(old_cfg.world_size)
    if rank_to_device is not None:
        rank_to_device = tuple(rank_to_device)
        check_rank_to_device(rank_to_device, new_cfg.world_size, devices)
    plan = cached_plan if cached else cached_plan.__wrapped__
    return plan(spec, old_cfg, new_cfg, devices, rank_to_device)


class InvalidDeviceOrder(ValueError):
    """A rank order that names a device twice, one that is gone, or the wrong number of them."""


def check_rank_to_device(order: tuple[int, ...], world: int, devices: DeviceMap) -> None:
    if len(order) != world:
        raise InvalidDeviceOrder(f"{len(order)} devices given for a world of {world} ranks")
    if len(set(order)) != len(order):
        raise InvalidDeviceOrder(f"a device runs two ranks in {order}")
    available = set(devices.available)
    gone = [d for d in order if d not in available]
    if gone:
        raise InvalidDeviceOrder(f"device {gone[0]} is leaving, dead or unknown")


@lru_cache(maxsize=16)
def cached_plan(spec: ModelSpec, old_cfg: ParallelConfig, new_cfg: ParallelConfig,
                 devices: DeviceMap, given_order: tuple[int, ...] | None) -> TransitionPlan:
    from liveshard.runtime.vps.bound import lower_bound

    t0 = time.perf_counter()
    groups, inters, rank_to_device = _intersections(spec, old_cfg, new_cfg, devices, given_order)
    copies, demands, forced, shares = _copies_and_demands(inters, groups, rank_to_device, devices)
    bound = lower_bound(demands, devices.num_devices)
    objects = object_moves(old_cfg, new_cfg, rank_to_device, devices)
    plan = TransitionPlan(spec, old_cfg, new_cfg, devices, groups, rank_to_device, copies, objects, bound,
                          forced=forced, pool_shares=shares)
    plan.plan_seconds = time.perf_counter() - t0
    return plan


def rank_order(spec: ModelSpec, old_cfg: ParallelConfig, new_cfg: ParallelConfig,
               devices: DeviceMap) -> tuple[int, ...]:
    """The device each new rank runs on when no world plan fixed it: what ``plan_transition``
    picks (``mapping``), from the layouts' overlap figures (``overlap_figures``) with no plan
    built; a running job gets its order from the world planner instead."""
    return overlap_figures(spec, old_cfg, new_cfg, devices).best_order


@dataclass(frozen=True)
class OverlapFigures:
    """What the devices of a transition already hold of each new rank's state, by holder class
    (``mapping.assign_devices``' inputs): enough to choose and to price a rank order without
    building a plan's copies."""

    devices: DeviceMap
    overlap: dict[tuple[int, int], int]  # (new class, old class) -> bytes in common
    new_classes: tuple[list[tuple[int, ...]], list[int]]  # (members of each class, rank -> class)
    old_classes: tuple[list[tuple[int, ...]], list[int]]
    best_order: tuple[int, ...]  # what plan_transition would pick: new rank -> device

    def kept_bytes(self, rank_to_device: Sequence[int]) -> int:
        """Bytes of the new state already on the device each new rank runs on under
        ``rank_to_device`` (the rest moves: ``TransitionPlan.bytes_moved`` is the total less this)."""
        (new_members, new_class), (old_members, old_class) = self.new_classes, self.old_classes
        n_new, n_old = len(new_members), len(old_members)
        usable = set(d for d in self.devices.available if d < self.devices.old_world)
        get = self.overlap.get
        kept = 0
        for r, d in enumerate(rank_to_device):
            if d not in usable:
                continue
            for cn in (new_class[r], n_new + r):
                kept += get((cn, old_class[d]), 0) + get((cn, n_old + d), 0)
        return kept


def overlap_figures(spec: ModelSpec, old_cfg: ParallelConfig, new_cfg: ParallelConfig,
                    devices: DeviceMap) -> OverlapFigures:
    """The overlap of the two layouts by holder class and the rank order it gives, without a plan.

    From flat ranges where the layouts split every parameter alike (``overlap.class_overlap``),
    else by intersecting every box of the two layouts (``box_overlap_figures``): the same figures."""
    old, new, groups = _checked_layouts(spec, old_cfg, new_cfg, devices)
    overlap = class_overlap(old, new, groups)
    if overlap is None:
        return box_overlap_figures(spec, old_cfg, new_cfg, devices)
    new_classes, old_classes = param_classes(new), param_classes(old)
    order = assign_devices(new_cfg.world_size, devices, overlap, new_classes, old_classes)
    return OverlapFigures(devices, dict(overlap), new_classes, old_classes, order)


def box_overlap_figures(spec: ModelSpec, old_cfg: ParallelConfig, new_cfg: ParallelConfig,
                        devices: DeviceMap) -> OverlapFigures:
    """``overlap_figures`` by intersecting every box of the two layouts (what the plan does)."""
    groups, og, ng = _geometries(spec, old_cfg, new_cfg, devices)
    _, overlap = _intersect(groups, og, ng)
    new_classes, old_classes = _classes(ng), _classes(og)
    order = assign_devices(new_cfg.world_size, devices, overlap, new_classes, old_classes)
    return OverlapFigures(devices, dict(overlap), new_classes, old_classes, order)


def _checked_layouts(spec: ModelSpec, old_cfg: ParallelConfig, new_cfg: ParallelConfig, devices: DeviceMap,
                     ) -> tuple[Layout, Layout, tuple[StateGroup, ...]]:
    """(old layout, new layout, state groups) of a transition, its inputs checked."""
    if devices.old_world != old_cfg.world_size:
        raise ConfigError("old config", f"the old config has {old_cfg.world_size} ranks but the device map "
                                    f"{devices.old_world} old devices", "old rank i runs on device i")
    old, new = Layout(spec, old_cfg), Layout(spec, new_cfg)
    devices.check_fits(new_cfg.world_size)
    return old, new, state_groups(old, new)


def _geometries(spec: ModelSpec, old_cfg: ParallelConfig, new_cfg: ParallelConfig, devices: DeviceMap):
    """(state groups, old geometries, new geometries) of a transition, its inputs checked."""
    old, new, groups = _checked_layouts(spec, old_cfg, new_cfg, devices)
    og: dict[str, Geometry] = {k: build_geometry(old, k) for k in {g.old_geometry: None for g in groups}}
    ng: dict[str, Geometry] = {k: build_geometry(new, k) for k in {g.new_geometry: None for g in groups}}
    return groups, og, ng


def _classes(geometries: dict[str, Geometry]) -> tuple[list[tuple[int, ...]], list[int]]:
    """(members of each parameter class, rank -> its class): the same in every geometry."""
    any_geometry = next(iter(geometries.values()))
    return any_geometry.class_members, any_geometry.rank_class


def _intersections(spec: ModelSpec, old_cfg: ParallelConfig, new_cfg: ParallelConfig, devices: DeviceMap,
                   given_order: tuple[int, ...] | None):
    """(state groups, every intersection of the two layouts, rank -> device)."""
    groups, og, ng = _geometries(spec, old_cfg, new_cfg, devices)
    inters, overlap = _intersect(groups, og, ng)
    rank_to_device = given_order or assign_devices(new_cfg.world_size, devices, overlap, _classes(ng), _classes(og))
    return groups, inters, rank_to_device


# An intersection: (state group index, new box, old box, common offset, common shape).
Inter = tuple


def _intersect(groups: tuple[StateGroup, ...], og: dict[str, Geometry],
               ng: dict[str, Geometry]) -> tuple[list[Inter], dict[tuple[int, int], int]]:
    inters: list[Inter] = []
    overlap: dict[tuple[int, int], int] = defaultdict(int)
    done_pairs: dict[tuple[str, str], list[Inter]] = {}
    for gi, g in enumerate(groups):
        geo_pair = (g.old_geometry, g.new_geometry)
        cached = done_pairs.get(geo_pair)
        if cached is None:
            cached = done_pairs[geo_pair] = _intersect_geometries(og[g.old_geometry], ng[g.new_geometry])
        w_per_elem = g.itemsum
        for nb, ob, off, shp in cached:
            inters.append((gi, nb, ob, off, shp))
            w = volume(shp) * w_per_elem
            for cn, _, _ in nb.groups:
                for co, _, _ in ob.groups:
                    overlap[cn, co] += w
    return inters, overlap


def _intersect_geometries(old: Geometry, new: Geometry) -> list[tuple]:
    out: list[tuple] = []
    for key, nboxes in new.boxes.items():
        oboxes = old.boxes.get(key)
        if oboxes is None:
            raise ConfigError("new config", f"tensor {key} is in the new layout but not in the old one")
        index: BoxIndex | None = None
        for k, nb in nboxes.items():
            ob = oboxes.get(k)
            if ob is not None:  # same box in both layouts (old boxes never partly overlap)
                out.append((nb, ob, nb.offset, nb.shape))
                continue
            if index is None:
                index = BoxIndex(list(oboxes.values()))
            hits = index.overlaps(nb)
            covered = 0
            for ob, off, shp in hits:
                covered += volume(shp)
                out.append((nb, ob, off, shp))
            if covered != volume(nb.shape):
                raise AssertionError(f"old layout covers {covered} of {volume(nb.shape)} elements of "
                                     f"{key} at {nb.offset}")
    return out


def _sources(ob, devices: DeviceMap) -> tuple[int, ...]:
    src = ob.sources
    if src is None:
        src = ob.sources = tuple(sorted(d for d in ob.views() if devices.holds_old_state(d)))
    return src


# A demand as ``bound.lower_bound`` reads it: (bytes, destination device, surviving holders).
BoundDemand = tuple


@dataclass
class PoolShares:
    """How the demands on one holder set's boxes were shared (``sources.targets``)."""

    pool: tuple[int, ...]
    shares: list[int]
    total: int
    elem: int  # the largest element (bytes, all states) of the holder set's state groups


def part_copies(c: Copy, npre: int, first: int, count: int) -> list[Copy]:
    """Elements ``[first, first + count)`` (row-major) of piece ``c``, as copies of boxes."""
    if first == 0 and count == volume(c.shape):
        return [c]
    per_elem = c.nbytes // volume(c.shape)
    out = []
    pre = c.offset[:npre]
    for boff, bshape in flat_range_to_boxes(c.shape, first, first + count):
        out.append(c._replace(
            offset=(*pre, *(o + b for o, b in zip(c.offset[npre:], boff))), shape=bshape,
            src_rel=tuple(o + b for o, b in zip(c.src_rel, boff)),
            dst_rel=tuple(o + b for o, b in zip(c.dst_rel, boff)), nbytes=volume(bshape) * per_elem))
    return out


def elem_bytes(groups: tuple[StateGroup, ...], geometry: str) -> int:
    """The largest element (bytes, all states) among the state groups whose old geometry is
    ``geometry``: what bounds a pool member's rounding (``sources.split``)."""
    return max((g.itemsum for g in groups if g.old_geometry == geometry), default=0)


def _copies_and_demands(inters: list[Inter], groups: tuple[StateGroup, ...],
                        rank_to_device: tuple[int, ...], devices: DeviceMap,
                        ) -> tuple[list[Copy], list[BoundDemand], list[int], dict]:
    """Every copy of the plan: a device that holds a piece copies it locally, the others get it
    by the rule of ``sources`` (the same ``device_plan`` runs for one device). Also returns the
    bound's demands, each device's forced load and how each pool was shared."""
    copies: list[Copy] = []
    demands: list[BoundDemand] = []
    forced = [0] * devices.num_devices
    alive = [devices.holds_old_state(d) for d in range(devices.num_devices)]
    new_copy = tuple.__new__  # a NamedTuple built without its keyword-parsing ``__new__``: this loop is hot
    pooled: dict[tuple, list] = {}
    holder_sets: dict[int, tuple] = {}
    pools: dict[tuple[int, ...], tuple[int, ...]] = {}
    itemsums = [g.itemsum for g in groups]
    for gi, nb, ob, off, shp in inters:
        views = ob.views()
        sources = _sources(ob, devices)
        if not sources:
            raise NoSurvivingCopy(f"{nb.key} at {list(off)} is held only by dead devices "
                                            f"{sorted(views)}")
        npre = nb.npre
        lshape = shp[npre:]
        isum = itemsums[gi]
        nbytes = volume(shp) * isum
        srel = tuple(o - b for o, b in zip(off[npre:], ob.offset[npre:]))
        drel = tuple(o - b for o, b in zip(off[npre:], nb.offset[npre:]))
        key = nb.key
        dests: list[tuple[int, View]] = []
        for _, ranks, nview in nb.groups:
            for r in ranks:
                d = rank_to_device[r]
                sview = views.get(d)
                if sview is not None and alive[d]:
                    copies.append(new_copy(Copy, (d, d, gi, key, off, lshape, sview, srel, nview, drel, nbytes)))
                else:
                    dests.append((d, nview))
                    demands.append((nbytes, d, sources))
        if not dests:
            continue
        hs = holder_sets.get(id(ob))
        if hs is None:
            holders = tuple(sorted(views))
            pool = pools.get(holders)
            if pool is None:
                pool = pools[holders] = pool_of(holders, devices)
            hs = holder_sets[id(ob)] = (groups[gi].old_geometry, holders, pool)
        geometry, holders, pool = hs
        if len(pool) == 1:
            s = pool[0]
            forced[s] += nbytes * len(dests)
            sview = views[s]
            for d, nview in dests:
                copies.append(new_copy(Copy, (s, d, gi, key, off, lshape, sview, srel, nview, drel, nbytes)))
            continue
        entry = pooled.get((geometry, holders))
        if entry is None:
            entry = pooled[geometry, holders] = []
        entry.append(((gi, key, off), (gi, key, off, lshape, srel, drel, nbytes, npre, views, isum), dests))
    shares = _share_pools(pooled, groups, devices, forced, copies)
    return copies, demands, forced, shares


def _share_pools(pooled: dict[tuple, list], groups: tuple[StateGroup, ...], devices: DeviceMap, forced: list[int],
                 copies: list[Copy]) -> dict[tuple, PoolShares]:
    """The pieces several holders can send, shared over each holder set's pool (``sources``:
    ``targets`` then ``split``); their copies are appended to ``copies``. Returns how each pool
    was shared."""
    new_copy = new_demand = tuple.__new__  # NamedTuples built without keyword parsing: this loop is hot
    shares: dict[tuple, PoolShares] = {}
    nodes = devices.nodes
    for (geometry, holders), pieces in pooled.items():
        pieces.sort(key=itemgetter(0))  # ``split`` takes demands in piece order
        dms: list[Demand] = []
        for order, piece, dests in pieces:
            nbytes, isum = piece[6], piece[9]
            dms.extend([new_demand(Demand, (d, order, nbytes, isum)) for d, _ in dests])
        pool = pool_of(holders, devices)
        total = sum(dm.nbytes for dm in dms)
        sh = targets(pool, forced, total)
        shares[geometry, holders] = PoolShares(pool, sh, total, elem_bytes(groups, geometry))
        parts = split(pool, sh, dms, nodes)
        q = 0
        for _, (gi, key, off, lshape, srel, drel, nbytes, npre, views, isum), dests in pieces:
            whole = nbytes // isum
            for d, nview in dests:
                for s, first, count in parts[q]:
                    c = new_copy(Copy, (s, d, gi, key, off, lshape, views[s], srel, nview, drel, nbytes))
                    if first == 0 and count == whole:
                        copies.append(c)
                    else:
                        copies.extend(part_copies(c, npre, first, count))
                q += 1
    return shares


def object_moves(old_cfg: ParallelConfig, new_cfg: ParallelConfig, rank_to_device: tuple[int, ...],
                 devices: DeviceMap, device: int | None = None) -> list[ObjectMove]:
    """Who sends each new rank its small objects.

    Global objects come from the rank's own device when it held an old rank, else from a
    surviving old device on its node, else from surviving old devices in turn. A per-rank
    object (RNG state) comes from the old rank at the same (tp, cp, dp, pp) coordinate, clipped
    to the old grid; if that device is dead, from a surviving old rank with the same tp and pp.
    With ``device``, only the moves it sends or receives.
    """
    alive = [d for d in range(devices.old_world) if devices.holds_old_state(d)]
    if not alive:
        raise NoSurvivingCopy("every old device is dead")
    by_node: dict[int, list[int]] = defaultdict(list)
    for d in alive:
        by_node[devices.node(d)].append(d)
    moves: list[ObjectMove] = []
    turn = 0
    for r, d in enumerate(rank_to_device):
        if devices.holds_old_state(d):
            src = d
        elif by_node.get(devices.node(d)):
            src = by_node[devices.node(d)][0]
        else:
            src = alive[turn % len(alive)]
            turn += 1
        if device is None or device in (src, d):
            moves.extend(ObjectMove(name, src, d, src, r) for name in GLOBAL_OBJECTS)
        if device is not None and d != device and not devices.holds_old_state(device):
            continue
        c = new_cfg.coord(r)
        q = old_cfg.rank_of(tp=c.tp % old_cfg.tp, cp=c.cp % old_cfg.cp, dp=c.dp % old_cfg.dp,
                            pp=c.pp % old_cfg.pp)
        if not devices.holds_old_state(q):
            peers = [old_cfg.rank_of(tp=c.tp % old_cfg.tp, cp=c.cp % old_cfg.cp, dp=k, pp=c.pp % old_cfg.pp)
                     for k in range(old_cfg.dp)]
            q = next((p for p in peers if devices.holds_old_state(p)), alive[0])
        if device is None or device in (q, d):
            moves.extend(ObjectMove(name, q, d, q, r) for name in PER_RANK_OBJECTS)
    return moves
