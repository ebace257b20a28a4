"""Scale model: what a reconfiguration costs at 256-4096 GPUs, from measured plans.

For llama3-70b and qwen3-235b-a22b at 256, 512, 1024, 2048 and 4096 GPUs (8 per node, 80 GiB each),
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
    python bench/bench_scale_model.py --groups      # count megatron's new_group calls, and the splits the members-only
                                                    # path makes of them, for the rows there
    python bench/bench_scale_model.py --json        # per row: plan/communicator/transfer/build/pause/end-to-end s,
                                                    # the code's path part by part, each figure's source

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
from itertools import pairwise
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
SCALES = (256, 512, 1024, 2048, 4096)
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


# ---- the path the code takes (``runtime/agent/world_change.py``), part by part ----------------
# A node leave with notice is a ``Shrink``: at the switch (training paused) the transfer runs over
# the old world (the leavers are still in it), the survivors shrink the leavers away
# (``torch.distributed.shrink_group``, ncclCommShrink) and megatron's groups are made over the
# shrunk world by their members only (``megatron.build.init_parallel(members_only=True)``,
# ``comms.groups``: one ``split_group`` of the shrunk world per kind of group, every rank in each,
# and megatron's gloo groups connected by their members), then the model is built. megatron's own
# path (``initialize_model_parallel`` as it is: every ``new_group`` call an ``ncclCommSplit`` of
# the eager world on every rank, a non-member's with no colour) is kept beside it for comparison.
# Only the plans run while training goes on. A join (and an EP change) is a ``LiveRebuild`` with the world built ahead: the transition
# group (joins) and the next world are connected while the old world trains; the pause is the
# transfer and the build. torch 2.13 has no grow (``ncclCommGrow``): ``torch.distributed`` exposes
# ``shrink_group`` and ``split_group`` only.
SHRINK_MEASURED = ((32, 1.53), (256, 1.67), (512, 2.03), (1024, 2.02))  # (GPUs, s): ncclCommShrink
SHRINK_URL = "https://github.com/NVIDIA-NeMo/RL/pull/3186"
# A split of an eagerly initialised NCCL world: 0.063 s (a world of one, lent H100, NCCL 2.28.9,
# bench/results/gpu_check_h100.json, part nccl_world): the cost of a group the rank is in.
SPLIT_MEMBER_S = 0.0633
# A non-member's split (NCCL_SPLIT_NOCOLOR): ncclCommSplit's bootstrap allgather of every rank's
# colour and key over the parent world, a ring of n - 1 steps over TCP on the hosts' network
# (NCCL's bootstrap.cc). A step: 6 us, read from NVIDIA/nccl#1791 ("a few 100 ms" per bootstrap
# all-gather at Meta's scale, ~100k ranks, in N/2 steps: 0.3 s / 50,000); +-3x.
NOCOLOR_HOP_S = 6e-6
NOCOLOR_URL = "https://github.com/NVIDIA/nccl/pull/1791"


def shrink_s(n: int) -> float:
    """ncclCommShrink of an ``n``-GPU world: PR #3186's figures, linear between them, the nearest
    one outside them (flat beyond 1024 GPUs, as they are from 512 on)."""
    pts = SHRINK_MEASURED
    if n <= pts[0][0]:
        return pts[0][1]
    for (a, ta), (b, tb) in pairwise(pts):
        if n <= b:
            return ta + (tb - ta) * (n - a) / (b - a)
    return max(t for _, t in pts)


def megatron_groups_s(calls: int, member: int, n: int) -> float:
    """megatron's ``calls`` ``new_group`` calls over an eagerly initialised ``n``-rank world, the
    rank a member of ``member`` of them: each a split (``SPLIT_MEMBER_S``), the others a
    non-member's split (the parent's ring allgather, ``NOCOLOR_HOP_S`` per step). Every rank makes
    every call in the same order, so the calls are sequential."""
    return member * SPLIT_MEMBER_S + (calls - member) * (n - 1) * NOCOLOR_HOP_S


def members_only_groups_s(r: dict, n: int) -> float:
    """The groups of ``comms.groups`` over an eagerly initialised ``n``-rank world, for rank 0 (a
    member of every kind): each ``split_group`` one ncclCommSplit of the whole world (its bootstrap
    ring all-gather, ``NOCOLOR_HOP_S`` per step) making the rank's group (``SPLIT_MEMBER_S``) or,
    where the kind leaves the rank out, none; each gloo group the rank is in connected by its
    members (taken as a split the rank is in); a kind whose groups overlap (none in these layouts)
    goes through megatron's own calls. The calls are sequential, in megatron's order, after the
    list of megatron's calls is made (``group_requests`` + ``steps``, CPU seconds measured here)."""
    ring = (n - 1) * NOCOLOR_HOP_S
    return (r["members_only_listing_cpu_s"] + r["megatron_split_kinds"] * ring + r["megatron_member_splits"] * SPLIT_MEMBER_S
            + r["megatron_member_gloo_groups"] * SPLIT_MEMBER_S
            + megatron_groups_s(r["megatron_stock_calls"], r["megatron_member_stock_calls"], n))


