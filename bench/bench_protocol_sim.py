"""A soak of the protocol simulator: many seeded fault schedules against the real coordinator core
and commit points, on one core; schedules per second and the fault classes injected.

    python bench/bench_protocol_sim.py [--schedules 20000] [--seed 1] [--json results/protocol_sim.json]

Exit 1 with the first violating schedule's seed and trace (replay it with
``python -m liveshard.dev.sim --schedules 1 --seed S``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from liveshard.dev.sim import run_schedules


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--schedules", type=int, default=20000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args()
    t0, c0 = time.perf_counter(), time.process_time()
    report = run_schedules(args.schedules, args.seed)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    out = {**report.to_dict(), "cpu_seconds": round(cpu, 2), "wall_seconds": round(wall, 2),
           "schedules_per_minute_cpu": round(60 * report.schedules / cpu) if cpu else None,
           "seed": args.seed}
    out.pop("failed", None)
    print(f"{'schedules':>10} {'violations':>10} {'cpu s':>8} {'per min (cpu)':>14} {'per min (wall)':>15}")
    print(f"{report.schedules:>10} {0 if report.failed is None else 1:>10} {cpu:>8.1f} "
          f"{60 * report.schedules / cpu:>14.0f} {60 * report.schedules / wall:>15.0f}")
    print("faults injected:", ", ".join(f"{k} {v}" for k, v in sorted(report.faults.items()) if ":" not in k))
    print("how schedules ended:", ", ".join(f"{k} {v}" for k, v in sorted(report.outcomes.items())))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if report.failed is not None:
        print(f"VIOLATION in schedule seed {report.failed.seed}:", *report.failed.violations, sep="\n  ")
        print("trace:", *report.failed.trace[-60:], sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
