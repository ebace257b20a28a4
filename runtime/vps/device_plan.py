"""One device's part of a transition, planned from the boxes around it alone.

``plan_device(spec, old, new, devices, rank_to_device, device)`` returns what ``device`` copies
locally, sends and receives, and (through ``vps.schedule.schedule``) its rounds: the same copies
and rounds as that device's slice of ``transition.plan_transition`` with the same inputs, worked
out without planning the other devices.

What one device needs, and why it is enough:

* its receives: its new boxes, the old boxes overlapping them (``locate.Side``) and, for a
  pooled old box, how its pool shares out its demands (``sources``);
* its sends: its old boxes, the new boxes overlapping them and their holders' devices;
* a pool's share-out: the pool's boxes (``Side.holder_boxes``) with every demand on them, in
  order, and each member's forced load;
* a holder set's demand total and a device's forced load, from the holders' own boxes: the boxes
  *owe* each element once to every new rank holding it (``Side.nrep``), less what each holder
  *keeps* in place (the overlap of its old boxes with its new rank's); no other device's demand
  is listed;
* its rounds: its pairs' copies and, for each peer, the peer's load bound
  (``device_bound``, as the whole plan's: bytes received plus forced load plus, per pool, share plus
  two elements), from the same owed and kept figures.

``inputs_digest`` is what devices compare before data moves: sha256 over every input of the plan
(model, both configs, device map, rank order, state groups) and the planner's version. Equal
digests mean equal plans, because the plan is a pure function of them (a ``DevicePlan``'s and the
whole plan's ``digest``); the whole plan's ``checksum`` needs every copy and so the whole plan.
``DevicePlan`` and ``transition.TransitionPlan`` both implement ``plan_view.TransitionPlanView``.
Pure: no torch.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from functools import cached_property, lru_cache
from operator import itemgetter
from typing import TYPE_CHECKING

from liveshard.runtime.errors import ConfigError
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.spec import ModelSpec
from liveshard.runtime.vps.boxes import DOPT_GEOMETRY, PARAM_GEOMETRY
from liveshard.runtime.vps.devices import DeviceMap
from liveshard.runtime.vps.layout import Layout
from liveshard.runtime.vps.locate import LAYER_PREFIX, Side
from liveshard.runtime.vps.region import Shape, intersect, volume
from liveshard.runtime.vps.sources import Demand, pool_of, split, targets
from liveshard.runtime.vps.transition import (
    Copy,
    NoSurvivingCopy,
    ObjectMove,
    StateGroup,
    elem_bytes,
    object_moves,
    part_copies,
    state_groups,
)

if TYPE_CHECKING:
    from liveshard.runtime.vps.schedule import Schedule

# Names the rules a plan is computed with (source choice, rounds). Devices compare it inside the
# inputs digest: a device running other rules must not take part.
PLANNER_VERSION = "pools-waterfill/pairwise-rounds/1"


def inputs_digest(spec: ModelSpec, old_cfg: ParallelConfig, new_cfg: ParallelConfig, devices: DeviceMap,
                  rank_to_device: tuple[int, ...]) -> str:
    """sha256 over everything a transition plan is a function of (see the module doc)."""
    old, new = Layout(spec, old_cfg, validate=False), Layout(spec, new_cfg, validate=False)
    groups = state_groups(old, new)
    h = hashlib.sha256()
    h.update(repr((PLANNER_VERSION, str(old_cfg), str(new_cfg), sorted(spec.to_dict().items()),
                   sorted(devices.describe().items()), tuple(rank_to_device),
                   [(g.states, g.dtypes, g.old_geometry, g.new_geometry) for g in groups])).encode())
    return h.hexdigest()


class Planner:
    """Per-device planning of one transition; caches what several devices' plans share."""

    def __init__(self, spec: ModelSpec, old_cfg: ParallelConfig, new_cfg: ParallelConfig, devices: DeviceMap,
                 rank_to_device: tuple[int, ...]) -> None:
        if devices.old_world != old_cfg.world_size:
            raise ConfigError("old config", f"the old config has {old_cfg.world_size} ranks but the device map "
                                            f"{devices.old_world} old devices", "old rank i runs on device i")
        self.spec, self.old_cfg, self.new_cfg, self.devices = spec, old_cfg, new_cfg, devices
        self.rank_to_device = tuple(rank_to_device)
        self.old, self.new = Layout(spec, old_cfg), Layout(spec, new_cfg)
        self.groups = state_groups(self.old, self.new)
        self.old_side = {g.old_geometry: Side(self.old, g.old_geometry) for g in self.groups}
        self.new_side = {g.new_geometry: Side(self.new, g.new_geometry) for g in self.groups}
        self.device_to_rank = {d: r for r, d in enumerate(self.rank_to_device)}
        self.alive = [devices.holds_old_state(d) for d in range(devices.num_devices)]
        self.nodes = devices.nodes
        self._pools: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._index: dict = {}
        self._owed: dict = {}
        self._kept: dict = {}
        self._forced: dict[int, int] = {}
        self._shares: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], list[int], int]] = {}
        self._bound: dict[int, int] = {}
        self.greedy_cache: dict = {}  # budget -> the whole plan's greedy schedule (tiny budgets)

    def pool(self, holders: tuple[int, ...]) -> tuple[int, ...]:
        p = self._pools.get(holders)
        if p is None:
            p = self._pools[holders] = pool_of(holders, self.devices)
        return p

    # ---- what a device's own boxes say ---------------------------------------------------------
    def _old_geometries(self) -> list[str]:
        return list(dict.fromkeys(g.old_geometry for g in self.groups))

    def _new_index(self, geometry: str, rank: int, family) -> dict:
        """Boxes of new rank ``rank`` of the kind of ``family`` (whether two stages hold a
        parameter can differ between the layouts): (key, layer [, expert]) -> [(offset, shape)],
        and (key, offset, shape) -> True for each box."""
        side = self.new_side[geometry]
        fams = [(family[0], family[1], multi) for multi in (False, True)]
        k = (geometry, *(side.family_key(rank, f) for f in fams))
        hit = self._index.get(k)
        if hit is None:
            hit = self._index[k] = {}
            for f in fams:
                for key, off, shape, _, _, kind in side.rank_pieces(rank, f):
                    pre = (off[:2] if kind[0] else off[:1]) if key.startswith(LAYER_PREFIX) else ()
                    hit.setdefault((key, pre), []).append((off, shape))
                    hit[key, off, shape] = True  # the same box in both layouts: kept whole
        return hit

    def owed(self, geometry: str, holders: tuple[int, ...]) -> int:
        """Bytes the boxes of ``holders`` owe their new holders: every element, once to each
        new rank holding it (``Side.nrep``), all state groups of ``geometry``."""
        k = (geometry, holders)
        hit = self._owed.get(k)
        if hit is not None:
            return hit
        via = next(a for a in holders if self.alive[a])
        side = self.old_side[geometry]
        total = 0
        for fam in side.rank_holder_sets(via)[holders]:
            if geometry == DOPT_GEOMETRY and not fam[2]:  # from the shards' sizes, no boxes needed
                for g in self.groups:
                    if g.old_geometry == geometry:
                        new_side = self.new_side[g.new_geometry]
                        for key, pre, _, a, b, _ in side.rank_portions(via, fam):
                            total += (b - a) * g.itemsum * new_side.nrep(key, fam[:2], pre[0] if pre else None)
                continue
            pieces = [x for x in side.rank_pieces(via, fam) if x[3] == holders]
            for g in self.groups:
                if g.old_geometry != geometry:
                    continue
                new_side = self.new_side[g.new_geometry]
                for key, off, shape, _, _, kind in pieces:
                    layer = off[0] if key.startswith(LAYER_PREFIX) else None
                    total += volume(shape) * g.itemsum * new_side.nrep(key, kind, layer)
        self._owed[k] = total
        return total

    def kept(self, geometry: str, holders: tuple[int, ...], device: int) -> int:
        """Bytes of the boxes of ``holders`` that ``device`` (one of them) keeps in place: the
        overlap with its new rank's boxes, all state groups of ``geometry``."""
        rank = self.device_to_rank.get(device)
        if rank is None or not self.alive[device]:
            return 0
        side = self.old_side[geometry]
        total = 0
        for fam in side.rank_holder_sets(device)[holders]:
            k = (geometry, holders, side.family_key(device, fam),
                 tuple(self.new_side[g.new_geometry].family_key(rank, (*fam[:2], multi)) for g in self.groups
                       if g.old_geometry == geometry for multi in (False, True)))
            hit = self._kept.get(k)
            if hit is None:
                hit = 0
                pieces = None
                for g in self.groups:
                    if g.old_geometry != geometry:
                        continue
                    if geometry == DOPT_GEOMETRY and g.new_geometry == DOPT_GEOMETRY and not fam[2]:
                        hit += self._kept_shards(device, rank, fam, holders) * g.itemsum
                        continue
                    if pieces is None:
                        pieces = [x for x in side.rank_pieces(device, fam) if x[3] == holders]
                    index = self._new_index(g.new_geometry, rank, fam)
                    ov = 0
                    for key, off, shape, _, _, kind in pieces:
                        if (key, off, shape) in index:
                            ov += volume(shape)
                            continue
                        pre = (off[:2] if kind[0] else off[:1]) if key.startswith(LAYER_PREFIX) else ()
                        for noff, nshape in index.get((key, pre), ()):
                            common = intersect(off, shape, noff, nshape)
                            if common is not None:
                                ov += volume(common[1])
                    hit += ov * g.itemsum
                self._kept[k] = hit
            total += hit
        return total

    def _kept_shards(self, device: int, rank: int, fam, holders: tuple[int, ...]) -> int:
        """Elements of ``device``'s optimizer shards (family ``fam``, holders ``holders``) that
        its new rank's shards hold too. A parameter split the same way in both layouts has the
        same flat indices in both: its parts meet where their ranges do; others meet box by box."""
        old_side, new_side = self.old_side[DOPT_GEOMETRY], self.new_side[DOPT_GEOMETRY]
        new_parts: dict[tuple[str, Shape], list] = {}
        for key, pre, sig, a, b, _ in new_side.rank_portions(rank, fam):
            new_parts.setdefault((key, pre), []).append((sig, a, b))
        total = 0
        for key, pre, sig, a, b, hs in old_side.rank_portions(device, fam):
            if hs != holders:
                continue
            parts = new_parts.get((key, pre))
            if parts is None:
                continue
            if len(parts) == 1 and parts[0][0] == sig:  # the usual case: one part, split alike
                lo, hi = max(a, parts[0][1]), min(b, parts[0][2])
                if lo < hi:
                    total += hi - lo
                continue
            for nsig, na, nb in parts:
                if nsig == sig:
                    lo, hi = max(a, na), min(b, nb)
                    if lo < hi:
                        total += hi - lo
                else:
                    total += _boxes_meet(sig, a, b, nsig, na, nb, len(pre))
        return total

    def demand(self, geometry: str, holders: tuple[int, ...]) -> int:
        """``W_H``: bytes the new holders of the boxes of ``holders`` need and do not keep."""
        return self.owed(geometry, holders) - sum(self.kept(geometry, holders, a) for a in holders)

    def forced(self, device: int) -> int:
        """Bytes only ``device`` can send (``sources``)."""
        f = self._forced.get(device)
        if f is None:
            f = 0
            if device < self.devices.old_world and self.alive[device]:
                for geometry in self._old_geometries():
                    for holders in self.old_side[geometry].rank_holder_sets(device):
                        if self.pool(holders) == (device,):
                            f += self.demand(geometry, holders)
            self._forced[device] = f
        return f

    def receives(self, device: int) -> int:
        """Bytes ``device`` receives: its new rank's bytes less what it keeps in place."""
        rank = self.device_to_rank.get(device)
        if rank is None:
            return 0
        total = 0
        for g in self.groups:
            total += self.new_side[g.new_geometry].rank_numel(rank) * g.itemsum
        if device < self.devices.old_world and self.alive[device]:
            for geometry in self._old_geometries():
                for holders in self.old_side[geometry].rank_holder_sets(device):
                    total -= self.kept(geometry, holders, device)
        return total

    @staticmethod
    def _side_key(side: Side, rank: int | None):
        if rank is None:
            return None
        if side.geometry == PARAM_GEOMETRY:
            c = side.cfg.coord(rank)
            return ("class", c.pp, c.tp, c.ep, c.etp)
        return ("rank", rank)

    # ---- pools --------------------------------------------------------------------------------
    def shares(self, geometry: str, holders: tuple[int, ...]) -> tuple[tuple[int, ...], list[int], int]:
        """(pool, each member's share, total demand) of a holder set (``sources.targets``)."""
        k = (geometry, holders)
        hit = self._shares.get(k)
        if hit is not None:
            return hit
        pool = self.pool(holders)
        total = self.demand(geometry, holders)
        if total:
            out = (pool, targets(pool, {s: self.forced(s) for s in pool}, total), total)
        else:  # nothing to share: the members' forced loads are not needed
            out = (pool, [0] * len(pool), 0)
        self._shares[k] = out
        return out

    def pool_copies(self, geometry: str, holders: tuple[int, ...], device: int) -> list[Copy]:
        """The network copies served by the pool of ``holders`` (in ``geometry``) that ``device``
        sends or receives. Every demand on the pool is listed (where a demand lands depends on
        those before it); only ``device``'s become copies."""
        r2d, alive = self.rank_to_device, self.alive
        shared = []  # per piece: (order, the piece, its old box's views, destinations)
        for ob in self.old_side[geometry].holder_boxes(holders):
            views = ob.views()
            for gi, g in enumerate(self.groups):
                if g.old_geometry != geometry:
                    continue
                for nb in self.new_side[g.new_geometry].overlapping(ob.key, ob.offset, ob.shape):
                    common = intersect(nb.offset, nb.shape, ob.offset, ob.shape)
                    if common is None:
                        continue
                    off, shp = common
                    dests = [d for _, ranks, _ in nb.groups for d in map(r2d.__getitem__, ranks)
                             if d not in views or not alive[d]]
                    if dests:
                        shared.append(((gi, nb.key, off), (gi, nb, ob, views, off, shp, volume(shp) * g.itemsum),
                                       dests))
        shared.sort(key=itemgetter(0))  # ``split`` takes demands in piece order
        demands: list[Demand] = []
        pieces = []  # per demand: index into ``shared``
        new_demand = tuple.__new__
        for i, (order, piece, dests) in enumerate(shared):
            nbytes, isum = piece[6], self.groups[piece[0]].itemsum
            for d in dests:
                demands.append(new_demand(Demand, (d, order, nbytes, isum)))
                pieces.append(i)
        out: list[Copy] = []
        if not demands:
            return out
        pool, shares, total = self.shares(geometry, holders)
        got = sum(dm.nbytes for dm in demands)
        if got != total:
            raise AssertionError(f"pool {holders} owes {got} bytes, its self passes say {total}")
        parts = split(pool, shares, demands, self.nodes, only=device)
        for q, ps in sorted(parts.items()):
            dm = demands[q]
            gi, nb, ob, views, off, shp, nbytes = shared[pieces[q]][1]
            c = self._copy(gi, nb, ob, off, shp, nbytes, dm.dest)
            for s, first, count in ps:
                out.extend(part_copies(c._replace(src=s, src_view=views[s]), nb.npre, first, count))
        return out

    def _copy(self, gi: int, nb, ob, off: Shape, shp: Shape, nbytes: int, dest: int) -> Copy:
        """The copy of piece ``nb`` x ``ob`` into ``dest``, its source left open."""
        npre = nb.npre
        nview = nb.views()[self.device_to_rank[dest]]
        return Copy(-1, dest, gi, nb.key, off, shp[npre:], None,
                    tuple(o - b for o, b in zip(off[npre:], ob.offset[npre:])), nview,
                    tuple(o - b for o, b in zip(off[npre:], nb.offset[npre:])), nbytes)

    def _demands(self, gi: int, nb, ob, views, r2d, alive):
        """(destination, copy with its source left open) for each new holder of ``nb`` whose
        device does not hold ``ob``."""
        common = intersect(nb.offset, nb.shape, ob.offset, ob.shape)
        if common is None:
            return
        off, shp = common
        npre = nb.npre
        nbytes = volume(shp) * self.groups[gi].itemsum
        lshape = shp[npre:]
        srel = tuple(o - b for o, b in zip(off[npre:], ob.offset[npre:]))
        drel = tuple(o - b for o, b in zip(off[npre:], nb.offset[npre:]))
        for _, ranks, nview in nb.groups:
            for r in ranks:
                d = r2d[r]
                if d in views and alive[d]:
                    continue
                yield d, Copy(-1, d, gi, nb.key, off, lshape, None, srel, nview, drel, nbytes)

    # ---- bounds -------------------------------------------------------------------------------
    def bound(self, device: int) -> int:
        """``TransitionPlan.device_bound`` of ``device``: what it receives, plus its forced load,
        plus for each pool it serves in its share and two elements."""
        b = self._bound.get(device)
        if b is not None:
            return b
        b = self.forced(device) + self.receives(device)
        if device < self.devices.old_world and self.alive[device]:
            for geometry in self._old_geometries():
                for holders in self.old_side[geometry].rank_holder_sets(device):
                    pool = self.pool(holders)
                    if len(pool) > 1 and device in pool:
                        _, shares, total = self.shares(geometry, holders)
                        if total:
                            b += shares[pool.index(device)] + 2 * elem_bytes(self.groups, geometry)
        self._bound[device] = b
        return b

    # ---- one device ---------------------------------------------------------------------------
    def copies(self, device: int) -> list[Copy]:
        """Every copy ``device`` runs: local ones, sends and receives."""
        out: list[Copy] = []
        r2d, alive = self.rank_to_device, self.alive
        holds = device < self.devices.old_world and alive[device]
        pooled: set[tuple[str, tuple[int, ...]]] = set()
        rank = self.device_to_rank.get(device)
        if rank is not None:
            for gi, g in enumerate(self.groups):
                old_side = self.old_side[g.old_geometry]
                for nb, nview in self.new_side[g.new_geometry].rank_boxes(rank):
                    for ob in old_side.overlapping(nb.key, nb.offset, nb.shape):
                        views = ob.views()
                        common = intersect(nb.offset, nb.shape, ob.offset, ob.shape)
                        if common is None:
                            continue
                        if holds and device in views:
                            off, shp = common
                            npre = nb.npre
                            out.append(Copy(device, device, gi, nb.key, off, shp[npre:], views[device],
                                            tuple(o - b for o, b in zip(off[npre:], ob.offset[npre:])), nview,
                                            tuple(o - b for o, b in zip(off[npre:], nb.offset[npre:])),
                                            volume(shp) * g.itemsum))
                            continue
                        holders = tuple(sorted(views))
                        pool = self.pool(holders)
                        if not pool:
                            raise NoSurvivingCopy(f"{nb.key} at {list(common[0])} is held only by dead devices "
                                                  f"{sorted(views)}")
                        if len(pool) > 1:
                            pooled.add((g.old_geometry, holders))
                            continue
                        for d, c in self._demands(gi, nb, ob, views, r2d, alive):
                            if d == device:
                                out.append(c._replace(src=pool[0], src_view=views[pool[0]]))
        if holds:
            for gi, g in enumerate(self.groups):
                new_side = self.new_side[g.new_geometry]
                for key, off, shape, holders, _, _ in self.old_side[g.old_geometry].rank_pieces(device):
                    pool = self.pool(holders)
                    if device not in pool:
                        continue
                    if len(pool) > 1:
                        pooled.add((g.old_geometry, holders))
                        continue
                    ob = next(b for b in self.old_side[g.old_geometry].overlapping(key, off, shape)
                              if b.offset == off and b.shape == shape)
                    views = ob.views()
                    for nb in new_side.overlapping(key, off, shape):
                        for _, c in self._demands(gi, nb, ob, views, r2d, alive):
                            out.append(c._replace(src=device, src_view=views[device]))
        for geometry, holders in sorted(pooled):
            out.extend(self.pool_copies(geometry, holders, device))
        return out

    def plan(self, device: int) -> DevicePlan:
        if not 0 <= device < self.devices.num_devices:
            raise ConfigError("device", f"device {device} is not in the transition (0..{self.devices.num_devices - 1})")
        copies = self.copies(device)
        objects = object_moves(self.old_cfg, self.new_cfg, self.rank_to_device, self.devices, device)
        plan = DevicePlan(self.spec, self.old_cfg, self.new_cfg, self.devices, self.groups, self.rank_to_device,
                          copies, objects, device, self)
        return plan


