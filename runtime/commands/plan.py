"""``liveshard plan``: the parallel config the planner picks for a model on N GPUs, and why.

Describes a homogeneous cluster (N GPUs, so many per node, one memory size), optionally with
measured speeds per GPU or per node from a YAML/JSON file, and prints the plan with its cost
terms, or ``--json`` for scripts. Imports neither torch nor kopf.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from liveshard.runtime.errors import ConfigError
from liveshard.runtime.planner import GPU, Constraints, NoFeasiblePlan, ParallelPlan, plan_world
from liveshard.runtime.spec import ModelSpec, load_model
from liveshard.runtime.units import parse_bytes


def _degrees(text: str | None, field: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(field, f"{text!r} is not a comma-separated list of integers",
                          "write e.g. 1,2,4,8") from None
    if not values or min(values) < 1:
        raise ConfigError(field, f"{text!r} needs positive degrees", "write e.g. 1,2,4,8")
    return values


DEFAULT_SEQ_LENGTH = 4096  # tokens per sequence without --seq-length or --job (capped at the model's maximum)
DEFAULT_GPU_MEMORY = "80GiB"
DEFAULT_GLOBAL_BATCH = 256


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", dest="job_file", metavar="FILE",
                   help="ElasticTrainingJob manifest: its model, training (seqLength, globalBatch, microBatch), "
                        "parallelism and workers (max x gpusPerWorker GPUs, gpuMemory) are the defaults below")
    p.add_argument("--model", help="preset name or YAML file of ModelSpec fields (required without --job)")
    p.add_argument("--gpus", type=int, help="number of GPUs (required without --job; with it: workers.max x gpusPerWorker)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per node, sharing NVLink (default: the job's gpusPerWorker, one worker pod per node "
                        "as the operator plans them, else 8)")
    p.add_argument("--gpu-memory", metavar="SIZE", help=f"memory per GPU, e.g. 80GiB, 141GB (default: the job's gpuMemory, "
                                        f"else {DEFAULT_GPU_MEMORY})")
    p.add_argument("--speeds", help="YAML/JSON mapping GPU index, GPU id (node-K/I) or node name to relative speed")
    p.add_argument("--tp", help="allowed tensor-parallel degrees, e.g. 1,2,4,8 (default: the job's, else any valid)")
    p.add_argument("--pp", help="allowed pipeline-parallel degrees (default: the job's, else 1..layers)")
    p.add_argument("--ep", help="allowed expert-parallel degrees (MoE; default: the job's, else divisors of the experts)")
    p.add_argument("--global-batch", type=int,
                   help=f"sequences per optimizer step (default: the job's globalBatch, else {DEFAULT_GLOBAL_BATCH})")
    p.add_argument("--micro-batch", type=int, help="sequences per micro-batch (default: the job's microBatch, else 1)")
    p.add_argument("--seq-length", type=int,
                   help=f"tokens per sequence (default: the job's seqLength, else {DEFAULT_SEQ_LENGTH} or the "
                        f"model's maximum if shorter; never the model's maximum silently)")
    p.add_argument("--granularity", type=int,
                   help="GPUs per worker pod: GPUs are used in whole groups of this many (default: the job's "
                        "gpusPerWorker, else 1)")
    p.add_argument("--max-gpus", type=int, help="use at most this many GPUs")
    p.add_argument("--no-dist-opt", action="store_true", help="plan without megatron's distributed optimizer")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _resolve(args: argparse.Namespace) -> tuple[ModelSpec, str]:
    """Fill the flags left unset from ``--job`` and the stated defaults; return the model and
    where the sequence length came from (printed with the plan)."""
    job = None
    if args.job_file:
        from liveshard.runtime.commands.training_args import read_job_file
        from liveshard.runtime.contract.jobspec import read_spec

        raw = read_job_file(args.job_file).raw.get("spec")
        if not isinstance(raw, dict):
            raise ConfigError("--job", f"{args.job_file} has no spec", "give an ElasticTrainingJob with a spec")
        job = read_spec({**raw, "image": raw.get("image") or "local"})
    elif args.model is None or args.gpus is None:
        missing = "--model" if args.model is None else "--gpus"
        raise ConfigError(missing, "is required without --job", "give --model and --gpus, or --job FILE")
    spec = load_model(args.model) if args.model is not None else job.model
    if job is not None:
        p, t, w = job.parallelism, job.training, job.workers
        if args.gpus is None:
            args.gpus = job.max_gpus
        if args.gpu_memory is None:
            gib = w.gpu_memory_bytes / 2**30
            args.gpu_memory = f"{gib:g}GiB" if gib == round(gib, 3) else f"{w.gpu_memory_bytes}B"
        args.tp = args.tp or _joined(p.tp)
        args.pp = args.pp or _joined(p.pp)
        args.ep = args.ep or _joined(p.ep)
        args.global_batch = args.global_batch or t.global_batch
        args.micro_batch = args.micro_batch or t.micro_batch
        args.granularity = args.granularity or w.gpus_per_worker
        args.no_dist_opt = args.no_dist_opt or not p.dist_opt
        if args.gpus_per_node is None:
            args.gpus_per_node = w.gpus_per_worker
    # spec.parallelism.minDataParallel, as the operator plans (planner.pods.constraints_for)
    args.min_dp = job.parallelism.min_dp if job is not None else 1
    if args.gpus_per_node is None:
        args.gpus_per_node = 8
    args.gpu_memory = args.gpu_memory or DEFAULT_GPU_MEMORY
    args.global_batch = args.global_batch or DEFAULT_GLOBAL_BATCH
    args.micro_batch = args.micro_batch or 1
    args.granularity = args.granularity or 1
    if args.seq_length is not None:
        return spec, "--seq-length"
    if job is not None:
        args.seq_length = job.training.seq_length
        training = raw.get("training") if isinstance(raw.get("training"), dict) else {}
        if "seqLength" in training:
            return spec, f"the job's seqLength ({args.job_file})"
        return spec, f"the job sets no seqLength, so it trains at the model's maximum ({args.job_file})"
    if spec.max_sequence_length < DEFAULT_SEQ_LENGTH:
        args.seq_length = spec.max_sequence_length
        return spec, f"the model's maximum, below the {DEFAULT_SEQ_LENGTH} default; set --seq-length"
    args.seq_length = DEFAULT_SEQ_LENGTH
    return spec, f"the default, not the model's maximum {spec.max_sequence_length}; set --seq-length or --job"


def _joined(values: tuple[int, ...] | None) -> str | None:
    return ",".join(map(str, values)) if values else None


def _fleet(args: argparse.Namespace) -> list[GPU]:
    if args.gpus < 1:
        raise ConfigError("--gpus", f"must be at least 1, got {args.gpus}")
    if args.gpus_per_node < 1:
        raise ConfigError("--gpus-per-node", f"must be at least 1, got {args.gpus_per_node}")
    memory = parse_bytes(args.gpu_memory, "--gpu-memory")
    per = args.gpus_per_node
    gpus = [GPU(id=f"node-{i // per}/{i % per}", node=f"node-{i // per}", memory_bytes=memory)
            for i in range(args.gpus)]
    if args.speeds:
        speeds = _read_speeds(Path(args.speeds), gpus)
        gpus = [GPU(g.id, g.node, g.memory_bytes, speeds.get(i, 1.0)) for i, g in enumerate(gpus)]
    return gpus


def _read_speeds(path: Path, gpus: list[GPU]) -> dict[int, float]:
    from liveshard.runtime.inputs import load_yaml

    data = load_yaml(path, "--speeds", what="speeds file (YAML or JSON)")  # JSON is YAML
    if not isinstance(data, dict):
        raise ConfigError("--speeds", f"{path} must map GPU index, GPU id or node name to a speed")
    by_id = {g.id: i for i, g in enumerate(gpus)}
    by_node: dict[str, list[int]] = {}
    for i, g in enumerate(gpus):
        by_node.setdefault(g.node, []).append(i)
    out: dict[int, float] = {}
    for key, value in data.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ConfigError("--speeds", f"speed of {key!r} is {value!r}", "use a positive number, 1.0 = normal")
        text = str(key)
        if text.isdigit() and int(text) < len(gpus):
            targets = [int(text)]
        elif text in by_id:
            targets = [by_id[text]]
        elif text in by_node:
            targets = by_node[text]
        else:
            raise ConfigError("--speeds", f"{key!r} is no GPU or node of this cluster",
                              f"use a GPU index 0..{len(gpus) - 1}, a GPU id like node-0/3 or a node name like node-0")
        for i in targets:
            out[i] = float(value)
    return out


def run(args: argparse.Namespace) -> int:
    spec, seq_source = _resolve(args)
    gpus = _fleet(args)
    constraints = Constraints(
        tp=_degrees(args.tp, "--tp"), pp=_degrees(args.pp, "--pp"), ep=_degrees(args.ep, "--ep"),
        global_batch=args.global_batch, micro_batch=args.micro_batch, seq_length=args.seq_length,
        dist_opt=not args.no_dist_opt, granularity=args.granularity, max_gpus=args.max_gpus, min_dp=args.min_dp,
    )
    started = time.perf_counter()
    plan = _plan(spec, gpus, constraints)
    seconds = time.perf_counter() - started
    fewer = _fewer_stages(spec, gpus, constraints, plan)
    if args.json:
        out = _as_json(spec.name, gpus, plan, seconds)
        out.update(seq_length=args.seq_length, seq_length_source=seq_source, fewer_stages=fewer)
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        _print(spec, args, plan, seconds, seq_source, fewer)
    return 0


def _plan(spec: ModelSpec, gpus: list[GPU], constraints: Constraints) -> ParallelPlan:
    try:
        return plan_world(spec, gpus, constraints)
    except NoFeasiblePlan as e:
        if e.short == "memory":
            _seq_length_at_fault(spec, gpus, constraints, e)
        raise ConfigError(f"--{e.field}" if e.field else "--gpus", str(e)) from None
    except ConfigError as e:
        if e.field.startswith("constraints."):  # name the flag the person typed
            raise ConfigError("--" + e.field.removeprefix("constraints.").replace("_", "-"),
                              e.problem, e.fix) from None
        raise


def _seq_length_at_fault(spec: ModelSpec, gpus: list[GPU], c: Constraints, e: NoFeasiblePlan) -> None:
    """Raise a ``--seq-length`` error when a shorter sequence would fit these GPUs; else return."""
    from liveshard.runtime.planner.cost_model import Hardware
    from liveshard.runtime.planner.explain import seq_length_that_fits
    from liveshard.runtime.planner.search import _Search

    seq = c.seq_length or spec.max_sequence_length
    shorter = sorted({s for s in (DEFAULT_SEQ_LENGTH, *(2**k for k in range(8, 20))) if s < seq}, reverse=True)
    if not shorter:
        return
    search = _Search(spec, gpus, c, Hardware())
    fits = seq_length_that_fits(search, search.max_world, min(g.memory_bytes for g in gpus), shorter)
    if fits is None:
        return
    raise ConfigError("--seq-length", f"at {seq} tokens per sequence {e}; at {fits} it fits on {search.max_world}",
                      f"--seq-length {fits} (or the job's seqLength), or more GPUs")


def _fewer_stages(spec: ModelSpec, gpus: list[GPU], c: Constraints, plan: ParallelPlan) -> dict | None:
    """When the pipeline bubble is large: the fastest plan with fewer stages whose bubble is not
    (pp capped at a half, a quarter, ... of the chosen), priced, or why there is none; so the
    choice is visible rather than taken on trust."""
    from dataclasses import replace

    from liveshard.runtime.planner.explain import BIG_BUBBLE

    def bubble(p: ParallelPlan) -> float:
        m = c.global_batch // (p.config.dp * c.micro_batch)
        return (p.config.pp - 1) / (m + p.config.pp - 1)

    pp = plan.config.pp
    if pp < 2 or bubble(plan) <= BIG_BUBBLE or not plan.step_seconds:
        return None
    cap, why = pp // 2, "the allowed pp degrees have none this small"
    while cap >= 1:
        allowed = tuple(p for p in (c.pp or range(1, cap + 1)) if p <= cap)
        if not allowed:
            break
        try:
            other = plan_world(spec, gpus, replace(c, pp=allowed))
        except (NoFeasiblePlan, ConfigError) as e:
            why = str(e)
            break  # fewer stages need more memory: smaller caps fit no better
        if bubble(other) <= BIG_BUBBLE:
            return {"pp_at_most": cap, "config": str(other.config), "step_seconds": other.step_seconds,
                    "slower": other.step_seconds / plan.step_seconds - 1, "bubble": bubble(other)}
        cap = min(cap // 2, other.config.pp - 1)
    return {"pp_at_most": None, "config": None, "why": f"no config with a bubble under {BIG_BUBBLE:.0%} fits: {why}"}


def _as_json(model: str, gpus: list[GPU], plan: ParallelPlan, seconds: float) -> dict:
    return {
        "model": model,
        "config": str(plan.config),
        "world_size": plan.config.world_size,
        "gpus_given": len(gpus),
        "step_seconds": plan.step_seconds,
        "tokens_per_second": plan.tokens_per_second,
        "memory_bytes_per_gpu": plan.memory_bytes_per_gpu,
        "stage_memory_bytes": list(plan.stage_memory_bytes),
        "costs": dict(plan.costs),
        "ranks": [{"rank": r, "gpu": g.id, "node": g.node} for r, g in enumerate(plan.gpus)],
        "standby": [g.id for g in plan.standby],
        "standby_reason": plan.standby_reason,
        "explanation": list(plan.explanation),
        "plan_seconds": seconds,
    }


def _print(spec: ModelSpec, args: argparse.Namespace, plan: ParallelPlan, seconds: float, seq_source: str,
           fewer: dict | None) -> None:
    from liveshard.runtime.planner.explain import seconds as fmt

    cfg = plan.config
    print(f"plan for {spec.name} on {args.gpus} GPUs ({args.gpus_per_node} per node, {args.gpu_memory} each): {cfg}")
    print(f"  sequence length {args.seq_length} tokens: {seq_source}")
    from liveshard.runtime.planner.cost_model import Hardware

    print(f"  {fmt(plan.step_seconds)} per step, {plan.tokens_per_second:,.0f} tokens/s ({Hardware().name} figures), "
          f"fullest GPU {plan.memory_bytes_per_gpu / 2**30:.1f} GiB, planned in {seconds * 1e3:.0f} ms")
    print("why:")
    for line in plan.explanation:
        if line != plan.standby_reason:  # printed with the standby GPUs below
            print(f"  {line}")
    if fewer is not None:
        if fewer["config"] is None:
            print(f"  fewer stages: {fewer['why']}")
        else:
            print(f"  fewer stages, smaller bubble (pp <= {fewer['pp_at_most']}): {fewer['config']}, "
                  f"{fmt(fewer['step_seconds'], plan.step_seconds)} per step (+{fewer['slower']:.1%}), "
                  f"bubble {fewer['bubble']:.1%}")
    print("ranks:")
    per_stage = cfg.world_size // cfg.pp
    layers = cfg.stage_layers(spec.num_layers)
    for s in range(cfg.pp):
        members = plan.gpus[s * per_stage:(s + 1) * per_stage]
        nodes = list(dict.fromkeys(g.node for g in members))
        where = ", ".join(nodes) if len(nodes) <= 4 else f"{len(nodes)} nodes ({nodes[0]} ... {nodes[-1]})"
        print(f"  stage {s} ({layers[s]} layers): ranks {s * per_stage}-{(s + 1) * per_stage - 1} on {where}")
    if plan.standby:
        nodes = list(dict.fromkeys(g.node for g in plan.standby))
        print(f"  standby: {len(plan.standby)} GPUs on {len(nodes)} node(s) ({nodes[0]} ... {nodes[-1]})")
        if plan.standby_reason:
            print(f"  standby because: {plan.standby_reason}")
