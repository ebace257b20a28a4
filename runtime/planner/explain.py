"""Why the planner chose what it chose, and why nothing fits: the planner's words for people.

``explain`` names the cost terms of the chosen config and the runner-up; ``why_nothing_fits``
says what is short (memory, GPUs, or the allowed degrees). Pure.
"""

from __future__ import annotations

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


def _link(local: bool) -> str:
    return "NVLink" if local else "network"


def explain(search: _Search, p: _Priced, runner: _Priced | None, cfg: ParallelConfig,
             considered: int) -> tuple[str, ...]:
    f, c, spec, hw = p.family, search.c, search.spec, search.hw
    terms = dict(p.terms)
    lines = [
        f"{cfg} on {p.world} of {search.n} GPUs ({search.n - p.world} standby): "
        f"{p.step:.3f} s per step, {c.global_batch * search.seq / p.step:,.0f} tokens/s "
        f"({c.global_batch} x {search.seq}-token sequences; {f.m} micro-batch{'es' if f.m != 1 else ''} "
        f"of {c.micro_batch} per DP rank)",
    ]
    parts = [f"{_TERM_NAMES[name]} {sec:.3f}" for name, sec in p.terms if sec > 0]
    lines.append("step = " + " + ".join(parts) + " s")
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
        lines.append(f"pipeline: bubble {p.pp - 1}/{f.m + p.pp - 1} = {(p.pp - 1) / (f.m + p.pp - 1):.1%} "
                     f"of the schedule; p2p over {_link(p.links['pp'])}")
    if f.tp > 1:
        lines.append(f"TP={f.tp} groups over {_link(p.links['tp'])}"
                     + ("" if p.links["tp"] else " (they cross nodes)"))
    if f.ep > 1:
        lines.append(f"EP={f.ep} (expert TP {f.etp}) all-to-all over {_link(p.links['ep'])}")
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
            f"runner-up {rcfg} on {runner.world} GPUs: {runner.step:.3f} s per step "
            f"(+{(runner.step / p.step - 1):.1%}), mostly from {_TERM_NAMES[worse]}: "
            f"{rterms[worse]:.3f} s vs {terms[worse]:.3f} s")
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
