"""Scale model: what a reconfiguration costs at 256-4096 GPUs, from measured plans.

For llama3-70b and qwen3-235b-a22b at 256, 1024, 2048 and 4096 GPUs (8 per node, 80 GiB each),
the parallelism planner (``planner.plan_world``, the throughput objective) picks the layout on N
GPUs and on N - 8 GPUs. Three transitions per scale:

* **node leaves**: the N-GPU layout -> the planner's layout for the N - 8 GPUs left (the last
  node's 8 devices leave; they are still readable, as after a spot notice);
* **node joins**: the planner's layout on N - 8 GPUs -> its layout on N (the new node and any
  standbys of the smaller world join);
* **EP change** (MoE only): the N-GPU layout with its expert-parallel degree doubled.

For each transition: the whole plan (``vps.transition.plan_transition`` + checksum, and its
rounds, CPU seconds on one core), the busiest device's bytes over NVLink and over the network,
the modeled transfer time (``vps.bound.modeled_seconds``), and per-rank plans
(``vps.device_plan``, what ``liveshard plan-transition --device D`` computes): sampled devices one
at a time with nothing cached, the rank order taken from the whole plan as a worker takes it from
its world plan, CPU seconds (worst and median). Every figure is what ``liveshard
plan-transition`` prints for the same inputs (the configs are in the JSON).

``--extra`` runs ``liveshard plan-transition`` itself (whole plan and ``--device D``) for models and
scales the benchmarks do not use and keeps its JSON output.

    python bench/bench_scale_model.py [--only llama3-70b@1024] [--per-rank 24] [--extra]
    python bench/bench_scale_model.py --figures     # time the operator's overlap figures for the rows there
    python bench/bench_scale_model.py --json        # per row: plan/communicator/transfer/build/pause/end-to-end s

Writes ``bench/results/scale_model.json`` (merged with what is there: ``--only`` replaces its own
rows and keeps the others).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

from bench_transition_planning import timed_whole_plan

from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.planner import GPU, Constraints, plan_world
from liveshard.runtime.presets import PRESETS
from liveshard.runtime.units import parse_bytes
from liveshard.runtime.vps import device_plan
from liveshard.runtime.vps import transition as transition_mod
from liveshard.runtime.vps.bound import INTER_NODE_GBPS, INTRA_NODE_GBPS, modeled_seconds
from liveshard.runtime.vps.devices import DeviceMap
from liveshard.runtime.vps.schedule import schedule

GPUS_PER_NODE = 8
GPU_MEMORY = "80GiB"
SCALES = (256, 1024, 2048, 4096)
# Planner inputs per model: the job's global batch and sequence length, and the EP degrees the
# job allows (None: any).
MODELS = {
    "llama3-70b": {"global_batch": 1024, "seq_length": 8192, "ep": None},
    "qwen3-235b-a22b": {"global_batch": 1024, "seq_length": 4096, "ep": (8, 16, 32, 64)},
}
OUT = Path(__file__).parent / "results" / "scale_model.json"

# The end-to-end model (docs/performance.md explains every input and its source).
# NCCL communicator creation over n ranks, fresh (ncclCommInitRank): a power law through 2.46 s on
# 8 H100s (NCCL 2.22.3, NVIDIA/nccl#534) and ~265 s on ~96k GPUs (stock NCCL, arXiv 2510.20171):
# t = 2.46 * (n / 8) ** 0.5 seconds. Rough: read it as +-2x.
NCCL_INIT_8_S = 2.46
NCCL_INIT_EXPONENT = 0.5
# Building the new megatron model and optimizer around the received tensors on a GPU (assumed;
# measured on CPU: 0.08-0.41 s for gpt-125m, bench/README.md "Elastic runtime").
COMMIT_BUILD_S = 1.0


def nccl_init_s(n: int) -> float:
    return NCCL_INIT_8_S * (n / 8) ** NCCL_INIT_EXPONENT


def end_to_end(r: dict) -> dict:
    """The parts of one reconfiguration and their sums, as built and with the new world prepared.

    The operator chooses the rank order from the layouts' overlap (``overlap_figures_cpu_s``,
    measured; rows measured before it existed fall back to the two whole plans it replaced). A
    leave (nobody joins) transfers over the running world: no transition group. Preparing
    connects the transition group (joins), then the next world; both are fresh NCCL
    initialisations in this model (deriving the next world by splitting the old one is not
    modeled)."""
    members = r["devices"]  # the transition group: every old and new member
    operator = r.get("overlap_figures_cpu_s", 2 * r["global_plan_cpu_s"])
    plan = r["per_rank_total_cpu_s_worst"]
    group = nccl_init_s(members) if r["join"] else 0.0
    world = nccl_init_s(r["new_gpus"])
    transfer = r["modeled_seconds"]
    pause = transfer + world + COMMIT_BUILD_S
    pause_prepared = transfer + COMMIT_BUILD_S
    return {"operator_s": operator, "per_rank_plan_s": plan, "transition_group_s": group, "world_init_s": world,
            "transfer_s": transfer, "commit_build_s": COMMIT_BUILD_S, "pause_s": pause,
            "end_to_end_s": operator + plan + group + pause, "pause_prepared_s": pause_prepared,
            "end_to_end_prepared_s": operator + plan + group + world + pause_prepared}


# Where each figure of ``summary`` comes from.
SOURCES = {
    "plan_seconds": "measured: CPU seconds on one core of this machine (the operator's overlap figures, "
                    "else its two whole plans, + the worst sampled per-rank plan)",
    "communicator_seconds": "modeled: fresh NCCL initialisation, 2.46 s * (n/8)^0.5 (+-2x), for the transition "
                            "group (joins only: a leave reuses the running world) and the next world, connected "
                            "while the old one trains",
    "transfer_seconds": "modeled: the measured plan's busiest device over 450 GB/s NVLink and 50 GB/s network per "
                        "GPU, 50 us per round",
    "build_seconds": "assumed: 1.0 s to build the new model and optimizer around the received tensors on a GPU",
    "pause_seconds": "transfer_seconds + build_seconds (the world built ahead, the default)",
    "end_to_end_seconds": "plan_seconds + communicator_seconds + pause_seconds (from the operator's decision)",
}


def summary(data: dict) -> list[dict]:
    """One record per model, GPU count and scenario with the figures the issue tracker asks for."""
    out = []
    for r in sorted(data["rows"], key=_order):
        e = end_to_end(r)
        out.append({"model": r["model"], "gpus": r["gpus"], "scenario": r["scenario"], "from": r["from"],
                    "to": r["to"], "plan_seconds": round(e["operator_s"] + e["per_rank_plan_s"], 3),
                    "communicator_seconds": round(e["transition_group_s"] + e["world_init_s"], 2),
                    "transfer_seconds": round(e["transfer_s"], 3), "build_seconds": e["commit_build_s"],
                    "pause_seconds": round(e["pause_prepared_s"], 3),
                    "end_to_end_seconds": round(e["end_to_end_prepared_s"], 2),
                    "operator_measured_as": "overlap figures" if "overlap_figures_cpu_s" in r else "two whole plans",
                    "sources": SOURCES})
    return out


def measure_figures(rows: list[dict]) -> None:
    """Time the operator's rank-order choice (``overlap_figures``) for each row, on one core."""
    for r in rows:
        if r["model"] not in PRESETS:
            continue
        devices = DeviceMap(r["old_gpus"], GPUS_PER_NODE, frozenset(r["leave"]), r["join"])
        old, new = ParallelConfig.parse(r["from"]), ParallelConfig.parse(r["to"])
        gc.collect()
        t0 = time.process_time()
        transition_mod.overlap_figures(PRESETS[r["model"]], old, new, devices)
        r["overlap_figures_cpu_s"] = time.process_time() - t0
        print(f"{r['model']}@{r['gpus']} {r['scenario']}: overlap figures {r['overlap_figures_cpu_s']:.3f} s CPU",
              flush=True)


