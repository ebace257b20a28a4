"""Planning at scale: transition plans for llama3-70b (256 and 1024 GPUs) and qwen3-235b-a22b
(512 GPUs): lose a node, gain nodes, change TP, change PP, change EP, non-uniform PP splits.

For each transition: planning time on one core (plan + checksum, cache cleared, median of
``--repeat``), schedule time, bytes moved, the busiest device against the lower bound, rounds
under the staging budget, and the modeled time on a cluster (450 GB/s NVLink, 50 GB/s network
per GPU). Prints a table and writes ``bench/results/transition_planning.json``.

    python bench/bench_transition_planning.py [--repeat 3] [--budget 1GiB] [--only llama3-70b@1024]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.presets import PRESETS
from liveshard.runtime.units import parse_bytes
from liveshard.runtime.vps import transition as transition_mod
from liveshard.runtime.vps.bound import modeled_seconds
from liveshard.runtime.vps.devices import DeviceMap, parse_devices
from liveshard.runtime.vps.schedule import schedule

QWEN_PP8 = "layers=12+12+12+12+12+12+11+11"
QWEN_PP16 = "layers=" + "+".join(["6"] * 14 + ["5"] * 2)

# (suite, name, model, from, to, leave, join)
TRANSITIONS = [
    ("llama3-70b@256", "lose a node", "llama3-70b", "tp=8,pp=4,dp=8,dist_opt", "tp=8,pp=4,dp=7,dist_opt", "248-255", 0),
    ("llama3-70b@256", "gain 4 nodes (dp 7->8)", "llama3-70b", "tp=8,pp=4,dp=7,dist_opt", "tp=8,pp=4,dp=8,dist_opt", "", 32),
    ("llama3-70b@256", "change TP (8->4, pp 4->8)", "llama3-70b", "tp=8,pp=4,dp=8,dist_opt", "tp=4,pp=8,dp=8,dist_opt", "", 0),
    ("llama3-70b@256", "change PP (4->8, dp 8->4)", "llama3-70b", "tp=8,pp=4,dp=8,dist_opt", "tp=8,pp=8,dp=4,dist_opt", "", 0),
    ("llama3-70b@256", "lose 2 nodes, pp 3 non-uniform", "llama3-70b", "tp=8,pp=4,dp=8,dist_opt",
     "tp=8,pp=3,dp=10,layers=27+27+26,dist_opt", "0-15", 0),
    ("llama3-70b@256", "change TP, no dist-opt", "llama3-70b", "tp=8,pp=4,dp=8", "tp=4,pp=8,dp=8", "", 0),
    ("llama3-70b@1024", "lose a node", "llama3-70b", "tp=8,pp=8,dp=16,dist_opt", "tp=8,pp=8,dp=15,dist_opt", "512-519", 0),
    ("llama3-70b@1024", "gain 8 nodes (dp 15->16)", "llama3-70b", "tp=8,pp=8,dp=15,dist_opt", "tp=8,pp=8,dp=16,dist_opt", "", 64),
    ("llama3-70b@1024", "change TP (8->4, pp 8->16)", "llama3-70b", "tp=8,pp=8,dp=16,dist_opt", "tp=4,pp=16,dp=16,dist_opt", "", 0),
    ("llama3-70b@1024", "change PP (8->4, dp 16->32)", "llama3-70b", "tp=8,pp=8,dp=16,dist_opt", "tp=8,pp=4,dp=32,dist_opt", "", 0),
    ("llama3-70b@1024", "lose 2 nodes, pp 6 non-uniform", "llama3-70b", "tp=8,pp=8,dp=16,dist_opt",
     "tp=8,pp=6,dp=21,layers=14+13+13+13+13+14,dist_opt", "1008-1023", 0),
    ("llama3-70b@1024", "change TP, no dist-opt", "llama3-70b", "tp=8,pp=8,dp=16", "tp=4,pp=16,dp=16", "", 0),
    ("qwen3-235b-a22b@512", "lose a node (dp 16->14, ep 16->8)", "qwen3-235b-a22b",
     f"tp=4,pp=8,dp=16,ep=16,etp=1,{QWEN_PP8},dist_opt", f"tp=4,pp=8,dp=14,ep=8,etp=1,{QWEN_PP8},dist_opt", "504-511", 0),
    ("qwen3-235b-a22b@512", "gain 8 nodes (dp 14->16)", "qwen3-235b-a22b",
     f"tp=4,pp=8,dp=14,ep=8,etp=1,{QWEN_PP8},dist_opt", f"tp=4,pp=8,dp=16,ep=8,etp=1,{QWEN_PP8},dist_opt", "", 64),
    ("qwen3-235b-a22b@512", "change TP (4->2, pp 8->16)", "qwen3-235b-a22b",
     f"tp=4,pp=8,dp=16,ep=16,etp=1,{QWEN_PP8},dist_opt", f"tp=2,pp=16,dp=16,ep=16,etp=1,{QWEN_PP16},dist_opt", "", 0),
    ("qwen3-235b-a22b@512", "change PP (8->4, dp 16->32)", "qwen3-235b-a22b",
     f"tp=4,pp=8,dp=16,ep=16,etp=1,{QWEN_PP8},dist_opt", "tp=4,pp=4,dp=32,ep=16,etp=1,layers=24+24+23+23,dist_opt", "", 0),
    ("qwen3-235b-a22b@512", "change EP (16->32)", "qwen3-235b-a22b",
     f"tp=4,pp=8,dp=16,ep=16,etp=1,{QWEN_PP8},dist_opt", f"tp=4,pp=8,dp=16,ep=32,etp=1,{QWEN_PP8},dist_opt", "", 0),
]

TARGET_PLAN_S = 1.0
TARGET_RATIO = 1.05
TARGET_MODELED = {"llama3-70b": 2.0, "qwen3-235b-a22b": 4.36}


def run_one(suite, name, model, old_text, new_text, leave, join, repeat, budget) -> dict:
    spec = PRESETS[model]
    old, new = ParallelConfig.parse(old_text), ParallelConfig.parse(new_text)
    devices = DeviceMap(old.world_size, 8, parse_devices(leave), join)
    times = []
    plan = None
    for _ in range(repeat):
        transition_mod._plan_cached.cache_clear()
        t0 = time.perf_counter()
        plan = transition_mod.plan_transition(spec, old, new, devices)
        checksum = plan.checksum
        times.append(time.perf_counter() - t0)
    assert plan is not None
    t0 = time.perf_counter()
    sched = schedule(plan, budget)
    schedule_s = time.perf_counter() - t0
    model_t = modeled_seconds(plan, sched)
    lb = plan.lower_bound["lower_bound_bytes"]
    nodes = devices.nodes
    intra = sum(c.nbytes for c in plan.network_copies if nodes[c.src] == nodes[c.dst])
    return {
        "suite": suite, "transition": name, "model": model, "from": str(old), "to": str(new),
        "leave": leave, "join": join, "old_gpus": old.world_size, "new_gpus": new.world_size,
        "plan_seconds": statistics.median(times), "plan_seconds_all": times,
        "schedule_seconds": schedule_s,
        "transfers": len(plan.network_copies), "local_copies": len(plan.copies) - len(plan.network_copies),
        "state_bytes": plan.new_layout.state_bytes(),
        "bytes_moved": plan.bytes_moved, "intra_node_bytes": intra,
        "bottleneck_bytes": plan.bottleneck_bytes, "lower_bound_bytes": lb,
        "receive_bound_bytes": plan.lower_bound["receive_bound_bytes"],
        "send_bound_bytes": plan.lower_bound["send_bound_bytes"],
        "ratio": plan.bottleneck_bytes / lb if lb else 1.0,
        "rounds": sched.rounds, "budget_bytes": budget, "peak_staging_bytes": sched.peak_staging_bytes,
        **model_t,
        "standbys": len(plan.standbys),
        "ranks_moved_device": sum(1 for r, d in enumerate(plan.rank_to_device) if r != d),
        "checksum": checksum,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--only", default="", help="run one suite, e.g. llama3-70b@1024")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "transition_planning.json"))
    args = ap.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    budget = parse_bytes(args.budget, "--budget")
    rows = []
    hdr = (f"{'suite':<20} {'transition':<34} {'plan s':>7} {'sched s':>7} {'moved GB':>9} {'busiest GB':>10} "
           f"{'bound GB':>9} {'ratio':>6} {'rounds':>6} {'model s':>8}")
    print(hdr)
    print("-" * len(hdr))
    for t in TRANSITIONS:
        if args.only and t[0] != args.only:
            continue
        r = run_one(*t, repeat=args.repeat, budget=budget)
        rows.append(r)
        print(f"{r['suite']:<20} {r['transition']:<34} {r['plan_seconds']:>7.3f} {r['schedule_seconds']:>7.3f} "
              f"{r['bytes_moved'] / 1e9:>9.1f} {r['bottleneck_bytes'] / 1e9:>10.3f} {r['lower_bound_bytes'] / 1e9:>9.3f} "
              f"{r['ratio']:>6.3f} {r['rounds']:>6} {r['modeled_seconds']:>8.3f}", flush=True)
    checks = {
        "plan_under_1s_llama3_70b_1024": all(r["plan_seconds"] < TARGET_PLAN_S for r in rows
                                             if r["suite"] == "llama3-70b@1024"),
        "ratio_at_most_1.05": all(r["ratio"] <= TARGET_RATIO for r in rows),
        "modeled_within_published": all(r["modeled_seconds"] <= TARGET_MODELED[r["model"]] for r in rows),
    }
    print("\ntargets: " + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in checks.items()))
    out = {"bench": "transition_planning", "python": sys.version.split()[0], "machine": platform.machine(),
           "cpu_count": os.cpu_count(), "pinned_to_one_core": hasattr(os, "sched_setaffinity"),
           "budget_bytes": budget, "repeat": args.repeat, "targets": checks, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