def _boxes_meet(sig, a: int, b: int, nsig, na: int, nb: int, npre: int) -> int:
    """Elements shared by elements ``[a, b)`` of one parameter and ``[na, nb)`` of another
    (``sig``: (pieces as (global offset, local row), local shape)), box by box."""
    from liveshard.runtime.vps.layout import LocalParam, Piece, flat_regions
    from liveshard.runtime.vps.region import PARAM

    def boxes(sig, lo, hi):
        pieces, local = sig
        gshape = (1,) * npre + local  # only the global offsets matter here
        p = LocalParam("", "", gshape, local, tuple(Piece(o, r) for o, r in pieces), False, False)
        return [(reg.global_offset, (1,) * npre + reg.local_shape) for reg in flat_regions(-1, PARAM, p, lo, hi, False)]

    total = 0
    other = boxes(nsig, na, nb)
    for off, shape in boxes(sig, a, b):
        for noff, nshape in other:
            common = intersect(off, shape, noff, nshape)
            if common is not None:
                total += volume(common[1])
    return total


@dataclass
class DevicePlan:
    """One device's part of a transition (``plan_view.TransitionPlanView``, as the whole plan is
    one): ``copies`` are those ``device`` sends, receives or runs locally; other devices' are
    absent. ``digest`` is the inputs digest; it has no ``checksum`` (that hashes every copy of
    the whole plan)."""

    spec: ModelSpec
    old_cfg: ParallelConfig
    new_cfg: ParallelConfig
    devices: DeviceMap
    groups: tuple[StateGroup, ...]
    rank_to_device: tuple[int, ...]
    copies: list[Copy]  # this device's local copies, sends and receives
    objects: list[ObjectMove]  # the small objects this device sends or receives
    device: int
    planner: Planner
    plan_seconds: float = 0.0

    @property
    def old_layout(self) -> Layout:
        return self.planner.old

    @property
    def new_layout(self) -> Layout:
        return self.planner.new

    @property
    def device_to_rank(self) -> dict[int, int]:
        return self.planner.device_to_rank

    @property
    def standbys(self) -> tuple[int, ...]:
        used = set(self.rank_to_device)
        return tuple(d for d in self.devices.available if d not in used)

    def device_bound(self, device: int) -> int:
        return self.planner.bound(device)

    @cached_property
    def digest(self) -> str:
        """The inputs digest: equal on every device exactly when the plans are parts of one plan."""
        return inputs_digest(self.spec, self.old_cfg, self.new_cfg, self.devices, self.rank_to_device)

    def greedy_schedule(self, budget: int) -> Schedule:
        """Under a budget too small for pairwise rounds the rounds are the whole plan's greedy
        ones: plan it all and keep this device's chunks. (The one place a running job may build
        the whole plan: only budgets below ``schedule.pairwise``'s, 4 x devices x an element.)"""
        from liveshard.runtime.vps.schedule import Chunk, Schedule, greedy_rounds
        from liveshard.runtime.vps.transition import plan_transition

        whole = plan_transition(self.spec, self.old_cfg, self.new_cfg, self.devices, self.rank_to_device)
        sched = self.planner.greedy_cache.get(budget)
        if sched is None:
            sched = self.planner.greedy_cache[budget] = greedy_rounds(whole, budget)
        index = {c: i for i, c in enumerate(self.copies)}
        chunks = [Chunk(index[whole.copies[ch.copy]], *ch[1:]) for ch in sched.chunks
                  if self.device in (whole.copies[ch.copy].src, whole.copies[ch.copy].dst)]
        last_read = {k: v for k, v in sched.last_read.items() if k[0] == self.device}
        return Schedule(budget, chunks, sched.rounds, sched.peak_staging, last_read)