def _order(r: dict) -> tuple:
    kinds = ("node leaves", "node joins")
    return (list(MODELS).index(r["model"]) if r["model"] in MODELS else 9, r["gpus"],
            kinds.index(r["scenario"]) if r["scenario"] in kinds else 2)


def table(data: dict) -> str:
    """Markdown tables of the rows in ``data`` (the figures docs/performance.md shows): the parts of
    each reconfiguration, then the plans behind them."""
    data = {**data, "rows": sorted(data["rows"], key=_order)}
    out = ["| model | GPUs | pause s, as built | pause s, world built ahead | end-to-end s, as built | "
           "end-to-end s, world built ahead | DynaTrain |", "|---|---:|---:|---:|---:|---:|---:|"]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in data["rows"]:
        groups[(r["model"], r["gpus"])].append(end_to_end(r))

    def span(es: list[dict], k: str, f: str) -> str:
        lo, hi = min(e[k] for e in es), max(e[k] for e in es)
        return f"{lo:{f}}–{hi:{f}}" if f"{lo:{f}}" != f"{hi:{f}}" else f"{lo:{f}}"

    for (model, n), es in groups.items():
        ref = {"llama3-70b": "< 2 s (70B)", "qwen3-235b-a22b": "4.36 s (235B MoE)"}.get(model, "")
        out.append(f"| {model} | {n} | {span(es, 'pause_s', '.0f')} | {span(es, 'pause_prepared_s', '.1f')} | "
                   f"{span(es, 'end_to_end_s', '.0f')} | {span(es, 'end_to_end_prepared_s', '.0f')} | {ref} |")
    out += ["", "| model | GPUs | scenario | operator: rank order | per-rank plan | transition group | transfer | "
           "new world init | build | **pause** | end-to-end | pause, world built ahead | end-to-end, world built ahead |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        e = end_to_end(r)
        out.append(f"| {r['model']} | {r['gpus']} | {r['scenario']} | {e['operator_s']:.2f} | "
                   f"{e['per_rank_plan_s']:.3f} | {e['transition_group_s']:.1f} | {e['transfer_s']:.3f} | "
                   f"{e['world_init_s']:.1f} | {e['commit_build_s']:.1f} | **{e['pause_s']:.1f}** | "
                   f"{e['end_to_end_s']:.1f} | {e['pause_prepared_s']:.2f} | {e['end_to_end_prepared_s']:.1f} |")
    out += ["", "| model | GPUs | scenario | from → to | devices (old + joining) → new ranks | whole plan + rounds s "
            "| per-rank plan + rounds s, worst / median (n) | moved GB | busiest device GB: NVLink out/in, network out/in "
            "| rounds | transfer s |", "|---|---:|---|---|---|---:|---:|---:|---|---:|---:|"]
    for r in data["rows"]:
        gb = 1e9
        out.append(f"| {r['model']} | {r['gpus']} | {r['scenario']} | `{r['from']}` → `{r['to']}` | "
                   f"{r['devices']} → {r['new_gpus']} | "
                   f"{r['global_plan_cpu_s']:.2f} + {r['global_schedule_cpu_s']:.2f} | "
                   f"{r['per_rank_total_cpu_s_worst']:.3f} / {r['per_rank_total_cpu_s_median']:.3f} "
                   f"({r['per_rank_sampled']}) | {r['bytes_moved'] / gb:.0f} | "
                   f"{r['busiest_nvlink_send_bytes'] / gb:.2f}/{r['busiest_nvlink_recv_bytes'] / gb:.2f}, "
                   f"{r['busiest_network_send_bytes'] / gb:.2f}/{r['busiest_network_recv_bytes'] / gb:.2f} | "
                   f"{r['rounds']} | {r['modeled_seconds']:.3f} |")
    if data.get("extra"):
        out += ["", "| transition | whole plan + rounds s | device | its plan + rounds s | it sends / receives GB "
                "| busiest GB | transfer s |", "|---|---:|---:|---:|---:|---:|---:|"]
        for x in data["extra"]:
            out.append(f"| {x['name']} | {x['plan_seconds']:.3f} + {x['schedule_seconds']:.3f} | {x['device']} | "
                       f"{x['device_plan_seconds']:.3f} + {x['device_schedule_seconds']:.3f} | "
                       f"{x['device_bytes_sent'] / 1e9:.2f} / {x['device_bytes_received'] / 1e9:.2f} | "
                       f"{x['bottleneck_bytes'] / 1e9:.2f} | {x['modeled_seconds']:.3f} |")
    return "\n".join(out)


# Models and scales no other benchmark uses: (name, model, from, to, leave, join, device).
EXTRA = [
    ("llama3-8b@512: lose a node (dp 64->63)", "llama3-8b", "tp=8,pp=1,dp=64,dist_opt",
     "tp=8,pp=1,dp=63,dist_opt", "504-511", 0, 504),
    ("llama3-8b@512: gain a node (dp 63->64)", "llama3-8b", "tp=8,pp=1,dp=63,dist_opt",
     "tp=8,pp=1,dp=64,dist_opt", "", 8, 504),
    ("qwen3-30b-a3b@2048: lose a node (dp 256->252, ep 8)", "qwen3-30b-a3b",
     "tp=2,pp=4,dp=256,ep=8,etp=1,dist_opt", "tp=2,pp=4,dp=252,ep=8,etp=1,dist_opt", "2040-2047", 0, 2040),
    ("qwen3-30b-a3b@2048: change EP (8->16)", "qwen3-30b-a3b",
     "tp=2,pp=8,dp=128,ep=8,etp=1,dist_opt", "tp=2,pp=8,dp=128,ep=16,etp=1,dist_opt", "", 0, 0),
]


def gpus(n: int) -> list[GPU]:
    mem = parse_bytes(GPU_MEMORY, "memory")
    return [GPU(id=f"node-{i // GPUS_PER_NODE}/{i % GPUS_PER_NODE}", node=f"node-{i // GPUS_PER_NODE}",
                memory_bytes=mem) for i in range(n)]


def constraints(model: str) -> Constraints:
    m = MODELS[model]
    return Constraints(global_batch=m["global_batch"], seq_length=m["seq_length"], ep=m["ep"])


def planned(model: str, n: int) -> tuple[ParallelConfig, int, float]:
    """(config, GPUs it uses, planner seconds) of the planner's layout on ``n`` GPUs."""
    t0 = time.perf_counter()
    p = plan_world(PRESETS[model], gpus(n), constraints(model))
    return p.config, p.config.world_size, time.perf_counter() - t0


def transitions(model: str, n: int) -> list[dict]:
    big, big_used, big_s = planned(model, n)
    small, small_used, small_s = planned(model, n - GPUS_PER_NODE)
    assert big_used == n, f"{model}@{n}: the planner leaves GPUs idle"
    out = [
        {"scenario": "node leaves", "from": big, "to": small, "old_gpus": n,
         "leave": frozenset(range(n - GPUS_PER_NODE, n)), "join": 0,
         "planner_s": small_s, "cli": f"--leave {n - GPUS_PER_NODE}-{n - 1}"},
        {"scenario": "node joins", "from": small, "to": big, "old_gpus": small_used,
         "leave": frozenset(), "join": n - small_used, "planner_s": big_s, "cli": f"--join {n - small_used}"},
    ]
    if PRESETS[model].num_moe_experts:
        ep2 = replace(big, ep=big.ep * 2)
        ep2.validate(PRESETS[model])
        out.append({"scenario": f"EP change ({big.ep}->{ep2.ep})", "from": big, "to": ep2, "old_gpus": n,
                    "leave": frozenset(), "join": 0, "planner_s": big_s, "cli": ""})
    return out


def device_bytes(plan) -> dict:
    """Per device: bytes sent and received over NVLink (same node) and over the network."""
    nodes = plan.devices.nodes
    per: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for c in plan.network_copies:
        base = 0 if nodes[c.src] == nodes[c.dst] else 2
        per[c.src][base] += c.nbytes
        per[c.dst][base + 1] += c.nbytes
    return per


def run_transition(model: str, n: int, t: dict, budget: int, per_rank: int) -> dict:
    spec = PRESETS[model]
    old, new = t["from"], t["to"]
    devices = DeviceMap(t["old_gpus"], GPUS_PER_NODE, t["leave"], t["join"])
    gc.collect()
    whole, sched, whole_times = timed_whole_plan(spec, old, new, devices, budget)
    checksum = whole.checksum
    model_t = modeled_seconds(whole, sched, INTRA_NODE_GBPS, INTER_NODE_GBPS)
    per = device_bytes(whole)
    intra, inter = INTRA_NODE_GBPS * 1e9, INTER_NODE_GBPS * 1e9

    def flat_s(v: list[int]) -> float:
        return max(v[0] / intra, v[1] / intra, v[2] / inter, v[3] / inter)

    busiest = max(per, key=lambda d: (flat_s(per[d]), -d)) if per else 0
    bv = per.get(busiest, [0, 0, 0, 0])
    order = whole.rank_to_device
    n_dev = devices.num_devices
    stride = max(1, n_dev // per_rank)
    sample = sorted(set(range(0, n_dev, stride)) | set(t["leave"]) | {busiest})
    row = {
        "model": model, "gpus": n, "scenario": t["scenario"], "from": str(old), "to": str(new),
        "old_gpus": t["old_gpus"], "new_gpus": new.world_size, "devices": n_dev,
        "leave": sorted(t["leave"]), "join": t["join"], "standbys": len(whole.standbys),
        "planner_wall_s": t["planner_s"],
        **whole_times,
        "transfers": len(whole.network_copies), "bytes_moved": whole.bytes_moved,
        "state_bytes": whole.new_layout.state_bytes(),
        "bottleneck_bytes": whole.bottleneck_bytes,
        "lower_bound_bytes": whole.lower_bound["lower_bound_bytes"],
        "busiest_device": busiest,
        "busiest_nvlink_send_bytes": bv[0], "busiest_nvlink_recv_bytes": bv[1],
        "busiest_network_send_bytes": bv[2], "busiest_network_recv_bytes": bv[3],
        "transfer_flat_s": flat_s(bv), "rounds": sched.rounds, "budget_bytes": budget,
        **model_t, "checksum": checksum,
        "cli": (f"liveshard plan-transition --model {model} --from-parallel {old} --to-parallel {new} "
                f"--budget {budget} {t['cli']} --json").replace("  ", " "),
    }
    del whole, sched
    transition_mod.cached_plan.cache_clear()
    rows = []
    for d in sample:
        device_plan.planner.cache_clear()
        gc.collect()
        a0, v0 = time.process_time(), time.perf_counter()
        mine = device_plan.plan_device(spec, ParallelConfig.parse(str(old)), ParallelConfig.parse(str(new)),
                                       DeviceMap(t["old_gpus"], GPUS_PER_NODE, t["leave"], t["join"]), order, d)
        a1 = time.process_time()
        own = schedule(mine, budget)
        a2, v2 = time.process_time(), time.perf_counter()
        rows.append({"device": d, "plan_cpu_s": a1 - a0, "schedule_cpu_s": a2 - a1, "total_cpu_s": a2 - a0,
                     "total_wall_s": v2 - v0, "copies": len(mine.copies), "rounds": own.rounds})
        del mine, own
    worst = max(rows, key=lambda r: r["total_cpu_s"])
    row.update({
        "per_rank_sampled": len(rows),
        "per_rank_total_cpu_s_worst": worst["total_cpu_s"], "per_rank_worst_device": worst["device"],
        "per_rank_plan_cpu_s_worst": max(r["plan_cpu_s"] for r in rows),
        "per_rank_schedule_cpu_s_worst": max(r["schedule_cpu_s"] for r in rows),
        "per_rank_total_cpu_s_median": statistics.median(r["total_cpu_s"] for r in rows),
        "per_rank_total_wall_s_worst": max(r["total_wall_s"] for r in rows),
        "per_rank": rows,
    })
    return row


def run_extra(budget: str) -> list[dict]:
    out = []
    for name, model, old, new, leave, join, device in EXTRA:
        base = ["liveshard", "plan-transition", "--model", model, "--from-parallel", old, "--to-parallel", new, "--budget", budget,
                "--json"]
        if leave:
            base += ["--leave", leave]
        if join:
            base += ["--join", str(join)]
        c0 = time.perf_counter()
        whole = json.loads(subprocess.run(base, check=True, capture_output=True, text=True).stdout)
        whole_wall = time.perf_counter() - c0
        order = ",".join(map(str, whole["rank_to_device"]))
        dev = json.loads(subprocess.run([*base, "--device", str(device), "--rank-to-device", order], check=True,
                                        capture_output=True, text=True).stdout)
        nodes_of = [d // GPUS_PER_NODE for d in range(whole["devices"]["old_world"] + whole["devices"]["joining"])]
        out.append({
            "name": name, "model": model, "from": whole["from"], "to": whole["to"], "leave": leave, "join": join,
            "command": " ".join(base),
            "plan_seconds": whole["plan_seconds"], "schedule_seconds": whole["schedule_seconds"],
            "command_wall_s": whole_wall, "bytes_moved": whole["bytes_moved"],
            "inter_node_bytes": whole["inter_node_bytes"], "bottleneck_bytes": whole["bottleneck_bytes"],
            "lower_bound_bytes": whole["lower_bound_bytes"], "rounds": whole["rounds"],
            "modeled_seconds": whole["modeled_seconds"],
            "device": device, "device_plan_seconds": dev["plan_seconds"],
            "device_schedule_seconds": dev["schedule_seconds"], "device_bytes_sent": dev["bytes_sent"],
            "device_bytes_received": dev["bytes_received"], "device_rounds": dev["rounds"],
            "device_peers": len(dev["peers"]), "device_node": nodes_of[device] if device < len(nodes_of) else None,
        })
        print(f"{name:<52} whole {whole['plan_seconds']:.3f}+{whole['schedule_seconds']:.3f} s  "
              f"device {device}: {dev['plan_seconds']:.3f}+{dev['schedule_seconds']:.3f} s  "
              f"busiest {whole['bottleneck_bytes'] / 1e9:.2f} GB  modeled {whole['modeled_seconds']:.3f} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", default=[], help="model@gpus, e.g. llama3-70b@1024 (repeatable)")
    ap.add_argument("--per-rank", type=int, default=24, help="sample about this many devices per transition")
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--extra", action="store_true", help="also run plan-transition on other models")
    ap.add_argument("--extra-only", action="store_true", help="only the other models")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--table", action="store_true", help="print the tables of the JSON in --out and exit")
    ap.add_argument("--json", action="store_true",
                    help="print, per model, GPU count and scenario, the plan, communicator, transfer, build, pause "
                         "and end-to-end seconds with their sources (from the JSON in --out) and exit")
    ap.add_argument("--figures", action="store_true",
                    help="measure the operator's rank-order choice (overlap figures) for the rows in --out")
    args = ap.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.out).read_text())))
        return 0
    if args.json:
        print(json.dumps(summary(json.loads(Path(args.out).read_text())), indent=1))
        return 0
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})  # one core
    budget = parse_bytes(args.budget, "--budget")
    out_path = Path(args.out)
    old = json.loads(out_path.read_text()) if out_path.exists() else {}
    suites = [f"{m}@{n}" for m in MODELS for n in SCALES]
    if args.only:
        suites = [s for s in suites if s in args.only]
    if args.extra_only:
        suites = []
    if args.figures:
        rows = old.get("rows", [])
        measure_figures([r for r in rows if not args.only or f"{r['model']}@{r['gpus']}" in args.only])
        write(out_path, old, rows, old.get("extra"), budget)
        return 0
    rows = [r for r in old.get("rows", []) if f"{r['model']}@{r['gpus']}" not in suites]
    print(f"{'suite':<22} {'scenario':<18} {'whole plan':>10} {'sched':>6} {'rank worst':>10} {'median':>7} "
          f"{'busiest GB (nvl/net)':>22} {'modeled s':>9}")
    for s in suites:
        model, n = s.split("@")
        for t in transitions(model, int(n)):
            r = run_transition(model, int(n), t, budget, args.per_rank)
            measure_figures([r])
            rows.append(r)
            print(f"{s:<22} {r['scenario']:<18} {r['global_plan_cpu_s']:>10.3f} {r['global_schedule_cpu_s']:>6.3f} "
                  f"{r['per_rank_total_cpu_s_worst']:>10.3f} {r['per_rank_total_cpu_s_median']:>7.3f} "
                  f"{max(r['busiest_nvlink_send_bytes'], r['busiest_nvlink_recv_bytes']) / 1e9:>10.2f}/"
                  f"{max(r['busiest_network_send_bytes'], r['busiest_network_recv_bytes']) / 1e9:<11.2f} "
                  f"{r['modeled_seconds']:>9.3f}   {r['from']} -> {r['to']}", flush=True)
            write(out_path, old, rows, None, budget)
    extra = run_extra(args.budget) if (args.extra or args.extra_only) else None
    write(out_path, old, rows, extra, budget)
    print(f"wrote {out_path}")
    return 0


def write(path: Path, old: dict, rows: list[dict], extra: list[dict] | None, budget: int) -> None:
    rows = sorted(rows, key=_order)
    out = {"bench": "scale_model", "python": sys.version.split()[0], "machine": platform.machine(),
           "cpu_count": os.cpu_count(), "pinned_to_one_core": hasattr(os, "sched_setaffinity"),
           "gpus_per_node": GPUS_PER_NODE, "gpu_memory": GPU_MEMORY, "planner_inputs": MODELS,
           "intra_node_gbps": INTRA_NODE_GBPS, "inter_node_gbps": INTER_NODE_GBPS, "budget_bytes": budget,
           "rows": rows, "extra": extra if extra is not None else old.get("extra", []),
           "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
