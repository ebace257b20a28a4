"""The parallelism planner: the fastest (tp, pp, dp, ep) for the GPUs a job has now.

``plan_parallelism(spec, gpus, constraints)`` enumerates parallel configs, prices each with the
cost model in ``cost_model`` (compute, TP/PP/DP/EP traffic, pipeline bubble, optimizer step)
under a fixed global batch, keeps those whose worst GPU fits in memory, and returns the fastest,
with its layer split per pipeline stage (slow stages get fewer layers, ``layer_split``), its
rank -> GPU order (``placement``) and an explanation naming the cost terms and the runner-up.

Search: a config's step time is at least its compute time spread perfectly over its GPUs plus
the pipeline fill, a bound that falls as pp grows; configs are priced in order of that bound and
the search stops once the bound passes the runner-up. Pure: no torch, no kopf, no kubernetes.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from liveshard.runtime.errors import ConfigError
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.planner.cost_model import Hardware, ModelCosts
from liveshard.runtime.planner.layer_split import balance_layers
from liveshard.runtime.planner.placement import Arrangement, arrangements
from liveshard.runtime.spec import ModelSpec

GiB = 2**30


@dataclass(frozen=True)
class GPU:
    id: str  # stable id, e.g. "<pod-name>/<local-index>"
    node: str  # node name (GPUs on one node share NVLink)
    memory_bytes: int
    speed: float = 1.0  # relative measured throughput; < 1.0 for a straggler


@dataclass(frozen=True)
class Constraints:
    tp: tuple[int, ...] | None = None  # allowed degrees (None: any valid)
    pp: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None
    global_batch: int = 256  # sequences per optimizer step, fixed across plans
    micro_batch: int = 1
    seq_length: int | None = None  # None: spec.max_sequence_length
    dist_opt: bool = True
    # World size and GPU selection come in whole groups of this many consecutive GPUs
    # (= GPUs per worker pod).
    granularity: int = 1
    max_gpus: int | None = None
    # What the planner optimises (``world.plan_world``): "throughput", the cost model's fastest
    # config; or "fewest-changes", the current degrees on as many GPUs as the batch allows
    # (scripted CPU runs, where the cost model's GPU figures mean nothing).
    objective: str = "throughput"
    # the least data-parallel degree (copies of the model state) to choose when the GPUs allow
    # it; world.plan_world falls back to fewer, and says why, when they do not
    min_dp: int = 1


@dataclass(frozen=True)
class ParallelPlan:
    config: ParallelConfig
    gpus: tuple[GPU, ...]  # rank order: rank i runs on gpus[i]
    step_seconds: float  # modeled time per optimizer step
    tokens_per_second: float
    memory_bytes_per_gpu: int  # worst GPU, incl. activations
    explanation: tuple[str, ...]  # why this plan: the cost terms and the runner-up
    standby: tuple[GPU, ...] = ()  # GPUs given but left unused
    costs: tuple[tuple[str, float], ...] = ()  # the step time's terms (seconds), summing to it
    stage_memory_bytes: tuple[int, ...] = ()  # worst GPU per pipeline stage
    # Why GPUs were left standby, in one line ("" when none were): the batch, a cap, or the cost
    # model finding fewer GPUs faster (by how much). The CLI prints it, callers can log it.
    standby_reason: str = ""


class NoFeasiblePlan(Exception):
    """No config fits; ``str(e)`` says what is short, ``short`` says which kind of shortage.

    ``short`` is one of ``"memory"``, ``"gpus"`` (too few for any allowed degrees) or
    ``"constraints"`` (the allowed degrees do not fit the model; ``field`` names which:
    ``"tp"``, ``"pp"`` or ``"ep"``).
    """

    def __init__(self, message: str, short: str, field: str | None = None) -> None:
        super().__init__(message)
        self.short = short
        self.field = field


# ---- the search ------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Family:
    """Configs that differ only in pp: everything per layer is fixed here."""

    arrangement: Arrangement
    reverse: bool  # stage 0 takes the last block (the slowest GPUs) instead of the first
    tp: int
    dp: int
    ep: int
    etp: int
    m: int  # micro-batches per DP rank
    pps: tuple[int, ...]  # allowed pp, largest first
    layer_flops: float  # per micro-batch on one rank
    out_flops: float
    state_per_layer: float  # bytes
    act_per_layer: float
    first_state: float
    last_state: tuple[float, float]  # (pp == 1, pp > 1): tied embeddings add a copy
    logits: float
    dense_per_layer: float  # parameters on one rank
    expert_per_layer: float
    lb_per_pass: float  # optimistic seconds for one micro-batch through all layers

    @property
    def edp(self) -> int:
        return self.tp * self.dp // (self.etp * self.ep)

    def shape(self, pp: int) -> tuple[int, int, int, int, int]:
        return (self.tp, pp, self.dp, self.ep, self.etp)


@dataclass
class _Priced:
    family: _Family
    pp: int
    layers: tuple[int, ...]
    stage_seconds: tuple[float, ...]  # one micro-batch forward + backward
    step: float
    terms: tuple[tuple[str, float], ...]
    stage_memory: tuple[float, ...]
    bottleneck: int
    links: dict[str, bool]  # group kind -> stays inside a node

    @property
    def world(self) -> int:
        return self.family.tp * self.family.dp * self.pp


class _Search:
    def __init__(self, spec: ModelSpec, gpus: Sequence[GPU], c: Constraints, hw: Hardware) -> None:
        self.spec, self.c, self.hw = spec, c, hw
        self.seq = c.seq_length or spec.max_sequence_length
        self.costs = ModelCosts.of(spec, self.seq, c.micro_batch, hw)
        self.flops = hw.flops(spec.params_dtype)
        self.arrangements = arrangements(gpus, c.granularity)
        self.n = len(gpus)
        limit = self.n if c.max_gpus is None else min(self.n, c.max_gpus)
        self.max_world = limit - limit % c.granularity
        self.node_size = max(_node_sizes(gpus).values())
        self.moe_fraction = (self.costs.layer_experts / spec.num_moe_experts) if spec.is_moe else 0.0
        self.evaluated = 0
        self.memory_short: list[tuple[_Family, int]] = []
        self.all_families: list[_Family] = []

    # ---- enumeration -------------------------------------------------------------------------
    def degrees(self) -> tuple[list[int], list[int], list[int], list[int]]:
        spec, c = self.spec, self.c
        tps = _allowed_tp(spec, c.tp, self.node_size)
        pps = [p for p in (c.pp or range(1, spec.num_layers + 1)) if 1 <= p <= spec.num_layers]
        if not pps:
            raise NoFeasiblePlan(f"pp: none of {list(c.pp or ())} is within 1..{spec.num_layers} "
                                 f"(the model's layers)", "constraints", "pp")
        per_step = c.global_batch // c.micro_batch
        dps = [d for d in range(max(1, c.min_dp), per_step + 1) if per_step % d == 0]
        return tps, sorted(set(pps), reverse=True), dps, _allowed_ep(spec, c.ep)

    def families(self) -> list[_Family]:
        tps, pps, dps, eps = self.degrees()
        out = []
        g = self.c.granularity
        for arr in self.arrangements:
            for reverse in ((False,) if arr.uniform_speed else (False, True)):
                for tp in tps:
                    for dp in dps:
                        stage = tp * dp
                        # Reversed stage order keeps every pod's GPUs consecutive only when pods
                        # and stages nest.
                        if reverse and stage % g and g % stage:
                            continue
                        allowed = tuple(p for p in pps if stage * p <= self.max_world and (stage * p) % g == 0)
                        if not allowed:
                            continue
                        for ep, etp in expert_grids(self.spec, eps, tp, stage):
                            out.append(self._family(arr, reverse, tp, dp, ep, etp, allowed))
        return out

    def _family(self, arr: Arrangement, reverse: bool, tp: int, dp: int, ep: int, etp: int,
                pps: tuple[int, ...]) -> _Family:
        k, hw, c = self.costs, self.hw, self.c
        edp = tp * dp // (etp * ep)
        dense = k.layer_dense_params(tp)
        expert = k.layer_expert_params(ep, etp)
        bpp_dense = k.state_bytes_per_param(hw, dp, c.dist_opt)
        bpp_expert = k.state_bytes_per_param(hw, edp, c.dist_opt)
        slowdown = self.expert_slowdown(tp, ep, etp)
        layer_flops = (k.flops_per_token_layer + slowdown * k.expert_flops_per_token_layer) * k.tokens / tp
        out_flops = k.flops_per_token_output * k.tokens / tp
        # Optimistic per-layer communication: NVLink wherever the group could fit in a node.
        tp_comm = self._tp_layer_seconds(tp, etp, tp <= self.node_size)
        ep_comm = self._ep_layer_seconds(tp, ep, ep * etp <= self.node_size)
        rate = self.flops * arr.max_speed
        pass_seconds = (self.spec.num_layers * (layer_flops / rate + tp_comm + self.moe_fraction * ep_comm)
                        + out_flops / rate)
        return _Family(
            arrangement=arr, reverse=reverse, tp=tp, dp=dp, ep=ep, etp=etp,
            m=c.global_batch // (dp * c.micro_batch), pps=pps,
            layer_flops=layer_flops, out_flops=out_flops,
            state_per_layer=dense * bpp_dense + expert * bpp_expert,
            act_per_layer=k.layer_activation_bytes(tp),
            first_state=k.first_stage_params(tp) * bpp_dense,
            last_state=(k.last_stage_params(tp, 1) * bpp_dense, k.last_stage_params(tp, 2) * bpp_dense),
            logits=k.logits_bytes(tp), dense_per_layer=dense, expert_per_layer=expert,
            lb_per_pass=pass_seconds,
        )

    def expert_slowdown(self, tp: int, ep: int, etp: int) -> float:
        """Extra time of the expert matmuls over their FLOPs at the MFU (0 for a dense model).

        Each expert sees the routed tokens of its EP x expert-TP group (tokens per rank are the
        micro-batch's over TP, sequence parallel): few when EP is small, which leaves the matmuls
        bound by reading the weights; expert TP narrows their columns as well."""
        spec = self.spec
        if not spec.is_moe:
            return 0.0
        rows = self.costs.tokens / tp * ep * etp * spec.moe_router_topk / spec.num_moe_experts
        return self.hw.expert_gemm_slowdown(rows, (spec.moe_ffn_hidden_size or 0) / etp, spec.hidden_size)

    @staticmethod
    def lower_bound(f: _Family, pp: int) -> float:
        # max stage >= mean stage: (m - 1) * max + sum >= (m - 1 + pp) / pp * sum
        return (f.m - 1 + pp) / pp * f.lb_per_pass

    # ---- communication -----------------------------------------------------------------------
    def _tp_layer_seconds(self, tp: int, etp: int, local: bool) -> float:
        """TP traffic of an average layer, one micro-batch, forward and backward."""
        if tp == 1:
            return 0.0
        bw, lat = self.hw.link(local)
        size = self.costs.hidden_bytes_per_token * self.costs.tokens
        # Sequence parallel: an all-gather before and a reduce-scatter after attention and after
        # the MLP, forward and backward. An MoE layer with expert-TP 1 (and no shared expert)
        # moves its tokens by the expert all-to-all instead.
        mlp = 1.0
        if self.spec.is_moe and etp == 1 and not self.spec.moe_shared_expert_intermediate_size:
            mlp = 1.0 - self.moe_fraction
        return 4 * (1 + mlp) * ((tp - 1) / tp * size / bw + lat)

    def _ep_layer_seconds(self, tp: int, ep: int, local: bool) -> float:
        if ep == 1:
            return 0.0
        bw, lat = self.hw.link(local)
        size = self.costs.hidden_bytes_per_token * self.costs.tokens / tp * self.costs.topk
        # Dispatch + combine, forward and backward: 4 all-to-alls of each token's top-k copies.
        return 4 * ((ep - 1) / ep * size / bw + lat)

    def _dp_seconds_per_param(self, shards: int, local: bool) -> float:
        if shards == 1:
            return 0.0
        bw, _ = self.hw.link(local)
        frac = (shards - 1) / shards
        if self.c.dist_opt:  # reduce-scatter gradients, all-gather updated weights
            return frac * (self.hw.grad_bytes + self.spec.bytes_per_param) / bw
        return 2 * frac * self.hw.grad_bytes / bw  # all-reduce

    # ---- pricing one config ------------------------------------------------------------------
    def stage_blocks(self, f: _Family, pp: int) -> list[int]:
        return list(range(pp - 1, -1, -1)) if f.reverse else list(range(pp))

    def memory_terms(self, f: _Family, pp: int, memory: int | None = None
                     ) -> tuple[list[float], list[float], list[float]]:
        """Per stage: usable bytes, fixed bytes (embeddings, logits), bytes per layer.

        ``memory``: pretend every GPU has this much (else each stage's smallest GPU counts).
        """
        mems = f.arrangement.block_min_memory(f.tp * f.dp) if memory is None else None
        usable, fixed, per_layer = [], [], []
        last = f.last_state[pp > 1] + f.logits
        for i, blk in enumerate(self.stage_blocks(f, pp)):
            usable.append((memory if mems is None else mems[blk]) * self.hw.memory_usable_fraction)
            fixed.append((f.first_state if i == 0 else 0.0) + (last if i == pp - 1 else 0.0))
            per_layer.append(f.state_per_layer + f.act_per_layer * min(pp - i, f.m))
        return usable, fixed, per_layer

    def price(self, f: _Family, pp: int) -> _Priced | None:
        self.evaluated += 1
        L = self.spec.num_layers
        usable, fixed, per_layer = self.memory_terms(f, pp)
        caps = layer_caps(usable, fixed, per_layer)
        if min(caps) < 1 or sum(caps) < L:
            self.memory_short.append((f, pp))
            return None
        arr, stage = f.arrangement, f.tp * f.dp
        world = stage * pp
        speeds = arr.block_min_speed(stage)
        blocks = self.stage_blocks(f, pp)
        links = {"tp": arr.blocks_local(f.tp, world), "pp": arr.local(0, world),
                 "ep": arr.blocks_local(f.ep * f.etp, world)}
        tp_comm = self._tp_layer_seconds(f.tp, f.etp, links["tp"])
        ep_comm = self._ep_layer_seconds(f.tp, f.ep, links["ep"]) * self.moe_fraction
        p2p = 0.0
        if pp > 1:
            bw, lat = self.hw.link(links["pp"])
            p2p = 2 * (self.costs.hidden_bytes_per_token * self.costs.tokens / f.tp / bw + lat)
        slope, intercept, compute_rate = [], [], []
        for i, blk in enumerate(blocks):
            rate = self.flops * speeds[blk]
            compute_rate.append(rate)
            slope.append(f.layer_flops / rate + tp_comm + ep_comm)
            intercept.append((f.out_flops / rate if i == pp - 1 else 0.0) + p2p)
        layers = balance_layers(L, slope, intercept, caps)
        assert layers is not None  # the caps were checked above
        stage_seconds = [a * n + b for a, n, b in zip(slope, layers, intercept)]
        b = max(range(pp), key=stage_seconds.__getitem__)

        # Data-parallel gradient traffic and the optimizer step, per stage; the slowest counts.
        stage_local = arr.block_local(stage)
        dense_sec = [self._dp_seconds_per_param(f.dp, stage_local[blk]) for blk in blocks]
        expert_sec = [self._dp_seconds_per_param(f.edp, stage_local[blk]) for blk in blocks]
        opt_bytes = (self.hw.grad_bytes + 2 * self.costs.optimizer_bytes_per_param()
                     + self.spec.bytes_per_param)
        dp_time = opt_time = 0.0
        last_params = self.costs.last_stage_params(f.tp, pp)
        for i, n in enumerate(layers):
            dense = n * f.dense_per_layer + (self.costs.first_stage_params(f.tp) if i == 0 else 0.0) \
                + (last_params if i == pp - 1 else 0.0)
            expert = n * f.expert_per_layer
            dp_time = max(dp_time, dense * dense_sec[i] + expert * expert_sec[i])
            shards = (f.dp, f.edp) if self.c.dist_opt else (1, 1)
            opt_time = max(opt_time, (dense / shards[0] + expert / shards[1]) * opt_bytes
                           / self.hw.hbm_bytes_per_s)
        dp_exposed = dp_time * (1 - self.hw.dp_overlap)
        m, t_b = f.m, stage_seconds[b]
        share = f.layer_flops * layers[b] / compute_rate[b] + (f.out_flops / compute_rate[b] if b == pp - 1 else 0)
        terms = (
            ("compute", m * share),
            ("tensor_parallel", m * layers[b] * tp_comm),
            ("expert_parallel", m * layers[b] * ep_comm),
            ("pipeline_p2p", m * p2p),
            ("pipeline_bubble", sum(stage_seconds) - t_b),
            ("data_parallel", dp_exposed),
            ("optimizer", opt_time),
        )
        step = (m - 1) * t_b + sum(stage_seconds) + dp_exposed + opt_time
        stage_memory = tuple(x + n * p for x, n, p in zip(fixed, layers, per_layer))
        return _Priced(f, pp, layers, tuple(stage_seconds), step, terms, stage_memory, b, links)

    def leanest(self) -> tuple[float, _Family, int, float, float] | None:
        """Among configs that did not fit: (need/usable, family, pp, need, usable) of the closest."""
        best = None
        for f, pp in self.memory_short:
            usable, fixed, per_layer = self.memory_terms(f, pp)
            # The split that minimises the worst GPU's share of its memory.
            split = balance_layers(self.spec.num_layers, [p / u for p, u in zip(per_layer, usable)],
                                   [x / u for x, u in zip(fixed, usable)])
            if split is None:
                continue
            ratio, i = max(((x + n * p) / u, i) for i, (x, n, p, u)
                           in enumerate(zip(fixed, split, per_layer, usable)))
            need = fixed[i] + split[i] * per_layer[i]
            if best is None or ratio < best[0]:
                best = (ratio, f, pp, need, usable[i])
        return best

    # ---- the loop ------------------------------------------------------------------------------
    def run(self, exhaustive: bool = False) -> tuple[_Priced | None, _Priced | None, int]:
        families = self.families()
        self.all_families = families
        heap = [(self.lower_bound(f, f.pps[0]), i, 0) for i, f in enumerate(families)]
        heapq.heapify(heap)
        best_by_shape: dict[tuple[int, ...], _Priced] = {}
        top: list[_Priced] = []  # the best two shapes
        considered = sum(len(f.pps) for f in families)
        while heap:
            bound, i, j = heapq.heappop(heap)
            if len(top) == 2 and bound > top[1].step and not exhaustive:
                break
            f = families[i]
            if j + 1 < len(f.pps):
                heapq.heappush(heap, (self.lower_bound(f, f.pps[j + 1]), i, j + 1))
            priced = self.price(f, f.pps[j])
            if priced is None:
                continue
            key = f.shape(priced.pp)
            if key in best_by_shape and _order(best_by_shape[key]) <= _order(priced):
                continue
            best_by_shape[key] = priced
            top = sorted({_shape(p): p for p in [*top, priced]}.values(), key=_order)[:2]
        best = top[0] if top else None
        runner = top[1] if len(top) > 1 else None
        return best, runner, considered


def layer_caps(usable: list[float], fixed: list[float], per_layer: list[float]) -> list[int]:
    """How many layers each stage's memory holds."""
    return [int((u - x) // p) if u > x else 0 for u, x, p in zip(usable, fixed, per_layer)]


def _shape(p: _Priced) -> tuple[int, ...]:
    return p.family.shape(p.pp)


def _order(p: _Priced) -> tuple:
    """Faster first; on a tie fewer GPUs, then smaller degrees (stable, deterministic)."""
    f = p.family
    return (p.step, p.world, f.tp, p.pp, f.ep, f.etp, f.reverse)


# ---- the public entry point ------------------------------------------------------------------

def plan_parallelism(spec: ModelSpec, gpus: Sequence[GPU], constraints: Constraints = Constraints(),
                     hardware: Hardware | None = None, *, exhaustive: bool = False) -> ParallelPlan:
    """The fastest feasible plan for ``spec`` on (a subset of) ``gpus``.

    ``exhaustive`` prices every candidate instead of stopping at the lower bound (slow; it is
    the reference the bounded search is checked against). Raises ``NoFeasiblePlan`` when nothing
    fits, ``ConfigError`` for malformed input.
    """
    hw = hardware or Hardware()
    _check(spec, gpus, constraints)
    if not gpus:
        raise NoFeasiblePlan(f"no GPUs to plan {spec.name} on", "gpus")
    search = _Search(spec, gpus, constraints, hw)
    best, runner, considered = search.run(exhaustive)
    if best is None:
        from liveshard.runtime.planner.explain import why_nothing_fits

        raise why_nothing_fits(search)
    return _build_plan(search, best, runner, considered)


def _check(spec: ModelSpec, gpus: Sequence[GPU], c: Constraints) -> None:
    spec.require_supported()
    for name in ("global_batch", "micro_batch", "granularity"):
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"constraints.{name}", f"must be a positive integer, got {value!r}")
    if c.global_batch % c.micro_batch:
        raise ConfigError("constraints.global_batch",
                          f"{c.global_batch} sequences do not split into micro-batches of {c.micro_batch}",
                          "make global_batch a multiple of micro_batch")
    if c.seq_length is not None and (not isinstance(c.seq_length, int) or c.seq_length < 1):
        raise ConfigError("constraints.seq_length", f"must be a positive integer, got {c.seq_length!r}")
    if (c.seq_length or 0) > spec.max_sequence_length and spec.position_embedding_type == "learned_absolute":
        raise ConfigError("constraints.seq_length",
                          f"{c.seq_length} tokens exceed the model's {spec.max_sequence_length} learned positions",
                          f"use at most {spec.max_sequence_length}")
    if c.max_gpus is not None and c.max_gpus < 1:
        raise ConfigError("constraints.max_gpus", f"must be a positive integer, got {c.max_gpus!r}")
    for name in ("tp", "pp", "ep"):
        values = getattr(c, name)
        if values is not None and (not values or any(not isinstance(v, int) or v < 1 for v in values)):
            raise ConfigError(f"constraints.{name}", f"allowed degrees must be positive integers, got {values!r}",
                              "leave it unset to allow any valid degree")
    seen: set[str] = set()
    for g in gpus:
        if g.id in seen:
            raise ConfigError("gpus", f"GPU id {g.id!r} appears twice", "give every GPU a unique id")
        seen.add(g.id)
        if not g.memory_bytes or g.memory_bytes <= 0:
            raise ConfigError("gpus", f"GPU {g.id!r} has memory_bytes={g.memory_bytes!r}", "give its memory in bytes")
        if not g.speed > 0:
            raise ConfigError("gpus", f"GPU {g.id!r} has speed={g.speed!r}", "speeds are relative and > 0")
    if len(gpus) % c.granularity:
        raise ConfigError("constraints.granularity",
                          f"{len(gpus)} GPUs are not whole groups of {c.granularity} (GPUs per worker pod)",
                          "pass every pod's GPUs, or set granularity to the GPUs per pod")


def _node_sizes(gpus: Sequence[GPU]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for g in gpus:
        sizes[g.node] = sizes.get(g.node, 0) + 1
    return sizes


def _allowed_tp(spec: ModelSpec, allowed: tuple[int, ...] | None, node_size: int) -> list[int]:
    """TP degrees the model splits over; by default up to one node's GPUs."""
    if allowed is None:
        candidates = [t for t in range(1, max(node_size, 1) + 1) if spec.num_attention_heads % t == 0]
    else:
        candidates = sorted(set(allowed))
    ok, why = [], []
    for t in candidates:
        try:
            ParallelConfig(tp=t).validate(spec)
        except ConfigError as e:
            why.append(f"tp={t}: {e.problem}")
            continue
        ok.append(t)
    if not ok:
        raise NoFeasiblePlan("no allowed tp fits the model: " + "; ".join(why), "constraints", "tp")
    return ok


def _allowed_ep(spec: ModelSpec, allowed: tuple[int, ...] | None) -> list[int]:
    if not spec.is_moe:
        if allowed is not None and 1 not in allowed:
            raise NoFeasiblePlan(f"ep: {spec.name} is a dense model, so only ep=1 applies "
                                 f"(allowed: {list(allowed)})", "constraints", "ep")
        return [1]
    experts = spec.num_moe_experts
    eps = sorted({e for e in (allowed or range(1, experts + 1)) if experts % e == 0})
    if not eps:
        raise NoFeasiblePlan(f"ep: none of {list(allowed or ())} divides the {experts} experts", "constraints", "ep")
    return eps


def expert_grids(spec: ModelSpec, eps: list[int], tp: int, stage: int) -> list[tuple[int, int]]:
    """(ep, expert-TP) pairs for one TP degree: expert-TP 1 or tp (megatron's two usual choices)."""
    if not spec.is_moe:
        return [(1, tp)]
    etps = [1] if tp == 1 or spec.moe_ffn_hidden_size % tp else [1, tp]
    return [(e, t) for e in eps for t in etps if stage % (e * t) == 0]


def config_of(f: _Family, p: _Priced, dist_opt: bool) -> ParallelConfig:
    even = len(set(p.layers)) == 1
    return ParallelConfig(tp=f.tp, pp=p.pp, dp=f.dp, ep=f.ep, etp=None if f.etp == f.tp else f.etp,
                          layers=None if even else p.layers, dist_opt=dist_opt)


def _build_plan(search: _Search, best: _Priced, runner: _Priced | None, considered: int) -> ParallelPlan:
    f, c = best.family, search.c
    cfg = config_of(f, best, c.dist_opt)
    cfg.validate(search.spec)
    stage = f.tp * f.dp
    order = f.arrangement.gpus
    ranks = tuple(g for blk in search.stage_blocks(f, best.pp) for g in order[blk * stage:(blk + 1) * stage])
    standby = order[best.world:]
    tokens = c.global_batch * search.seq
    from liveshard.runtime.planner.explain import explain, why_standby

    explanation = explain(search, best, runner, cfg, considered)
    reason = why_standby(search, best) if standby else ""
    if reason:  # second, so that callers who keep the first lines keep it
        explanation = (explanation[0], reason, *explanation[1:])
    return ParallelPlan(
        config=cfg, gpus=ranks, step_seconds=best.step, tokens_per_second=tokens / best.step,
        memory_bytes_per_gpu=int(max(best.stage_memory)), explanation=explanation, standby=standby,
        costs=best.terms, stage_memory_bytes=tuple(int(x) for x in best.stage_memory),
        standby_reason=reason,
    )