def path(r: dict) -> dict:
    """One reconfiguration the way the code makes it: each part, whether it runs while training
    goes on or in the pause, and the sums. Raises KeyError for a leave row without its megatron
    group counts (``--groups`` counts them). A leave's ``stock`` is the same leave with megatron's
    own group calls (not the code's path)."""
    plan = r.get("overlap_figures_cpu_s", 2 * r["global_plan_cpu_s"]) + r["per_rank_total_cpu_s_worst"]
    transfer, build = r["modeled_seconds"], COMMIT_BUILD_S
    if r["scenario"] == "node leaves":
        n = r["new_gpus"]
        shrink = shrink_s(r["old_gpus"])
        groups = members_only_groups_s(r, n)
        parts = {"plan": plan, "transfer": transfer, "shrink": shrink, "megatron_groups": groups, "build": build}
        training, pause = ["plan"], ["transfer", "shrink", "megatron_groups", "build"]
        strategy = "shrink"
        communicator = shrink + groups
        # not the code's path: megatron's own calls, every group on every rank
        stock = megatron_groups_s(r["megatron_group_calls"], r["megatron_member_groups"], n)
        variant = {"megatron_groups": stock, "pause_seconds": transfer + shrink + stock + build,
                   "end_to_end_seconds": plan + transfer + shrink + stock + build}
    else:
        group = nccl_init_s(r["devices"]) if r["join"] else 0.0
        world = nccl_init_s(r["new_gpus"])
        parts = {"plan": plan, "transition_group": group, "world_ahead": world, "transfer": transfer, "build": build}
        training, pause = ["plan", "transition_group", "world_ahead"], ["transfer", "build"]
        strategy = "live rebuild, world built ahead"
        communicator = group + world
        variant = None
    pause_s = sum(parts[k] for k in pause)
    return {"strategy": strategy, "parts": parts, "during_training": training, "on_pause": pause,
            "plan_seconds": plan, "communicator_seconds": communicator, "transfer_seconds": transfer,
            "build_seconds": build, "pause_seconds": pause_s,
            "end_to_end_seconds": sum(parts[k] for k in training) + pause_s, "stock": variant}


# Where each figure of ``summary`` comes from, per strategy.
PLAN_SOURCE = ("measured here on CPU (one core of this 2-core machine, time.process_time): the operator's "
               "rank order from the layouts' overlap (vps.transition.overlap_figures) + the worst sampled "
               "per-rank plan (vps.device_plan); runs while training goes on")
TRANSFER_SOURCE = ("modeled: the measured plan's busiest device over 450 GB/s NVLink and 50 GB/s network per GPU "
                   "(line rates), 50 us per round (vps.bound.modeled_seconds); in the pause")
BUILD_SOURCE = ("assumed: 1.0 s to build megatron's model and optimizer around the received tensors on a GPU "
                "(measured on CPU: 0.015-0.074 s for gpt-125m, bench/README.md); in the pause")