def plan_device(spec: ModelSpec, old_cfg: ParallelConfig, new_cfg: ParallelConfig, devices: DeviceMap,
                rank_to_device: tuple[int, ...], device: int) -> DevicePlan:
    """Device ``device``'s part of the transition (``plan_seconds``: the time it took).

    Raises ``NoSurvivingCopy`` when state this device needs has no live holder; whether every
    device's state has one is a property of the whole transition (the coordinator checks it
    before it publishes a plan)."""
    t0 = time.perf_counter()
    plan = planner(spec, old_cfg, new_cfg, devices, tuple(rank_to_device)).plan(device)
    plan.plan_seconds = time.perf_counter() - t0
    return plan


@lru_cache(maxsize=4)
def planner(spec: ModelSpec, old_cfg: ParallelConfig, new_cfg: ParallelConfig, devices: DeviceMap,
            rank_to_device: tuple[int, ...]) -> Planner:
    """A ``Planner`` for these inputs (cached: several devices of one process share its work)."""
    from liveshard.runtime.vps.transition import check_rank_to_device

    devices.check_fits(new_cfg.world_size)
    check_rank_to_device(tuple(rank_to_device), new_cfg.world_size, devices)
    return Planner(spec, old_cfg, new_cfg, devices, tuple(rank_to_device))


