"""Planning at scale: transition plans for llama3-70b (256 and 1024 GPUs) and qwen3-235b-a22b
(256, 512 and 1024 GPUs): lose a node, gain nodes, change TP, change PP, change EP, non-uniform
PP splits.

Whole plans: for each transition, planning time on one core (plan + checksum, cache cleared,
median of ``--repeat``), schedule time (CPU seconds of this process, ``time.process_time``: what a
shared machine cannot inflate; wall seconds are kept in the JSON), bytes moved, the busiest device against the lower bound,
rounds under the staging budget, and the modeled time on a cluster (450 GB/s NVLink, 50 GB/s
network per GPU).

Per-rank plans (``vps.device_plan``, what each worker computes): for a node loss (and an EP
change on qwen3), one device at a time with nothing cached, as a worker does: its plan, its
rounds, and both together, CPU seconds of this process (``time.process_time``: the figure a
shared machine cannot inflate; wall seconds are kept too), worst and median over a sample of
devices (every ``--stride``-th device and every leaving one). The rank order comes from the whole
plan, as a worker's comes from its world plan. Each sampled device's plan and rounds are checked
equal to its slice of the whole plan.

Prints tables and writes ``bench/results/transition_planning.json``.

    python bench/bench_transition_planning.py [--repeat 3] [--budget 1GiB] [--only llama3-70b@1024]
        [--per-rank-only] [--stride 16]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
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

QWEN_256_EP4 = f"tp=4,pp=8,dp=7,ep=4,etp=1,{QWEN_PP8},dist_opt"
QWEN_1024 = f"tp=4,pp=8,dp=32,ep=16,etp=1,{QWEN_PP8},dist_opt"

# (suite, name, model, from, to, leave, join): whole and per-rank plans
PER_RANK = [
    ("llama3-70b@256", "lose a node", "llama3-70b", "tp=8,pp=4,dp=8,dist_opt", "tp=8,pp=4,dp=7,dist_opt",
     "248-255", 0),
    ("llama3-70b@1024", "lose a node", "llama3-70b", "tp=8,pp=8,dp=16,dist_opt", "tp=8,pp=8,dp=15,dist_opt",
     "512-519", 0),
    ("qwen3-235b-a22b@256", "lose a node (dp 8->7, ep 16->4)", "qwen3-235b-a22b",
     f"tp=4,pp=8,dp=8,ep=16,etp=1,{QWEN_PP8},dist_opt", QWEN_256_EP4, "248-255", 0),
    ("qwen3-235b-a22b@256", "change EP (16->32)", "qwen3-235b-a22b",
     f"tp=4,pp=8,dp=8,ep=16,etp=1,{QWEN_PP8},dist_opt", f"tp=4,pp=8,dp=8,ep=32,etp=1,{QWEN_PP8},dist_opt", "", 0),
    ("qwen3-235b-a22b@1024", "lose a node (dp 32->31, ep 16->4)", "qwen3-235b-a22b", QWEN_1024,
     f"tp=4,pp=8,dp=31,ep=4,etp=1,{QWEN_PP8},dist_opt", "1016-1023", 0),
    ("qwen3-235b-a22b@1024", "change EP (16->32)", "qwen3-235b-a22b", QWEN_1024,
     f"tp=4,pp=8,dp=32,ep=32,etp=1,{QWEN_PP8},dist_opt", "", 0),
]

TARGET_PLAN_S = 1.0
TARGET_RATIO = 1.05
TARGET_MODELED = {"llama3-70b": 2.0, "qwen3-235b-a22b": 4.36}
TARGET_PER_RANK_S = {"llama3-70b@1024": 0.1, "qwen3-235b-a22b@1024": 0.5}  # plan + rounds, one core


def run_one(suite, name, model, old_text, new_text, leave, join, repeat, budget) -> dict:
    spec = PRESETS[model]
    old, new = ParallelConfig.parse(old_text), ParallelConfig.parse(new_text)
    devices = DeviceMap(old.world_size, 8, parse_devices(leave), join)
    times, walls = [], []
    plan = None
    for _ in range(repeat):
        transition_mod.cached_plan.cache_clear()
        c0, t0 = time.process_time(), time.perf_counter()
        plan = transition_mod.plan_transition(spec, old, new, devices)
        checksum = plan.checksum
        times.append(time.process_time() - c0)
        walls.append(time.perf_counter() - t0)
    assert plan is not None
    c0, t0 = time.process_time(), time.perf_counter()
    sched = schedule(plan, budget)
    schedule_s = time.process_time() - c0
    schedule_wall = time.perf_counter() - t0
    model_t = modeled_seconds(plan, sched)
    lb = plan.lower_bound["lower_bound_bytes"]
    nodes = devices.nodes
    intra = sum(c.nbytes for c in plan.network_copies if nodes[c.src] == nodes[c.dst])
    return {
        "suite": suite, "transition": name, "model": model, "from": str(old), "to": str(new),
        "leave": leave, "join": join, "old_gpus": old.world_size, "new_gpus": new.world_size,
        "plan_seconds": statistics.median(times), "plan_seconds_all": times,
        "plan_wall_seconds": statistics.median(walls), "schedule_seconds": schedule_s,
        "schedule_wall_seconds": schedule_wall,
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


def _digest(copies, chunks) -> str:
    """A device's copies and chunks (copy, offset, shape, round), in a canonical order, hashed."""
    return hashlib.sha256(repr((sorted(copies), sorted(chunks))).encode()).hexdigest()


