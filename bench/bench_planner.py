"""Planner time at 64, 512 and 4096 GPUs, with and without stragglers.

For llama3-70b and qwen3-235b-a22b on nodes of 8 x 80 GiB GPUs (global batch 1024 sequences;
8192 tokens for llama, 4096 for qwen), it times ``plan_parallelism`` (median and worst of
``--repeat`` runs) and, as the peer in the same run, the exhaustive search that prices every
candidate, and checks both pick the same plan. Stragglers: 1 in 32 GPUs, chosen with a fixed
seed, at speed 0.6. Prints a table and writes ``bench/results/planner.json``.

    python bench/bench_planner.py [--repeat 5] [--no-exhaustive]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from liveshard.runtime.planner.search import GPU, Constraints, NoFeasiblePlan, plan_parallelism
from liveshard.runtime.presets import PRESETS

GiB = 2**30
SIZES = (64, 512, 4096)
MODELS = {"llama3-70b": 8192, "qwen3-235b-a22b": 4096}  # model -> sequence length
TARGET_SECONDS = 1.0


def fleet(n: int, stragglers: bool) -> list[GPU]:
    slow = set(random.Random(0).sample(range(n), n // 32)) if stragglers else set()
    return [GPU(f"node-{i // 8}/{i % 8}", f"node-{i // 8}", 80 * GiB, 0.6 if i in slow else 1.0)
            for i in range(n)]


def timed(spec, gpus, constraints, repeat: int, exhaustive: bool = False) -> tuple[list[float], object]:
    seconds, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        try:
            result = plan_parallelism(spec, gpus, constraints, exhaustive=exhaustive)
        except NoFeasiblePlan as e:
            result = e
        seconds.append(time.perf_counter() - start)
    return seconds, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-exhaustive", action="store_true", help="skip the exhaustive peer")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "planner.json"))
    args = parser.parse_args()

    rows = []
    header = (f"{'model':<16} {'gpus':>5} {'stragglers':>10} {'median s':>9} {'max s':>7} "
              f"{'exhaustive s':>12} {'same':>5}  plan")
    print(header)
    print("-" * len(header))
    for model, seq in MODELS.items():
        spec = PRESETS[model]
        constraints = Constraints(global_batch=1024, seq_length=seq)
        for n in SIZES:
            for stragglers in (False, True):
                gpus = fleet(n, stragglers)
                seconds, plan = timed(spec, gpus, constraints, args.repeat)
                row = {
                    "model": model, "gpus": n, "stragglers": n // 32 if stragglers else 0,
                    "seq_length": seq, "global_batch": constraints.global_batch,
                    "plan_seconds_median": statistics.median(seconds), "plan_seconds_max": max(seconds),
                    "plan_seconds_all": seconds,
                }
                if isinstance(plan, NoFeasiblePlan):
                    row.update(feasible=False, reason=str(plan))
                    text = f"no plan: {str(plan)[:70]}"
                else:
                    row.update(feasible=True, config=str(plan.config), world_size=plan.config.world_size,
                               step_seconds=plan.step_seconds, tokens_per_second=plan.tokens_per_second,
                               memory_gib=plan.memory_bytes_per_gpu / GiB, search=plan.explanation[-1])
                    text = f"{plan.config} ({plan.tokens_per_second:,.0f} tok/s)"
                same = ""
                exhaustive_s = float("nan")
                if not args.no_exhaustive:
                    ex_seconds, ex = timed(spec, gpus, constraints, 1, exhaustive=True)
                    exhaustive_s = ex_seconds[0]
                    if isinstance(plan, NoFeasiblePlan):
                        agrees = isinstance(ex, NoFeasiblePlan)
                    else:
                        agrees = (not isinstance(ex, NoFeasiblePlan) and ex.config == plan.config
                                  and ex.step_seconds == plan.step_seconds)
                    row.update(exhaustive_seconds=exhaustive_s, exhaustive_agrees=agrees)
                    same = "yes" if agrees else "NO"
                rows.append(row)
                print(f"{model:<16} {n:>5} {row['stragglers']:>10} {row['plan_seconds_median']:>9.3f} "
                      f"{row['plan_seconds_max']:>7.3f} {exhaustive_s:>12.3f} {same:>5}  {text}")
    worst = max(r["plan_seconds_max"] for r in rows if r["gpus"] == 4096)
    print(f"\nslowest planner run at 4096 GPUs: {worst:.3f} s (target < {TARGET_SECONDS:.0f} s)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "planner", "target_seconds_at_4096": TARGET_SECONDS,
        "worst_seconds_at_4096": worst,
        "machine": {"python": platform.python_version(), "processor": platform.processor() or platform.machine(),
                    "note": "single-threaded Python; one core"},
        "repeat": args.repeat, "rows": rows,
    }, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
