"""The one owner of a world's parallel config and its rank order.

``plan_world`` is what the operator calls for every plan it writes, what the coordinator calls
when it must plan alone (a member lost without notice, a local run's "whatever fits" request)
and what the local driver's checkpoint mode calls: the same function on the same inputs gives
the same world, and nobody re-orders its ranks afterwards (``status.plan.members`` is the rank
order that runs).

Rank order: the GPUs are first put in *continuity order*, the running world's members in their
rank order, then everybody else in the order given. The search's placement keeps that order
wherever speeds, nodes and memory tie, so a survivor keeps its place. A config given by the
caller (an explicit reconfiguration) is checked and placed in that same order, unpriced. When
the layout itself changes (TP, PP, EP or the layer split), continuity is not what keeps state in
place: the order is then the one the VPS transition planner finds moves the least state
(``least_movement``), provided the cost model prices it exactly the same (every GPU alike, the
same groups inside a node, each pod's GPUs consecutive and in order).

Objectives (``Constraints.objective``): ``throughput``, the cost model's fastest config
(``search.plan_parallelism``); ``fewest-changes``, the current TP/PP/EP degrees with DP as large
as the global batch allows, else the valid config with the most GPUs and the fewest changed
degrees. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from liveshard.runtime.data.batches import BatchPlan
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.planner.cost_model import Hardware
from liveshard.runtime.planner.search import GPU, Constraints, NoFeasiblePlan, ParallelPlan, plan_parallelism
from liveshard.runtime.spec import ModelSpec

THROUGHPUT = "throughput"
FEWEST_CHANGES = "fewest-changes"
OBJECTIVES = (THROUGHPUT, FEWEST_CHANGES)


def continuity_order(gpus: Sequence[GPU], current: Sequence[str]) -> list[GPU]:
    """The running world's GPUs in their rank order, then the others in the order given."""
    rank = {g: i for i, g in enumerate(current)}
    running = sorted((g for g in gpus if g.id in rank), key=lambda g: rank[g.id])
    return running + [g for g in gpus if g.id not in rank]


def plan_world(spec: ModelSpec, gpus: Sequence[GPU], constraints: Constraints, *,
               current: ParallelConfig | None = None, current_members: Sequence[str] = (),
               lost: Sequence[str] = (), config: ParallelConfig | None = None,
               hardware: Hardware | None = None) -> ParallelPlan:
    """The config and rank order for a world on (a subset of) ``gpus``.

    ``current``/``current_members``: the running world (config and GPU ids in rank order), or
    none; ``lost``: its members that are gone without notice (they hold nothing to copy from).
    ``config``: a config fixed by the caller (only placed, not chosen). Raises
    ``NoFeasiblePlan`` when nothing fits, ``ConfigError`` for a config that cannot run here.
    """
    if constraints.objective not in OBJECTIVES:
        raise ConfigError("objective", f"unknown planner objective {constraints.objective!r}",
                          f"use one of {', '.join(OBJECTIVES)}")
    ordered = continuity_order(gpus, current_members)
    if config is None and constraints.objective == FEWEST_CHANGES:
        config = closest_config(spec, current or ParallelConfig(dist_opt=constraints.dist_opt), ordered,
                                constraints)
    if config is None:
        plan = _with_min_dp(spec, ordered, constraints, hardware)
    else:
        plan = place(spec, config, ordered, constraints)
    if current is not None and current_members:
        plan = least_movement(spec, plan, current, tuple(current_members), constraints.granularity, tuple(lost))
    return plan


def _with_min_dp(spec: ModelSpec, gpus: Sequence[GPU], constraints: Constraints,
                 hardware: Hardware | None) -> ParallelPlan:
    """The fastest plan with at least ``constraints.min_dp`` copies of the state; when none
    fits (too few GPUs, too little memory, a batch it does not divide), the fastest with fewer,
    saying so first in its explanation."""
    try:
        return plan_parallelism(spec, gpus, constraints, hardware)
    except NoFeasiblePlan as e:
        if constraints.min_dp <= 1:
            raise
        fallback = plan_parallelism(spec, gpus, replace(constraints, min_dp=1), hardware)
        why = (f"minDataParallel {constraints.min_dp} not met: {e}; dp={fallback.config.dp}, so losing a "
               "member can lose state that has no other copy")
        return replace(fallback, explanation=(why, *fallback.explanation))


def _layout_key(cfg: ParallelConfig) -> tuple:
    return (cfg.tp, cfg.pp, cfg.cp, cfg.ep, cfg.expert_tp, cfg.layers)


