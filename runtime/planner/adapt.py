"""Re-planning around slow devices: the Malleus loop's decision, priced from measured speeds.

Each rank measures its own compute (``agent.compute_clock``) and divides it by the work it was
given, in *layer units*: one transformer layer's forward and backward for one micro-batch on one
TP rank; the last pipeline stage's output layer and loss count as ``output_units`` more
(``work_units``). The coordinator's ``telemetry.SpeedTracker`` turns that into a rolling
seconds-per-unit estimate per device. From those rates this module predicts the step time of a
layout (``predict_step``) and compares the running plan with three kinds of alternatives that
keep the tensor-parallel degree:

* a non-uniform layer split over the pipeline stages (``layer_split.balance_layers`` with each
  stage's slowest device, within each stage's memory);
* uneven micro-batches over the data-parallel replicas (``ParallelConfig.dp_split``: a slower
  replica takes fewer samples of the same global batch; the update is the same);
* the slowest device (its pod) moved to standby, the rest re-laid out the same two ways.

A switch is taken only when the predicted saving over ``horizon`` steps beats the measured cost
of a switch, and by at least ``min_gain`` of the step; with every device healthy the best plan is
the even one, so the same rule restores it. Predictions use the run's own measurements: the
compute terms from the rates, calibrated so the running plan's prediction is its measured step
(the part the rates do not explain, communication and the optimizer, carried over unchanged).
Pure: no torch, no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from liveshard.runtime.contract.jobspec import AdaptivePolicy
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.planner.cost_model import Hardware, ModelCosts
from liveshard.runtime.planner.layer_split import balance_layers
from liveshard.runtime.planner.search import Constraints
from liveshard.runtime.spec import ModelSpec

__all__ = ["AdaptivePolicy", "Decision", "Layout", "decide", "layer_caps_for", "output_units", "predict_compute",
           "work_units"]


@dataclass(frozen=True)
class Layout:
    """A world to price: its config and its members in rank order (and who waits aside)."""

    config: ParallelConfig
    members: tuple[str, ...]
    standbys: tuple[str, ...] = ()
    kind: str = "current"  # current, even, layers, data, layers+data, standby

    def describe(self) -> str:
        return f"{self.config} on {len(self.members)} device(s)" + (
            f", {', '.join(self.standbys)} on standby" if self.standbys else "")


@dataclass(frozen=True)
class Decision:
    """What the policy concluded, with its numbers (the job's status and an event show them)."""

    switch: bool
    current: Layout
    best: Layout
    predicted_now: float  # seconds per step of the running plan at the measured speeds
    predicted_after: float  # of the best plan
    measured_step: float
    switch_cost: float  # seconds a switch costs (measured: the last reconfiguration's pause)
    horizon: int
    reason: str

    @property
    def gain_over_horizon(self) -> float:
        return (self.predicted_now - self.predicted_after) * self.horizon

    def to_dict(self) -> dict:
        return {"switch": self.switch, "kind": self.best.kind, "config": str(self.best.config),
                "members": list(self.best.members), "standbys": list(self.best.standbys),
                "predictedStepSeconds": round(self.predicted_now, 5),
                "predictedStepSecondsAfter": round(self.predicted_after, 5),
                "measuredStepSeconds": round(self.measured_step, 5),
                "switchCostSeconds": round(self.switch_cost, 4), "horizonSteps": self.horizon,
                "reason": self.reason}


# ---- work ------------------------------------------------------------------------------------

def output_units(spec: ModelSpec, seq_length: int) -> float:
    """The output layer and loss of the last pipeline stage, in layer units (the cost model's
    FLOPs: the vocabulary projection against an average layer)."""
    costs = ModelCosts.of(spec, seq_length, 1, Hardware())
    return costs.flops_per_token_output / costs.flops_per_token_layer


def stage_units(cfg: ParallelConfig, num_layers: int, out_units: float) -> tuple[float, ...]:
    """Layer units one micro-batch costs each pipeline stage."""
    layers = cfg.stage_layers(num_layers)
    return tuple(n + (out_units if i == cfg.pp - 1 else 0.0) for i, n in enumerate(layers))


def work_units(cfg: ParallelConfig, rank: int, num_layers: int, out_units: float, micro_batches: int) -> float:
    """Layer units ``rank`` computes in one step of ``micro_batches`` micro-batches."""
    return stage_units(cfg, num_layers, out_units)[cfg.coord(rank).pp] * micro_batches


def replica_batches(cfg: ParallelConfig, total: int) -> tuple[int, ...]:
    """Micro-batches per data-parallel replica: the config's split, else even."""
    if cfg.dp_split is not None:
        return tuple(cfg.dp_split)
    return (total // cfg.dp,) * cfg.dp


# ---- prediction ------------------------------------------------------------------------------

def predict_compute(cfg: ParallelConfig, members: Sequence[str], rates: Mapping[str, float], num_layers: int,
                    out_units: float, total_batches: int) -> float:
    """Compute seconds of one step of ``cfg`` on ``members`` (rank order) at ``rates`` (seconds
    per layer unit): per replica the 1F1B pipeline, ``(m - 1) * slowest stage + all stages``, a
    stage as slow as its slowest rank; the step as slow as its slowest replica."""
    units = stage_units(cfg, num_layers, out_units)
    stage_time: dict[tuple[int, int], float] = {}
    for rank, member in enumerate(members[:cfg.world_size]):
        c = cfg.coord(rank)
        key = (c.dp, c.pp)
        stage_time[key] = max(stage_time.get(key, 0.0), rates[member] * units[c.pp])
    worst = 0.0
    for d, m in enumerate(replica_batches(cfg, total_batches)):
        stages = [stage_time[(d, s)] for s in range(cfg.pp)]
        worst = max(worst, (m - 1) * max(stages) + sum(stages))
    return worst


# ---- candidates ------------------------------------------------------------------------------

def _stage_rates(cfg: ParallelConfig, members: Sequence[str], rates: Mapping[str, float]) -> list[list[float]]:
    """[replica][stage] -> the slowest rate among that stage's TP ranks."""
    out = [[0.0] * cfg.pp for _ in range(cfg.dp)]
    for rank, member in enumerate(members[:cfg.world_size]):
        c = cfg.coord(rank)
        out[c.dp][c.pp] = max(out[c.dp][c.pp], rates[member])
    return out


def balance_replicas(times: Sequence[float], fill: Sequence[float], total: int) -> tuple[int, ...] | None:
    """Micro-batches per replica minimising the slowest replica, at least one each.

    Replica d with m micro-batches takes ``times[d] * (m - 1) + fill[d]`` (its slowest stage per
    micro-batch, plus the pipeline's fill); giving the next micro-batch to the replica that stays
    fastest is optimal since every replica's time grows with m. Ties go to the lower index."""
    dp = len(times)
    if total < dp:
        return None
    m = [1] * dp
    for _ in range(total - dp):
        d = min(range(dp), key=lambda i: (times[i] * m[i] + fill[i], i))
        m[d] += 1
    return tuple(m)


def _relaid(spec: ModelSpec, base: ParallelConfig, members: Sequence[str], rates: Mapping[str, float],
            out_units: float, total: int, layer_caps: Sequence[int] | None) -> list[tuple[str, ParallelConfig]]:
    """``base``'s degrees on ``members`` with the layer split and/or the DP split rebalanced."""
    L = spec.num_layers
    out: list[tuple[str, ParallelConfig]] = []
    even = replace(base, layers=None, dp_split=None)
    try:
        even.stage_layers(L)
        out.append(("even", even))
    except ConfigError:  # layers that do not split evenly: start from the balanced split
        pass
    per = _stage_rates(base, members, rates)
    stage_slowest = [max(per[d][s] for d in range(base.dp)) for s in range(base.pp)]
    layers = None
    if base.pp > 1:
        slope = stage_slowest
        intercept = [out_units * stage_slowest[-1] if s == base.pp - 1 else 0.0 for s in range(base.pp)]
        layers = balance_layers(L, slope, intercept, layer_caps)
        if layers is not None:
            out.append(("layers", replace(even, layers=None if len(set(layers)) == 1 else layers)))
    if base.dp > 1:
        for kind, cfg in list(out):
            units = stage_units(cfg, L, out_units)
            times = [max(per[d][s] * units[s] for s in range(base.pp)) for d in range(base.dp)]
            fill = [sum(per[d][s] * units[s] for s in range(base.pp)) for d in range(base.dp)]
            split = balance_replicas(times, fill, total)
            if split is not None and len(set(split)) > 1:
                out.append(("data" if kind == "even" else "layers+data", replace(cfg, dp_split=split)))
    return out


def _shapes(spec: ModelSpec, current: ParallelConfig, world: int, total: int,
            baseline: ParallelConfig | None) -> list[tuple[int, int]]:
    """(pp, dp) for a world of ``world`` devices at the current TP degree: the running shape when
    the size is the same, the job's own (``baseline``) when it is that size again, else shapes
    that keep the pipeline depth or the data-parallel degree (a straggler is no reason to change
    both)."""
    tp = current.tp
    if world < tp or world % tp:
        return []
    if world == current.world_size:
        return [(current.pp, current.dp)]
    if baseline is not None and world == baseline.world_size and baseline.tp == tp:
        return [(baseline.pp, baseline.dp)]
    out = []
    for pp in range(1, world // tp + 1):
        dp = world // (tp * pp)
        if tp * pp * dp != world or pp > spec.num_layers or dp > total:
            continue
        if pp == current.pp or dp == current.dp:
            out.append((pp, dp))
    return out


LayerCaps = Callable[[ParallelConfig], Sequence[int] | None]


def layer_caps_for(spec: ModelSpec, constraints: Constraints, memory_bytes: int,
                   hardware: Hardware | None = None) -> LayerCaps:
    """The most layers each pipeline stage of a config holds on GPUs of ``memory_bytes``, by the
    planner's memory model (weights, gradients, optimizer state, 1F1B activations)."""
    from liveshard.runtime.planner.search import GPU, _Search, layer_caps

    hw = hardware or Hardware()

    def caps(cfg: ParallelConfig) -> Sequence[int] | None:
        gpus = [GPU(str(i), "node", memory_bytes) for i in range(cfg.world_size)]
        search = _Search(spec, gpus, replace(constraints, granularity=1, max_gpus=None, tp=None, pp=None, ep=None),
                         hw)
        family = search._family(search.arrangements[0], False, cfg.tp, cfg.dp, cfg.ep, cfg.expert_tp, (cfg.pp,))
        usable, fixed, per_layer = search.memory_terms(family, cfg.pp, memory_bytes)
        return layer_caps(usable, fixed, per_layer)

    return caps


def decide(spec: ModelSpec, current: ParallelConfig, members: Sequence[str], standbys: Sequence[str],
           rates: Mapping[str, float], *, measured_step: float, switch_cost: float, policy: AdaptivePolicy,
           global_batch: int, micro_batch: int, seq_length: int, granularity: int = 1,
           slow_standbys: Sequence[str] = (), layer_caps: LayerCaps | None = None,
           baseline: ParallelConfig | None = None, allowed_pp: Sequence[int] | None = None,
           max_world: int | None = None) -> Decision:
    """Whether to leave the running plan for a faster one at the measured ``rates``.

    ``rates``: seconds per layer unit of every member (and of standbys that were measured before
    they went aside); a member without one counts at the median rate. ``slow_standbys``: standbys
    that were set aside for slowness and are still on probation (they are not brought back).
    ``layer_caps``: the most layers each pipeline stage of a config holds (its memory; None:
    no limit). ``baseline``: the job's own layout before any adaptive switch, restored when its
    devices are all back and healthy. ``allowed_pp``, ``max_world``: the job's constraints
    (pipeline depths it allows, the most GPUs it may use).
    """
    total = global_batch // micro_batch
    out_units = output_units(spec, seq_length)
    known = [rates[m] for m in members if m in rates]
    if not known:
        raise ValueError("no measured rates for the running world")
    median = statistics.median(known)
    full = {m: rates.get(m, median) for m in (*members, *standbys)}
    now_layout = Layout(current, tuple(members), tuple(standbys))
    predicted_now = predict_compute(current, members, full, spec.num_layers, out_units, total)
    # Calibrated on the running plan: what the rates do not explain (communication, the
    # optimizer) is added to every candidate unchanged; rates that explain more than the step
    # measured (compute overlapping other ranks' on shared hosts) are scaled down alike.
    overhead = max(0.0, measured_step - predicted_now)
    scale = min(1.0, measured_step / predicted_now) if predicted_now > 0 else 1.0
    predicted_now *= scale

    candidates = _candidates(spec, current, members, standbys, full, total=total, out_units=out_units,
                             granularity=granularity, slow_standbys=slow_standbys, layer_caps=layer_caps,
                             baseline=baseline, allowed_pp=allowed_pp, max_world=max_world)
    priced = _priced(spec, candidates, full, total=total, out_units=out_units, layer_caps=layer_caps, scale=scale,
                     overhead=overhead)
    current_total = predicted_now + overhead
    if not priced:
        return Decision(False, now_layout, now_layout, current_total, current_total, measured_step, switch_cost,
                        policy.horizon, "no other layout is valid for this model and batch")
    # Fastest first; on a tie the simplest (even before uneven, more devices before fewer).
    t_best, _, best = min(priced, key=lambda x: (round(x[0], 9), -len(x[2].members), x[1]))
    same = best.config == current and best.members == tuple(members)
    gain = current_total - t_best
    if same or gain <= 0:
        return Decision(False, now_layout, now_layout, current_total, current_total, measured_step, switch_cost,
                        policy.horizon, "the running plan is the fastest at the measured speeds")
    if gain < policy.min_gain * current_total:
        return Decision(False, now_layout, best, current_total, t_best, measured_step, switch_cost, policy.horizon,
                        f"a {gain / current_total:.1%} saving is below the {policy.min_gain:.0%} worth a switch")
    if gain * policy.horizon <= switch_cost:
        return Decision(False, now_layout, best, current_total, t_best, measured_step, switch_cost, policy.horizon,
                        f"saving {gain * policy.horizon:.2f} s over {policy.horizon} steps does not pay for a "
                        f"{switch_cost:.2f} s switch")
    return Decision(True, now_layout, best, current_total, t_best, measured_step, switch_cost, policy.horizon,
                    f"{best.kind}: predicted {current_total:.4f} -> {t_best:.4f} s/step, saving "
                    f"{gain * policy.horizon:.2f} s over {policy.horizon} steps against a {switch_cost:.2f} s switch")


def _candidates(spec: ModelSpec, current: ParallelConfig, members: Sequence[str], standbys: Sequence[str],
                full: Mapping[str, float], *, total: int, out_units: float, granularity: int,
                slow_standbys: Sequence[str], layer_caps: LayerCaps | None, baseline: ParallelConfig | None,
                allowed_pp: Sequence[int] | None, max_world: int | None) -> list[Layout]:
    """Every layout ``decide`` compares: each shape of the devices that may work (with and without
    the slowest member's pod), evenly and unevenly laid out (``_relaid``)."""
    candidates: list[Layout] = []
    probation = [s for s in standbys if s in set(slow_standbys)]
    # Every device that may work: the members, and standbys that are not on probation ...
    pool = [*members, *(s for s in standbys if s not in set(slow_standbys))]
    # ... and the same without the slowest member's pod (it goes to standby).
    slowest = max(members, key=lambda m: (full[m], m))
    dropped = [m for m in pool if _pod(m, granularity) == _pod(slowest, granularity)]
    pools = [(pool, "")]
    if len(members) > 1:
        pools.append(([m for m in pool if m not in set(dropped)], "standby"))
    unit = math.lcm(granularity, current.tp)
    for devices, label in pools:
        size = min(len(devices), max_world or len(devices))
        size -= size % unit
        for pp, dp in _shapes(spec, current, size, total, baseline):
            if allowed_pp is not None and pp not in allowed_pp and pp != current.pp:
                continue
            try:
                base = replace(current, pp=pp, dp=dp, layers=None, dp_split=None)
                caps = layer_caps(base) if layer_caps is not None else None
            except ConfigError:
                continue
            using = tuple(devices[:base.world_size])
            aside = (*devices[base.world_size:], *(dropped if label else ()), *probation)
            for kind, cfg in _relaid(spec, base, using, full, out_units, total, caps):
                if label:
                    kind = label if kind == "even" else f"{label}+{kind}"
                elif len(using) > len(members):
                    kind = "rejoin" if kind == "even" else f"rejoin+{kind}"
                candidates.append(Layout(cfg, using, tuple(aside), kind))
    return candidates


def _priced(spec: ModelSpec, candidates: Sequence[Layout], full: Mapping[str, float], *, total: int,
            out_units: float, layer_caps: LayerCaps | None, scale: float,
            overhead: float) -> list[tuple[float, int, Layout]]:
    """(predicted step seconds, index, layout) of each valid candidate that fits in memory, on
    the running plan's calibration (``scale``, ``overhead``)."""
    priced: list[tuple[float, int, Layout]] = []
    for i, lay in enumerate(candidates):
        try:
            lay.config.validate(spec)
            _check_split(lay.config, total)
        except ConfigError:
            continue
        caps = layer_caps(replace(lay.config, layers=None, dp_split=None)) if layer_caps is not None else None
        if caps is not None and any(n > c for n, c in zip(lay.config.stage_layers(spec.num_layers), caps)):
            continue  # a stage that would not fit in its GPUs' memory
        t = predict_compute(lay.config, lay.members, full, spec.num_layers, out_units, total) * scale + overhead
        priced.append((t, i, lay))
    return priced


def _pod(member: str, granularity: int) -> str:
    return member.rpartition("/")[0] if granularity > 1 else member


def _check_split(cfg: ParallelConfig, total: int) -> None:
    if cfg.dp_split is not None:
        if sum(cfg.dp_split) != total:
            raise ConfigError("dp_split", f"{'+'.join(map(str, cfg.dp_split))} is not {total} micro-batches")
    elif total % cfg.dp:
        raise ConfigError("dp", f"{total} micro-batches do not split over dp={cfg.dp}")