def timed_whole_plan(spec, old, new, devices, budget) -> tuple:
    """The whole plan (its checksum included) and its rounds, nothing cached: (plan, schedule,
    their CPU and wall seconds as ``global_plan_*_s`` and ``global_schedule_*_s``)."""
    transition_mod.cached_plan.cache_clear()
    c0, t0 = time.process_time(), time.perf_counter()
    whole = transition_mod.plan_transition(spec, old, new, devices)
    whole.checksum  # noqa: B018 - part of what a plan costs
    c1, t1 = time.process_time(), time.perf_counter()
    sched = schedule(whole, budget)
    c2, t2 = time.process_time(), time.perf_counter()
    return whole, sched, {"global_plan_cpu_s": c1 - c0, "global_plan_wall_s": t1 - t0,
                          "global_schedule_cpu_s": c2 - c1, "global_schedule_wall_s": t2 - t1}


def run_per_rank(suite, name, model, old_text, new_text, leave, join, budget, stride) -> dict:
    """The whole plan once (its time, the rank order), then sampled devices' own plans."""
    from liveshard.runtime.vps import device_plan

    spec = PRESETS[model]
    old, new = ParallelConfig.parse(old_text), ParallelConfig.parse(new_text)
    devices = DeviceMap(old.world_size, 8, parse_devices(leave), join)
    whole, sched, whole_times = timed_whole_plan(spec, old, new, devices, budget)
    checksum = whole.checksum
    order = whole.rank_to_device
    global_rounds = sched.rounds
    sample = sorted(set(range(0, devices.num_devices, stride)) | devices.leaving)
    wanted = set(sample)
    expect_chunks: dict[int, list[tuple]] = {d: [] for d in sample}
    expect_copies: dict[int, list] = {d: [] for d in sample}
    for ch in sched.chunks:
        c = whole.copies[ch.copy]
        for d in {c.src, c.dst} & wanted:
            expect_chunks[d].append((c, ch.offset, ch.shape, ch.round))
    for c in whole.copies:
        for d in {c.src, c.dst} & wanted:
            expect_copies[d].append(c)
    expect = {d: _digest(expect_copies[d], expect_chunks[d]) for d in sample}
    # A worker holds no whole plan: free it (and keep only digests of the slices), so that the
    # garbage collector's passes over millions of objects are not timed as a device's planning.
    del whole, sched, expect_chunks, expect_copies
    transition_mod.cached_plan.cache_clear()
    rows = []
    equal = True
    for d in sample:
        device_plan.planner.cache_clear()
        gc.collect()
        a0, w0 = time.process_time(), time.perf_counter()
        # fresh configs and device map: a worker shares no cached layout or rank order with others
        mine = device_plan.plan_device(spec, ParallelConfig.parse(old_text), ParallelConfig.parse(new_text),
                                       DeviceMap(old.world_size, 8, parse_devices(leave), join), order, d)
        a1 = time.process_time()
        own = schedule(mine, budget)
        a2, w2 = time.process_time(), time.perf_counter()
        rows.append({"device": d, "plan_cpu_s": a1 - a0, "schedule_cpu_s": a2 - a1, "total_cpu_s": a2 - a0,
                     "total_wall_s": w2 - w0, "copies": len(mine.copies), "rounds": own.rounds})
        if _digest(mine.copies, [(mine.copies[ch.copy], ch.offset, ch.shape, ch.round) for ch in own.chunks]) != expect[d]:
            equal = False
        del mine, own

    def stat(field: str) -> tuple[float, float, int]:
        worst = max(rows, key=lambda r: r[field])
        return worst[field], statistics.median(r[field] for r in rows), worst["device"]

    out = {"suite": suite, "transition": name, "model": model, "from": str(old), "to": str(new), "leave": leave,
           "join": join, "old_gpus": old.world_size, "new_gpus": new.world_size,
           **whole_times,
           "global_rounds": global_rounds, "checksum": checksum,
           "sampled_devices": len(rows), "stride": stride, "slices_equal_whole_plan": equal, "per_device": rows}
    for f in ("plan_cpu_s", "schedule_cpu_s", "total_cpu_s", "total_wall_s"):
        out[f"per_rank_{f}_worst"], out[f"per_rank_{f}_median"], out[f"per_rank_{f}_worst_device"] = stat(f)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--only", default="", help="run one suite, e.g. llama3-70b@1024")
    ap.add_argument("--per-rank-only", action="store_true", help="skip the whole-plan table")
    ap.add_argument("--stride", type=int, default=16, help="per-rank: time every STRIDE-th device (and leavers)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "transition_planning.json"))
    args = ap.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    budget = parse_bytes(args.budget, "--budget")
    rows = []
    hdr = (f"{'suite':<20} {'transition':<34} {'plan s':>7} {'sched s':>7} {'moved GB':>9} {'busiest GB':>10} "
           f"{'bound GB':>9} {'ratio':>6} {'rounds':>6} {'model s':>8}")
    for t in [] if args.per_rank_only else TRANSITIONS:
        if args.only and t[0] != args.only:
            continue
        if not rows:
            print(hdr)
            print("-" * len(hdr))
        r = run_one(*t, repeat=args.repeat, budget=budget)
        rows.append(r)
        print(f"{r['suite']:<20} {r['transition']:<34} {r['plan_seconds']:>7.3f} {r['schedule_seconds']:>7.3f} "
              f"{r['bytes_moved'] / 1e9:>9.1f} {r['bottleneck_bytes'] / 1e9:>10.3f} {r['lower_bound_bytes'] / 1e9:>9.3f} "
              f"{r['ratio']:>6.3f} {r['rounds']:>6} {r['modeled_seconds']:>8.3f}", flush=True)
    per_rank = []
    hdr2 = (f"\n{'suite':<21} {'transition':<34} {'whole plan':>10} {'whole sched':>11} "
            f"{'rank worst':>10} {'median':>7} {'(plan':>6} {'+rounds)':>8} {'wall worst':>10} {'n':>4} {'equal':>5}")
    print(hdr2)
    print("-" * len(hdr2))
    for t in PER_RANK:
        if args.only and t[0] != args.only:
            continue
        r = run_per_rank(*t, budget=budget, stride=args.stride if t[0].endswith("1024") else max(1, args.stride // 4))
        per_rank.append(r)
        print(f"{r['suite']:<21} {r['transition']:<34} {r['global_plan_cpu_s']:>10.3f} {r['global_schedule_cpu_s']:>11.3f} "
              f"{r['per_rank_total_cpu_s_worst']:>10.3f} {r['per_rank_total_cpu_s_median']:>7.3f} "
              f"{r['per_rank_plan_cpu_s_worst']:>6.3f} {r['per_rank_schedule_cpu_s_worst']:>8.3f} "
              f"{r['per_rank_total_wall_s_worst']:>10.3f} {r['sampled_devices']:>4} "
              f"{'yes' if r['slices_equal_whole_plan'] else 'NO':>5}", flush=True)
    checks = {
        "per_rank_targets": all(r["per_rank_total_cpu_s_worst"] <= TARGET_PER_RANK_S[r["suite"]] for r in per_rank
                                if r["suite"] in TARGET_PER_RANK_S),
        "per_rank_equals_whole_plan": all(r["slices_equal_whole_plan"] for r in per_rank),
        "plan_under_1s_llama3_70b_1024": all(r["plan_seconds"] < TARGET_PLAN_S for r in rows
                                             if r["suite"] == "llama3-70b@1024"),
        "ratio_at_most_1.05": all(r["ratio"] <= TARGET_RATIO for r in rows),
        "modeled_within_published": all(r["modeled_seconds"] <= TARGET_MODELED[r["model"]] for r in rows),
    }
    print("\ntargets: " + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in checks.items()))
    out = {"bench": "transition_planning", "python": sys.version.split()[0], "machine": platform.machine(),
           "cpu_count": os.cpu_count(), "pinned_to_one_core": hasattr(os, "sched_setaffinity"),
           "budget_bytes": budget, "repeat": args.repeat, "targets": checks, "rows": rows, "per_rank": per_rank,
           "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