SOURCES = {
    "shrink": {
        "plan_seconds": PLAN_SOURCE,
        "communicator_seconds": (
            f"published + measured + modeled, in the pause: ncclCommShrink of the old world, NVIDIA-NeMo/RL PR "
            f"#3186 ({SHRINK_URL}: 1.53 s at 32 GPUs, 1.67 s at 256, 2.03 s at 512, 2.02 s at 1024; linear "
            f"between, flat beyond), then megatron's groups over the shrunk world, made by their members only "
            f"(comms.groups): megatron-core's initialize_model_parallel run for the new layout (megatron.build."
            f"group_requests) and its calls mapped as the code maps them (comms.groups.steps), counted: one "
            f"split_group of the world per kind of group, each the parent's bootstrap ring allgather, (n - 1) x "
            f"{NOCOLOR_HOP_S * 1e6:.0f} us (modeled: a step read from {NOCOLOR_URL}, 'a few 100 ms' per "
            f"all-gather at ~100k ranks in N/2 steps; +-3x), + {SPLIT_MEMBER_S} s for each group the rank is "
            f"in (measured on a lent H100, split_group of an eager NCCL world of one, "
            f"bench/results/gpu_check_h100.json; megatron's gloo groups, connected by their members, taken "
            f"alike: assumed), after listing megatron's calls (megatron.build.group_requests + comms.groups."
            f"steps: measured here on CPU, one core)"),
        "transfer_seconds": TRANSFER_SOURCE,
        "build_seconds": BUILD_SOURCE,
        "pause_seconds": "transfer + shrink + megatron's groups + build (the shrink and the splits follow the transfer)",
        "end_to_end_seconds": "plan_seconds + pause_seconds (from the operator's decision)",
    },
    "live rebuild, world built ahead": {
        "plan_seconds": PLAN_SOURCE,
        "communicator_seconds": (
            "modeled: fresh NCCL initialisation, 2.46 s * (n/8)^0.5 (+-2x; 2.46 s on 8 H100s, NVIDIA/nccl#534; "
            "~265 s on ~96k GPUs, arXiv 2510.20171) for the transition group (joins: old + joining devices) and "
            "the next world, one after the other while the old world trains (torch 2.13 has no ncclCommGrow)"),
        "transfer_seconds": TRANSFER_SOURCE,
        "build_seconds": BUILD_SOURCE,
        "pause_seconds": "transfer + build (the world built ahead)",
        "end_to_end_seconds": "plan_seconds + communicator_seconds + pause_seconds (from the operator's decision)",
    },
}
# Targets (issue tracker): a node leave with notice end to end <= 10 s at 1024 GPUs, <= 15 s at 4096,
# pause <= 1.5 s; a join end to end <= 30 s at 1024.
TARGETS = {"node leaves": {1024: 10.0, 4096: 15.0}, "node joins": {1024: 30.0}}
PAUSE_TARGET_S = 1.5


def summary(data: dict) -> list[dict]:
    """One record per model, GPU count and scenario: the figures of ``path`` with their sources."""
    out = []
    for r in sorted(data["rows"], key=_order):
        if r["scenario"] == "node leaves" and not all(k in r for k in GROUP_COUNTS):
            raise SystemExit(f"{r['model']}@{r['gpus']}: no megatron group counts; run with --groups first")
        e = path(r)
        target = TARGETS.get(r["scenario"], {}).get(r["gpus"])
        out.append({"model": r["model"], "gpus": r["gpus"], "scenario": r["scenario"], "from": r["from"],
                    "to": r["to"], "strategy": e["strategy"],
                    "plan_seconds": round(e["plan_seconds"], 3),
                    "communicator_seconds": round(e["communicator_seconds"], 3),
                    "transfer_seconds": round(e["transfer_seconds"], 3), "build_seconds": e["build_seconds"],
                    "pause_seconds": round(e["pause_seconds"], 3),
                    "end_to_end_seconds": round(e["end_to_end_seconds"], 3),
                    "parts": {k: round(v, 3) for k, v in e["parts"].items()},
                    "during_training": e["during_training"], "on_pause": e["on_pause"],
                    **({k: r[k] for k in GROUP_COUNTS} if "megatron_group_calls" in r else {}),
                    "targets": {"end_to_end_seconds": target,
                                "pause_seconds": PAUSE_TARGET_S if r["scenario"] == "node leaves" else None},
                    **({"with_megatrons_own_group_calls": {k: round(v, 3) for k, v in e["stock"].items()}}
                       if e["stock"] else {}),
                    "operator_measured_as": "overlap figures" if "overlap_figures_cpu_s" in r else "two whole plans",
                    "sources": SOURCES[e["strategy"]]})
    return out


# What ``count_groups`` records per row.
GROUP_COUNTS = ("megatron_group_calls", "megatron_member_groups", "megatron_split_kinds", "megatron_member_splits",
                "megatron_member_gloo_groups", "megatron_stock_calls", "megatron_member_stock_calls",
                "members_only_listing_cpu_s")


def count_groups(rows: list[dict]) -> None:
    """megatron's ``new_group`` calls for each row's new layout and how many of them rank 0 is in
    (``megatron.build.group_requests``: megatron-core's own function, nothing made), and what the
    members-only path makes of them (``comms.groups.steps`` on an eager NCCL world): the splits of
    the world (one per kind), those that give rank 0 a group, its gloo groups, and the calls left
    to megatron's own path (a kind whose groups overlap)."""
    from liveshard.runtime.comms.groups import CONNECT, SPLIT, STOCK, steps
    from liveshard.runtime.megatron.build import group_requests

    for r in rows:
        cfg = ParallelConfig.parse(r["to"])
        group_requests(cfg, 0)  # the first probe imports what the others reuse
        gc.collect()
        t0 = time.process_time()
        requests = group_requests(cfg, 0)
        plan = steps(requests, 0, splittable=True)
        # what init_parallel(members_only=True) adds on the CPU before megatron's first call
        r["members_only_listing_cpu_s"] = time.process_time() - t0
        r["megatron_group_calls"] = len(requests)
        r["megatron_member_groups"] = sum(1 for q in requests if 0 in q.ranks)
        r["megatron_split_kinds"] = sum(1 for s in plan if s.how == SPLIT)
        r["megatron_member_splits"] = sum(1 for s in plan if s.how == SPLIT and any(0 in g for g in s.split))
        r["megatron_member_gloo_groups"] = sum(1 for s in plan if s.how == CONNECT)
        r["megatron_stock_calls"] = sum(1 for s in plan if s.how == STOCK)
        r["megatron_member_stock_calls"] = sum(1 for s in plan if s.how == STOCK and s.member)
        print(f"{r['model']}@{r['gpus']} {r['scenario']}: {r['to']}: {len(requests)} new_group calls, "
              f"rank 0 in {r['megatron_member_groups']}; members only: {r['megatron_split_kinds']} splits "
              f"({r['megatron_member_splits']} giving rank 0 a group), {r['megatron_member_gloo_groups']} gloo "
              f"groups, {r['megatron_stock_calls']} calls left to megatron", flush=True)


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


