"""Why the planner chose what it chose, and why nothing fits: the planner's words for people.

``explain`` names the cost terms of the chosen config and the runner-up; ``why_nothing_fits``
says what is short (memory, GPUs, or the allowed degrees). Pure.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.planner.placement import Arrangement
from liveshard.runtime.planner.search import (
    GPU,
    NoFeasiblePlan,
    config_of,
    expert_grids,
    layer_caps,
)

if TYPE_CHECKING:
    from liveshard.runtime.planner.search import _Priced, _Search

GiB = 2**30
BIG_BUBBLE = 0.25  # a pipeline bubble above this share of the schedule gets its cause named


def why_nothing_fits(search: _Search) -> NoFeasiblePlan:
    spec = search.spec
    if not search.memory_short:
        return NoFeasiblePlan(_too_few_gpus(search), "gpus")
    lean = search.leanest()
    mem = max(search.arrangements[0].memory)
    need_gpus = _min_gpus_for_memory(search, mem)
    where = (f"needs >= {need_gpus} GPUs of {mem / GiB:.0f} GiB" if need_gpus
             else f"does not fit GPUs of {mem / GiB:.0f} GiB at any scale the constraints allow")
    text = f"{spec.name} {where} (has {search.n}"
    if search.max_world < search.n:
        text += f", {search.max_world} usable"
    text += ")"
    if lean is not None:
        _, f, pp, need, usable = lean
        cfg = ParallelConfig(tp=f.tp, pp=pp, dp=f.dp, ep=f.ep, etp=None if f.etp == f.tp else f.etp)
        text += (f": the leanest config here, {cfg}, needs {need / GiB:.1f} GiB on its fullest GPU, "
                 f"{usable / GiB:.1f} GiB usable")
    return NoFeasiblePlan(text, "memory")


def _too_few_gpus(search: _Search) -> str:
    """The smallest world the allowed degrees, the global batch and the granularity permit."""
    spec, c = search.spec, search.c
    tps, pps, dps, eps = search.degrees()
    best: tuple[int, int, int, int] | None = None
    for tp in tps:
        for dp in dps:
            if not expert_grids(spec, eps, tp, tp * dp):
                continue
            for pp in sorted(pps):
                world = tp * dp * pp
                if world % c.granularity == 0 and (best is None or world < best[0]):
                    best = (world, tp, pp, dp)
    if best is None:
        return (f"no allowed degrees make a world in whole groups of {c.granularity} GPUs "
                f"(tp in {tps}, pp in {sorted(pps)})")
    world, tp, pp, dp = best
    usable = f"{search.max_world} of {search.n}" if search.max_world < search.n else f"{search.n}"
    return f"needs >= {world} GPUs (e.g. tp={tp}, pp={pp}, dp={dp}); has {usable}"


def _min_gpus_for_memory(search: _Search, memory: int) -> int | None:
    """The fewest GPUs of ``memory`` bytes (same node size) on which some allowed config fits."""
    spec, c = search.spec, search.c
    tps, pps, dps, eps = search.degrees()
    pps = sorted(pps)
    arr = Arrangement([GPU(id="any", node="any", memory_bytes=memory)])
    best: int | None = None
    for tp in tps:
        for dp in dps:
            for ep, etp in expert_grids(spec, eps, tp, tp * dp):
                f = search._family(arr, False, tp, dp, ep, etp, tuple(pps))
                for pp in pps:
                    world = -(-tp * dp * pp // c.granularity) * c.granularity
                    if best is not None and world >= best:
                        break
                    caps = layer_caps(*search.memory_terms(f, pp, memory))
                    if min(caps) >= 1 and sum(caps) >= spec.num_layers:
                        best = world
                        break
    return best


# ---- the result and its explanation ----------------------------------------------------------


_TERM_NAMES = {
    "compute": "compute", "tensor_parallel": "TP", "expert_parallel": "EP all-to-all",
    "pipeline_p2p": "PP p2p", "pipeline_bubble": "PP bubble", "data_parallel": "DP",
    "optimizer": "optimizer",
}


def seconds(x: float, like: float | None = None) -> str:
    """A duration in the unit that shows it (tiny models' steps take microseconds); ``like``:
    use the unit that one would get, so two figures compare at a glance."""
    scale, unit = _unit(x if like is None else min(abs(x), abs(like)) or max(abs(x), abs(like)))
    if x == 0:
        return f"0 {unit}"
    return f"{x * scale:.3f} {unit}" if unit == "s" else f"{x * scale:.3g} {unit}"


def _unit(step: float) -> tuple[float, str]:
    """(scale, unit) for the terms of a step of ``step`` seconds."""
    if step >= 0.01 or step == 0:
        return 1.0, "s"
    if step >= 1e-5:
        return 1e3, "ms"
    return 1e6, "µs"


def _link(local: bool) -> str:
    return "NVLink" if local else "network"


def explain(search: _Search, p: _Priced, runner: _Priced | None, cfg: ParallelConfig,
             considered: int) -> tuple[str, ...]:
    f, c, spec, hw = p.family, search.c, search.spec, search.hw
    terms = dict(p.terms)
    lines = [
        f"{cfg} on {p.world} of {search.n} GPUs ({search.n - p.world} standby): "
        f"{seconds(p.step)} per step, {c.global_batch * search.seq / p.step:,.0f} tokens/s from {hw.name} figures "
        f"({c.global_batch} x {search.seq}-token sequences; {f.m} micro-batch{'es' if f.m != 1 else ''} "
        f"of {c.micro_batch} per DP rank)",
    ]
    scale, unit = _unit(p.step)
    parts = [f"{_TERM_NAMES[name]} {sec * scale:.3f}" for name, sec in p.terms if sec > 0]
    lines.append("step = " + " + ".join(parts) + f" {unit}")
    k = search.costs
    tokens = c.global_batch * search.seq
    flops_step = (spec.num_layers * k.flops_per_token_layer + k.flops_per_token_output) * tokens
    active = "active " if spec.is_moe else ""
    lines.append(
        f"compute: {flops_step:.3g} FLOP per step (6 x {spec.num_parameters(active_only=True) / 1e9:.2f}B "
        f"{active}params x {tokens:,} tokens, plus causal attention) at {hw.flops(spec.params_dtype) / 1e12:.0f} "
        f"TFLOP/s per GPU ({hw.mfu:.0%} MFU) x its speed; the bottleneck is stage {p.bottleneck}")
    speeds = f.arrangement.block_min_speed(f.tp * f.dp)
    stage_speeds = [speeds[blk] for blk in search.stage_blocks(f, p.pp)]
    split = "+".join(map(str, p.layers))
    if len(set(stage_speeds)) > 1:
        slow = [i for i, s in enumerate(stage_speeds) if s < max(stage_speeds)]
        lines.append(f"layers {split}: stragglers grouped into stage(s) {', '.join(map(str, slow))} "
                     f"(speeds {'/'.join(f'{s:.2f}' for s in stage_speeds)}), which get fewer layers")
    elif len(set(p.layers)) > 1:
        lines.append(f"layers {split}: stages balanced for the output layer's compute (last stage) and "
                     f"the activations 1F1B keeps in flight (first stages)")
    if p.pp > 1:
        bubble = (p.pp - 1) / (f.m + p.pp - 1)
        line = (f"pipeline: bubble {p.pp - 1}/{f.m + p.pp - 1} = {bubble:.1%} of the schedule; "
                f"p2p over {_link(p.links['pp'])}")
        if bubble > BIG_BUBBLE:
            line += (f" (large: only {f.m} micro-batch{'es' if f.m != 1 else ''} per DP rank for {p.pp} stages, "
                     f"global batch {c.global_batch} / dp {f.dp} / micro-batch {c.micro_batch}; a larger global "
                     f"batch shrinks it, and fewer stages need more memory per GPU)")
        lines.append(line)
    if f.tp > 1:
        lines.append(f"TP={f.tp} groups over {_link(p.links['tp'])}"
                     + ("" if p.links["tp"] else " (they cross nodes)"))
    if f.ep > 1:
        lines.append(f"EP={f.ep} (expert TP {f.etp}) all-to-all over {_link(p.links['ep'])}")
    slowdown = search.expert_slowdown(f.tp, f.ep, f.etp)
    if slowdown > 0:
        rows = k.tokens / f.tp * f.ep * f.etp * spec.moe_router_topk / spec.num_moe_experts
        cols = (spec.moe_ffn_hidden_size or 0) // f.etp
        lines.append(f"experts: ~{rows:,.0f} tokens per expert per micro-batch, {cols} columns per rank: "
                     f"their matmuls take {1 + slowdown:.2f}x their FLOP time (memory-bound; more EP "
                     f"batches more tokens per expert), priced into compute")
    if f.dp > 1:
        how = "reduce-scatter + all-gather (distributed optimizer)" if c.dist_opt else "all-reduce"
        lines.append(f"DP={f.dp}: gradient {how}, {hw.dp_overlap:.0%} hidden behind backward")
    worst = max(range(p.pp), key=lambda i: p.stage_memory[i])
    lines.append(_memory_line(search, p, worst))
    if runner is not None:
        rf = runner.family
        rcfg = config_of(rf, runner, c.dist_opt)
        rterms = dict(runner.terms)
        worse = max(terms, key=lambda name: rterms[name] - terms[name])
        lines.append(
            f"runner-up {rcfg} on {runner.world} GPUs: {seconds(runner.step, p.step)} per step "
            f"(+{(runner.step / p.step - 1):.1%}), mostly from {_TERM_NAMES[worse]}: "
            f"{seconds(rterms[worse], p.step)} vs {seconds(terms[worse], p.step)}")
    else:
        lines.append("runner-up: none (no other config fits)")
    lines.append(f"searched {considered} candidates, priced {search.evaluated} "
                 f"({len(search.memory_short)} did not fit in memory)")
    return tuple(lines)


def _memory_line(search: _Search, p: _Priced, i: int) -> str:
    f, c, k, hw = p.family, search.c, search.costs, search.hw
    n = p.layers[i]
    first, last = i == 0, i == p.pp - 1
    dense = n * f.dense_per_layer + (k.first_stage_params(f.tp) if first else 0) \
        + (k.last_stage_params(f.tp, p.pp) if last else 0)
    expert = n * f.expert_per_layer
    weights = (dense + expert) * search.spec.bytes_per_param
    grads = (dense + expert) * hw.grad_bytes
    opt = k.optimizer_bytes_per_param()
    optimizer = (dense / (f.dp if c.dist_opt else 1) + expert / (f.edp if c.dist_opt else 1)) * opt
    inflight = min(p.pp - i, f.m)
    acts = n * f.act_per_layer * inflight
    logits = f.logits if last else 0.0
    mem = f.arrangement.block_min_memory(f.tp * f.dp)[search.stage_blocks(f, p.pp)[i]]
    return (f"memory: fullest GPU (stage {i}) {p.stage_memory[i] / GiB:.1f} GiB of {mem / GiB:.1f} GiB "
            f"({mem * hw.memory_usable_fraction / GiB:.1f} usable): weights {weights / GiB:.1f} + grads "
            f"{grads / GiB:.1f} + optimizer {optimizer / GiB:.1f} + activations {acts / GiB:.1f} "
            f"({inflight} micro-batch{'es' if inflight != 1 else ''} in flight) + logits {logits / GiB:.1f}")


def why_standby(search: _Search, best: _Priced) -> str:
    """One line: why ``best`` leaves some of the GPUs given unused."""
    from liveshard.runtime.planner.search import _order

    c, n = search.c, search.n
    head = f"{n - best.world} of {n} GPUs standby"
    larger = [(f, pp) for f in search.all_families for pp in f.pps if f.tp * f.dp * pp > best.world]
    if not larger:
        causes = []
        if best.world == search.max_world < n:
            if c.max_gpus is not None and c.max_gpus < n:
                causes.append(f"max_gpus caps the world at {c.max_gpus}")
            if min(n, c.max_gpus or n) % c.granularity:
                causes.append(f"the world comes in whole pods of {c.granularity} GPUs")
        else:
            k = c.global_batch // c.micro_batch
            allowed = [f"{name} in {list(v)}" for name, v in (("tp", c.tp), ("pp", c.pp)) if v]
            causes.append(f"no config uses more than {best.world}: dp must divide the {k} micro-batches of a step "
                          f"(global batch {c.global_batch} / micro-batch {c.micro_batch})"
                          + (f" with {', '.join(allowed)}" if allowed else "")
                          + "; a global batch with more divisors uses more")
        return f"{head}: " + "; ".join(causes)
    top = max(f.tp * f.dp * pp for f, pp in larger)
    evaluated, short = search.evaluated, len(search.memory_short)
    # The fastest config on ``top`` GPUs, priced in order of the search's lower bound.
    order = sorted(((search.lower_bound(f, pp), i, pp) for i, (f, pp) in enumerate(larger)
                    if f.tp * f.dp * pp == top))
    alt = None
    for bound, i, pp in order:
        if alt is not None and bound > alt.step:
            break
        x = search.price(larger[i][0], pp)
        if x is not None and (alt is None or _order(x) < _order(alt)):
            alt = x
    search.evaluated, search.memory_short[short:] = evaluated, []  # the explanation's counts stay the search's
    if alt is None:
        return f"{head}: every config on {top} GPUs runs out of memory"
    acfg = replace(config_of(alt.family, alt, c.dist_opt), layers=None)  # the degrees, not the split
    terms, aterms = dict(best.terms), dict(alt.terms)
    worse = max(terms, key=lambda name: aterms[name] - terms[name])
    text = (f"{head}: by the cost model (H100-class GPU figures) fewer GPUs are faster: the best config on {top}, "
            f"{acfg}, takes {alt.step / best.step:.2f}x as long per step ({seconds(alt.step, best.step)} vs "
            f"{seconds(best.step, alt.step)}), mostly from {_TERM_NAMES[worse]} "
            f"({seconds(aterms[worse], best.step)} vs {seconds(terms[worse], best.step)})")
    if worse in ("data_parallel", "tensor_parallel", "expert_parallel", "pipeline_p2p"):
        text += "; a larger global batch or sequence length gives each GPU more compute per exchange"
    elif worse == "compute":
        L = search.spec.num_layers
        if alt.pp > best.pp and L % alt.pp:
            text += (f"; its {alt.pp} stages split {L} layers unevenly (dp must divide the "
                     f"{c.global_batch // c.micro_batch} micro-batches of a step, so {top} GPUs take pp={alt.pp} here)")
        slow = [g.speed for g in best.family.arrangement.gpus[best.world:]]
        if slow and min(slow) < best.family.arrangement.max_speed:
            text += f"; the standby GPUs are slower (speed down to {min(slow):.2f})"
    return text


def seq_length_that_fits(search: _Search, gpus: int, memory: int, candidates: list[int]) -> int | None:
    """The longest of ``candidates`` (sequence lengths) at which some allowed config fits on
    ``gpus`` GPUs of ``memory`` bytes, or None."""
    from liveshard.runtime.planner.search import _Search

    for seq in sorted(candidates, reverse=True):
        other = _Search(search.spec, search.arrangements[0].gpus, replace(search.c, seq_length=seq), search.hw)
        need = _min_gpus_for_memory(other, memory)
        if need is not None and need <= gpus:
            return seq
    return None
