"""Detection to published plan on the coordinator, with and without plans precomputed; and what
each rank's prepare computes for the resulting transition.

qwen3-235b-a22b on 1024 GPUs (128 nodes of 8, ``tp=4,pp=8,dp=32,ep=16,etp=1``, uneven stages),
the coordinator's real code over an in-process store: the first world is committed, then every
GPU of one node falls silent past the heartbeat timeout. Two cases: without the distributed
optimizer every piece has a live copy on another node (a live recovery); with it, a node's
optimizer shards are held by that node alone (its TP group), so the recovery restores the last
checkpoint (one is reported in the store). Timed: the coordinator tick that notices the loss,
from reading the heartbeats to the published recovery plan (world plan, no-live-copy check,
publication):

* without the cache (``precompute=False``): the tick plans the world and checks it;
* with the cache: after the commit a background thread plans each node's loss in turn; the node
  lost is the first one it plans, and the loss comes once that plan is in.

Also timed: a tick with nothing to do (reading 1024 heartbeats), the background's time per node
loss, and, for the published transition, each sampled rank's prepare computation as a worker
runs it (``device_plan_for``, its inputs digest, its rounds under a 1 GiB budget; nothing cached
between ranks) against the whole plan every rank computed before (``plan_for``, its checksum,
the schedule). CPU seconds of the measuring thread (``time.thread_time``: what a shared machine
and the coordinator's background thread cannot inflate) beside wall seconds.

    python bench/bench_precomputed_plans.py [--stride 64] [--no-global] [--only live|checkpoint]
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

import torch.distributed as dist

from liveshard.runtime.agent.transition import device_plan_for, plan_for
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.control.protocol import MemberResult, transition_devices
from liveshard.runtime.control.store import JobStore
from liveshard.runtime.coordinator import Coordinator, PlanningInputs, PlanRequest
from liveshard.runtime.planner import Constraints
from liveshard.runtime.presets import PRESETS
from liveshard.runtime.vps import device_plan as device_plan_mod
from liveshard.runtime.vps import transition as transition_mod
from liveshard.runtime.vps.schedule import DEFAULT_BUDGET, schedule

ROOT = Path(__file__).resolve().parents[1]
MODEL = "qwen3-235b-a22b"
LAYOUT = "tp=4,pp=8,dp=32,ep=16,etp=1,layers=12+12+12+12+12+12+11+11"
NODES, PER_NODE = 128, 8
# case -> (config, planning inputs)
CASES = {
    "live": (LAYOUT, PlanningInputs(Constraints(global_batch=1024, micro_batch=1, granularity=PER_NODE,
                                                dist_opt=False), gpu_memory_bytes=80 << 30)),
    "checkpoint": (f"{LAYOUT},dist_opt", PlanningInputs(Constraints(global_batch=1024, micro_batch=1,
                                                                    granularity=PER_NODE), gpu_memory_bytes=80 << 30)),
}


class Source:
    def __init__(self) -> None:
        self.queue: list[PlanRequest] = []

    def poll(self):
        return self.queue.pop(0) if self.queue else None

    def report(self, status: dict) -> None:
        pass

    def planning(self):
        return None


def workers() -> list[str]:
    return [f"pod-{k}/{g}" for k in range(NODES) for g in range(PER_NODE)]


_sent = [0.0]


def beat(store: JobStore, ids) -> None:
    _sent[0] = max(time.time(), _sent[0] + 1e-3)  # each beat newer than the last
    for w in ids:
        store.set_json(Keys.heartbeat(w), {"time": _sent[0], "state": "training"})


class Clock:
    """The coordinator's clock, moved by hand: a node's silence is time passing without its beats."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def running(case: str, precompute: bool) -> Coordinator:
    """A coordinator with the 1024-GPU world committed, and a checkpoint reported."""
    config, inputs = CASES[case]
    store = JobStore(dist.HashStore())
    store.set_json(Keys.CHECKPOINT, {"path": "/checkpoints/step-100", "step": 100})
    c = Coordinator(store, PRESETS[MODEL], Source(), inputs, heartbeat_timeout=30.0, precompute=precompute,
                    clock=Clock())
    c.report_interval = 1e9  # status reports are not what is measured
    ids = workers()
    for w in ids:
        store.register_member(w, {"host": w.split("/")[0], "node": f"node-{w.split('/')[0]}", "time": time.time()})
    beat(store, ids)
    c.source.queue.append(PlanRequest(members=tuple(ids), config=config))
    c.tick()
    plan = c.pending.plan
    for m in plan.members:
        store.set(Keys.result(plan.generation, m), MemberResult(ok=True).to_json())
    c.tick()
    assert c.current == plan, c.history
    return c


def lose_first_node(c: Coordinator) -> tuple[float, float, object]:
    """Node 0 falls silent; returns (wall, cpu) seconds of the tick that publishes the recovery."""
    ids = workers()
    c.tick()  # the coordinator saw everyone; then node 0 falls silent
    c.clock.t += 60
    beat(c.store, ids[PER_NODE:])
    t0, p0 = time.perf_counter(), time.thread_time()
    c.tick()
    wall, cpu = time.perf_counter() - t0, time.thread_time() - p0
    assert c.pending is not None, c.history
    return wall, cpu, c.pending.plan