NOTICE_WINDOWS = (("AWS", 120.0), ("GCP/Azure", 30.0), ("GKE", 15.0))
DYNATRAIN = {"llama3-70b": "< 2 s (70B)", "qwen3-235b-a22b": "4.36 s (235B MoE)"}


def table(data: dict) -> str:
    """Markdown tables of the rows in ``data`` (the figures docs/performance.md shows): each
    reconfiguration on the code's path against the targets and the notice windows, its parts,
    then the plans behind them."""
    data = {**data, "rows": sorted(data["rows"], key=_order)}
    out = ["| model | GPUs | scenario | path | end to end s | pause s | target | fits AWS 120 s / GCP, Azure 30 s "
           "/ GKE 15 s | DynaTrain |", "|---|---:|---|---|---:|---:|---|---|---|"]
    for r in summary(data):
        if r["scenario"] not in TARGETS:
            continue
        t = r["targets"]
        verdicts = []  # each target on its own: end to end, then the pause
        if t["end_to_end_seconds"]:
            met = r["end_to_end_seconds"] <= t["end_to_end_seconds"]
            verdicts.append(f"≤ {t['end_to_end_seconds']:.0f} s **{'met' if met else 'missed'}**")
        if t["pause_seconds"]:
            met = r["pause_seconds"] <= t["pause_seconds"]
            verdicts.append(f"pause ≤ {t['pause_seconds']} s **{'met' if met else 'missed'}**")
        target = ", ".join(verdicts)
        fits = " / ".join("yes" if r["end_to_end_seconds"] <= w else "no" for _, w in NOTICE_WINDOWS)
        out.append(f"| {r['model']} | {r['gpus']} | {r['scenario']} | {r['strategy']} | {r['end_to_end_seconds']:.1f} | "
                   f"{r['pause_seconds']:.2f} | {target} | {fits} | {DYNATRAIN.get(r['model'], '')} |")
    out += ["", "| model | GPUs | scenario | plan (training) | shrink | megatron's groups, members only: splits + "
            "gloo s | transition group + world ahead (training) | transfer | build | **pause** | **end to end** | "
            "megatron's own calls: calls (own) groups s, pause / end to end |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary(data):
        p = r["parts"]
        stock = r.get("with_megatrons_own_group_calls")
        if r["strategy"] == "shrink":
            groups = f"{r['megatron_split_kinds']} + {r['megatron_member_gloo_groups']} {p['megatron_groups']:.2f}"
            shrink, ahead = f"{p['shrink']:.2f}", "–"
        else:
            groups, shrink, ahead = "–", "–", f"{p['transition_group']:.1f} + {p['world_ahead']:.1f}"
        stock_s = (f"{r['megatron_group_calls']} ({r['megatron_member_groups']}) {stock['megatron_groups']:.1f}, "
                   f"{stock['pause_seconds']:.2f} / {stock['end_to_end_seconds']:.1f}" if stock else "–")
        out.append(f"| {r['model']} | {r['gpus']} | {r['scenario']} | {p['plan']:.2f} | {shrink} | {groups} | "
                   f"{ahead} | {p['transfer']:.3f} | {p['build']:.1f} | **{r['pause_seconds']:.2f}** | "
                   f"**{r['end_to_end_seconds']:.1f}** | {stock_s} |")
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
    ap.add_argument("--groups", action="store_true",
                    help="count megatron's new_group calls for each row's new layout in --out")
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
    if args.groups:
        rows = old.get("rows", [])
        count_groups([r for r in rows if not args.only or f"{r['model']}@{r['gpus']}" in args.only])
        write(out_path, old, rows, old.get("extra"), budget)
        return 0
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