def least_movement(spec: ModelSpec, plan: ParallelPlan, current: ParallelConfig, current_members: tuple[str, ...],
                   granularity: int = 1, lost: tuple[str, ...] = ()) -> ParallelPlan:
    """``plan`` with its ranks on the GPUs that already hold most of their state, when the
    layout changes and the new order prices exactly as the planner's; else ``plan`` as it is.
    Chosen and priced from the layouts' overlap (``vps.transition.overlap_figures``): no
    transition plan is built."""
    from liveshard.runtime.vps.devices import DeviceMap
    from liveshard.runtime.vps.transition import overlap_figures

    cfg = plan.config
    world = plan.gpus
    if _layout_key(cfg) == _layout_key(current) or current.world_size != len(current_members):
        return plan
    if len({g.speed for g in world}) > 1 or len({g.memory_bytes for g in world}) > 1:
        return plan  # the cost model placed stragglers or small GPUs on purpose
    pool = {g.id: g for g in world}  # the planner chose these GPUs: only their order may change
    joiners = [g.id for g in world if g.id not in set(current_members)]
    by_device = (*current_members, *joiners)
    dead = frozenset(i for i, m in enumerate(current_members) if m in set(lost))
    leaving = frozenset(i for i, m in enumerate(current_members) if m not in pool) - dead
    try:
        devices = DeviceMap(len(current_members), leaving=leaving, joining=len(joiners), dead=dead)
        figures = overlap_figures(spec, current, cfg, devices)
    except ConfigError:
        return plan
    order = tuple(pool[by_device[d]] for d in figures.best_order)
    if order == world or not _prices_alike(world, order, cfg, granularity):
        return plan
    kept_best = figures.kept_bytes(figures.best_order)
    kept_given = figures.kept_bytes(tuple(by_device.index(g.id) for g in world))
    if kept_best <= kept_given:
        return plan
    note = f"rank order: {(kept_best - kept_given) / 1e6:.1f} MB more of the state stays where it is"
    return replace(plan, gpus=order, explanation=(*plan.explanation, note))


def _prices_alike(a: Sequence[GPU], b: Sequence[GPU], cfg: ParallelConfig, granularity: int) -> bool:
    """Whether the cost model sees the two orders alike (same groups inside a node), and ``b``
    keeps every pod's GPUs consecutive and in their local order."""
    from liveshard.runtime.planner.placement import Arrangement

    if granularity > 1:
        for start in range(0, len(b), granularity):
            ids = [g.id for g in b[start:start + granularity]]
            pod = ids[0].rpartition("/")[0]
            if ids != [f"{pod}/{k}" for k in range(granularity)]:
                return False
    world = len(a)
    x, y = Arrangement(a), Arrangement(b)
    for size in {cfg.tp * cfg.cp, cfg.ep * cfg.expert_tp, granularity}:
        if world % size == 0 and x.blocks_local(size, world) != y.blocks_local(size, world):
            return False
    return x.local(0, world) == y.local(0, world)


def place(spec: ModelSpec, cfg: ParallelConfig, ordered: Sequence[GPU], c: Constraints) -> ParallelPlan:
    """``cfg`` on the first GPUs of ``ordered``, checked against the model, the batch and the pods."""
    cfg.validate(spec)
    world = cfg.world_size
    if world > len(ordered):
        raise ConfigError("config", f"{cfg} needs {world} workers, {len(ordered)} given",
                          "choose a smaller config or add workers")
    if world % c.granularity:
        raise ConfigError("config", f"{cfg} uses {world} GPUs, not whole pods of {c.granularity}",
                          f"use a world size that is a multiple of {c.granularity}")
    _check_batch(cfg, c)
    ranks, standby = tuple(ordered[:world]), tuple(ordered[world:])
    return ParallelPlan(config=cfg, gpus=ranks, step_seconds=0.0, tokens_per_second=0.0,
                        memory_bytes_per_gpu=0, explanation=(f"{cfg} as requested, in continuity order",),
                        standby=standby)


def _check_batch(cfg: ParallelConfig, c: Constraints) -> None:
    if cfg.dp_split is not None:
        # Micro-batches per replica: they must add up to the global batch, divisible or not.
        BatchPlan(c.global_batch, c.micro_batch, cfg.dp, cfg.dp_split)
        return
    if c.global_batch % (cfg.dp * c.micro_batch):
        raise ConfigError("config", f"global batch {c.global_batch} does not split over dp={cfg.dp} "
                                    f"x micro-batch {c.micro_batch}",
                          "choose a dp that divides global_batch / micro_batch")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def closest_config(spec: ModelSpec, current: ParallelConfig, gpus: Sequence[GPU],
                   c: Constraints) -> ParallelConfig:
    """The ``fewest-changes`` choice: the most GPUs first, then the fewest changed degrees
    (TP, PP, EP against ``current``), then the smallest TP x PP. Keeps the current config's
    optimizer settings; a non-uniform layer or DP split is dropped (it was priced for other GPUs)."""
    limit = min(len(gpus), c.max_gpus or len(gpus))
    candidates: list[tuple[tuple, ParallelConfig]] = []
    for world in range(limit - limit % c.granularity, 0, -c.granularity):
        for tp in _divisors(world):
            if c.tp and tp not in c.tp:
                continue
            for pp in _divisors(world // tp):
                if c.pp and pp not in c.pp:
                    continue
                dp = world // (tp * pp)
                if c.global_batch % (dp * c.micro_batch):
                    continue
                ep = current.ep if current.ep <= dp * tp and (dp * tp) % current.ep == 0 else 1
                if c.ep and ep not in c.ep:
                    continue
                cfg = replace(current, tp=tp, pp=pp, dp=dp, ep=ep, cp=1, layers=None, dp_split=None)
                try:
                    cfg.validate(spec)
                except ConfigError:
                    continue
                changes = (tp != current.tp) + (pp != current.pp) + (ep != current.ep)
                candidates.append(((changes, tp * pp, tp), cfg))
        if candidates:
            return min(candidates, key=lambda x: x[0])[1]
    raise NoFeasiblePlan(f"no valid parallel config for {spec.name} fits {len(gpus)} GPU(s) with global batch "
                         f"{c.global_batch} and micro-batch {c.micro_batch}", "gpus")