def idle_tick(c: Coordinator) -> float:
    beat(c.store, workers())
    t0 = time.perf_counter()
    c.tick()
    return time.perf_counter() - t0


def prepare_costs(spec, old, new, stride: int, with_global: bool) -> dict:
    devices = transition_devices(old, new)
    sample = sorted(set(range(0, len(devices), stride)) | {len(devices) - 1})
    rows = []
    for d in sample:
        w = devices[d]
        if w in new.dead:
            continue
        device_plan_mod.planner.cache_clear()  # each worker plans alone
        t0, p0 = time.perf_counter(), time.thread_time()
        mine = device_plan_for(spec, old, new, w)
        digest = mine.digest
        sched = schedule(mine, DEFAULT_BUDGET)
        rows.append({"device": d, "wall_s": time.perf_counter() - t0, "cpu_s": time.thread_time() - p0,
                     "copies": len(mine.copies), "rounds": sched.rounds, "digest": digest[:16]})
    out = {"sampled": len(rows), "per_rank": rows,
           "max_cpu_s": max(r["cpu_s"] for r in rows), "median_cpu_s": statistics.median(r["cpu_s"] for r in rows),
           "max_wall_s": max(r["wall_s"] for r in rows)}
    if with_global:
        transition_mod.cached_plan.cache_clear()
        t0, p0 = time.perf_counter(), time.thread_time()
        whole = plan_for(spec, old, new)
        _ = whole.checksum
        schedule(whole, DEFAULT_BUDGET)
        out["global_cpu_s"] = time.thread_time() - p0
        out["global_wall_s"] = time.perf_counter() - t0
    return out


def measure(case: str, stride: int, with_global: bool) -> dict:
    spec = PRESETS[MODEL]
    res: dict = {"config": CASES[case][0]}
    # without the cache
    transition_mod.cached_plan.cache_clear()
    c = running(case, precompute=False)
    res["idle_tick_s"] = idle_tick(c)
    wall, cpu, fresh = lose_first_node(c)
    res["without_cache"] = {"detect_to_plan_wall_s": wall, "detect_to_plan_cpu_s": cpu,
                            "misses": c.plans.misses, "hits": c.plans.hits}
    res["recovery"] = {"config": fresh.config, "members": len(fresh.members), "restore_from": fresh.restore_from}
    print(f"[{case}] without cache: detection to published plan {wall:.2f} s wall, {cpu:.2f} s CPU "
          f"({fresh.config} on {len(fresh.members)} GPUs{', restoring ' + fresh.restore_from if fresh.restore_from else ''})")
    old = c.current
    if fresh.restore_from is None:  # a live transition: each rank's prepare computation
        pc = prepare_costs(spec, old, fresh, stride, with_global)
        res["prepare"] = pc
        print(f"[{case}] per-rank prepare plan ({pc['sampled']} ranks): max {pc['max_cpu_s']:.2f} s CPU, "
              f"median {pc['median_cpu_s']:.2f} s CPU"
              + (f"; whole plan + checksum + schedule {pc['global_cpu_s']:.2f} s CPU" if "global_cpu_s" in pc
                 else ""))

    # with the cache: wait for the background to plan node 0's loss (its first question pair)
    transition_mod.cached_plan.cache_clear()
    c = running(case, precompute=True)
    t0 = time.perf_counter()
    while len(c.plans) < 3:  # node 0's world plan and check are in, node 1's world is under way
        time.sleep(0.05)
    first = time.perf_counter() - t0
    c.plans.hits = c.plans.misses = 0
    wall, cpu, cached = lose_first_node(c)
    assert c.plans.misses == 0, "the event was planned on the spot"
    while c.precomputed is None:  # the background stops at its next question: let it, before going on
        time.sleep(0.05)
    res["with_cache"] = {"detect_to_plan_wall_s": wall, "detect_to_plan_cpu_s": cpu, "hits": c.plans.hits,
                         "misses": c.plans.misses, "background_first_event_s": first}
    same = {k: v for k, v in vars(cached).items() if k != "created"} == {k: v for k, v in vars(fresh).items()
                                                                          if k != "created"}
    res["same_plan"] = same
    print(f"[{case}] with cache:    detection to published plan {wall:.3f} s wall, {cpu:.3f} s CPU "
          f"(background: {first:.1f} s for the first node's loss); same plan: {same}")
    print(f"[{case}] idle tick (1024 heartbeats read): {res['idle_tick_s']:.3f} s")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stride", type=int, default=64, help="sample every N-th device of the transition")
    ap.add_argument("--no-global", action="store_true", help="skip the whole-plan comparison")
    ap.add_argument("--only", choices=sorted(CASES), help="one case")
    args = ap.parse_args()
    res: dict = {"bench": "precomputed_plans", "model": MODEL, "gpus": NODES * PER_NODE,
                 "python": sys.version.split()[0], "machine": platform.machine(), "cpu_count": os.cpu_count(),
                 "cases": {}}
    for case in [args.only] if args.only else list(CASES):
        res["cases"][case] = measure(case, args.stride, not args.no_global)
    res["load_average"] = os.getloadavg()
    out = ROOT / "bench" / "results" / "precomputed_plans.json"
    out.write_text(json.dumps(res, indent=1, default=str))
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
