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


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset name or YAML file of ModelSpec fields")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs sharing NVLink (default 8)")
    p.add_argument("--gpu-memory", default="80GiB", help="memory per GPU, e.g. 80GiB, 141GB (default 80GiB)")
    p.add_argument("--speeds", help="YAML/JSON mapping GPU index, GPU id (node-K/I) or node name to relative speed")
    p.add_argument("--tp", help="allowed tensor-parallel degrees, e.g. 1,2,4,8 (default: any valid)")
    p.add_argument("--pp", help="allowed pipeline-parallel degrees (default: 1..layers)")
    p.add_argument("--ep", help="allowed expert-parallel degrees (MoE; default: divisors of the experts)")
    p.add_argument("--global-batch", type=int, default=256, help="sequences per optimizer step (default 256)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    p.add_argument("--seq-length", type=int, help="tokens per sequence (default: the model's maximum)")
    p.add_argument("--granularity", type=int, default=1,
                   help="GPUs per worker pod: GPUs are used in whole groups of this many (default 1)")
    p.add_argument("--max-gpus", type=int, help="use at most this many GPUs")
    p.add_argument("--no-dist-opt", action="store_true", help="plan without megatron's distributed optimizer")
    p.add_argument("--json", action="store_true", help="print one JSON object")


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
    import yaml

    if not path.exists():
        raise ConfigError("--speeds", f"{path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())  # JSON is YAML
    except yaml.YAMLError as e:
        raise ConfigError("--speeds", f"{path} is not valid YAML/JSON: {str(e).splitlines()[0]}") from None
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
    spec = load_model(args.model)
    gpus = _fleet(args)
    constraints = Constraints(
        tp=_degrees(args.tp, "--tp"), pp=_degrees(args.pp, "--pp"), ep=_degrees(args.ep, "--ep"),
        global_batch=args.global_batch, micro_batch=args.micro_batch, seq_length=args.seq_length,
        dist_opt=not args.no_dist_opt, granularity=args.granularity, max_gpus=args.max_gpus,
    )
    started = time.perf_counter()
    try:
        plan = plan_world(spec, gpus, constraints)
    except NoFeasiblePlan as e:
        raise ConfigError(f"--{e.field}" if e.field else "--gpus", str(e)) from None
    except ConfigError as e:
        if e.field.startswith("constraints."):  # name the flag the person typed
            raise ConfigError("--" + e.field.removeprefix("constraints.").replace("_", "-"),
                              e.problem, e.fix) from None
        raise
    seconds = time.perf_counter() - started
    if args.json:
        json.dump(_as_json(spec.name, gpus, plan, seconds), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        _print(spec, args, plan, seconds)
    return 0


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
        "explanation": list(plan.explanation),
        "plan_seconds": seconds,
    }


def _print(spec: ModelSpec, args: argparse.Namespace, plan: ParallelPlan, seconds: float) -> None:
    cfg = plan.config
    print(f"plan for {spec.name} on {args.gpus} GPUs ({args.gpus_per_node} per node, {args.gpu_memory} each): {cfg}")
    print(f"  {plan.step_seconds:.3f} s per step, {plan.tokens_per_second:,.0f} tokens/s, "
          f"fullest GPU {plan.memory_bytes_per_gpu / 2**30:.1f} GiB, planned in {seconds * 1e3:.0f} ms")
    print("why:")
    for line in plan.explanation:
        print(f"  {line}")
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