def lost_state(spec: ModelSpec, old_cfg: ParallelConfig, new_cfg: ParallelConfig, devices: DeviceMap,
               rank_to_device: tuple[int, ...]) -> str | None:
    """Why the transition cannot take its state from the old world, or None when every piece
    has a live holder: what ``transition.plan_transition`` raises as ``NoSurvivingCopy``, from
    the dead devices' own boxes and their holder sets, without planning a copy.

    Every old element is wanted by some new rank (the new layout holds every tensor), and a
    piece held only by dead devices is held by one of them: so only the dead devices' holder
    sets (``Side.rank_holder_sets``) need looking at. Raises what planning raises for inputs
    that cannot be planned at all (``ConfigError``, ``InvalidDeviceOrder``)."""
    from liveshard.runtime.vps.transition import check_rank_to_device

    if devices.old_world != old_cfg.world_size:
        raise ConfigError("old config", f"the old config has {old_cfg.world_size} ranks but the device map "
                                        f"{devices.old_world} old devices", "old rank i runs on device i")
    old, new = Layout(spec, old_cfg), Layout(spec, new_cfg)
    devices.check_fits(new_cfg.world_size)
    check_rank_to_device(tuple(rank_to_device), new_cfg.world_size, devices)
    dead = devices.dead
    if not dead:
        return None
    for geometry in dict.fromkeys(g.old_geometry for g in state_groups(old, new)):
        side = Side(old, geometry)
        for d in sorted(dead):
            for holders in side.rank_holder_sets(d):
                if all(h in dead for h in holders):
                    key, off = next((k, o) for k, o, _, hs, _, _ in side.rank_pieces(d) if hs == holders)
                    return f"{key} at {list(off)} is held only by dead devices {list(holders)}"
    if len(dead) == devices.old_world:
        return "every old device is dead"
    return None
