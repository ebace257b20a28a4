"""Stragglers: what one slow device costs, and how much of it the straggler policy wins back.

Per layout, three ``run-local`` jobs of the same model, data and steps (real coordinator and
worker processes, gloo on CPU): healthy; device 1 slowed to ``--factor`` of its speed at step
``--slow-at`` (``slow=1@F``: it sleeps in proportion to its compute) with the policy off; the
same with ``--adaptive``. Throughput is samples per second from the slowdown to the end (the
policy's detection and switches included) and, apart, over the last ``--tail`` steps (its
steady state). ``recovered`` = (with policy - slowed) / (healthy - slowed). Every plan the
policy chose is listed with its predicted step time against the median measured under it.
Then a healthy run of ``--healthy-steps`` steps with the policy on must make no switch.

    python bench/bench_stragglers.py [--steps 60] [--factor 0.5] [--out bench/results/stragglers.json]

The model: a 16-layer tiny Llama (hidden 128, sequence 64). Four ranks share this machine's two
cores, so a slowed rank's sleep would free CPU for the others (a GPU straggler frees nothing)
and hide most of its cost: with ``--stretch K`` (default 4) every device is emulated K times
slower than the CPU by sleeping in proportion to its compute, so compute is mostly sleep, the
ranks stop competing for the cores, and a straggler costs what it would on dedicated devices.
The healthy run for false switches runs without stretch (real CPU noise, 4 ranks on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = """preset: tiny-llama
name: bench-llama-16
num_layers: 16
hidden_size: 128
num_attention_heads: 4
num_query_groups: 2
ffn_hidden_size: 512
max_sequence_length: 128
"""
LAYOUTS = ("tp=1,pp=2,dp=2", "tp=1,pp=4,dp=1")
GLOBAL_BATCH = 8
SEQ = 64


def run(model: str, parallel: str, steps: int, events: str, adaptive: bool, window: int, workdir: Path,
        stretch: float = 1.0) -> dict:
    from liveshard.dev.localrun.driver import RunSpec, run_local
    from liveshard.dev.localrun.events import parse_events
    from liveshard.runtime.contract.jobspec import AdaptivePolicy

    return run_local(RunSpec.mock(model, workers=4, parallel=parallel, steps=steps, global_batch=GLOBAL_BATCH,
                                  seq_length=SEQ, events=parse_events(events), workdir=str(workdir),
                                  adaptive=AdaptivePolicy(enabled=adaptive, window=window), stretch=stretch))


def throughput(report: dict, first: int, last: int) -> float:
    """Samples per second from the end of step ``first`` to the end of step ``last``."""
    times = {s["step"]: s["time"] for s in report["steps"]}
    return (last - first) * GLOBAL_BATCH / (times[last] - times[first])


def tail_step(report: dict, tail: int) -> float:
    return statistics.median(s["seconds"] for s in report["steps"][-tail:])


def plans(report: dict) -> list[dict]:
    """Each plan the policy chose: predicted step time against the median measured under it
    (its first two steps left out: the one-off costs of a new world)."""
    out = []
    for a in report["adaptive"]:
        d = a.get("decision") or {}
        if a["outcome"] != "committed":
            out.append({"config": a["config"], "outcome": a["outcome"]})
            continue
        measured = [s["seconds"] for s in report["steps"] if s["generation"] == a["generation"]][2:]
        before = [s["seconds"] for s in report["steps"] if s["step"] <= (d.get("step") or 0)][-4:]
        out.append({"config": a["config"], "kind": d.get("kind"), "decided_at": d.get("step"),
                    "switched_at": a["switch_step"], "downtime": a.get("downtime"),
                    "predicted_before": d.get("predictedStepSeconds"),
                    "measured_before": statistics.median(before) if before else None,
                    "predicted_after": d.get("predictedStepSecondsAfter"),
                    "measured_after": statistics.median(measured) if measured else None,
                    "switch_cost": d.get("switchCostSeconds"), "reason": d.get("reason")})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--slow-at", type=int, default=8)
    p.add_argument("--stretch", type=float, default=4.0,
                   help="devices emulated this many times slower than the CPU (sleep), so ranks do not share cores")
    p.add_argument("--factor", type=float, default=0.5)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--tail", type=int, default=10)
    p.add_argument("--healthy-steps", type=int, default=200)
    p.add_argument("--layouts", default=";".join(LAYOUTS),
                   help="layouts separated by ';'")
    p.add_argument("--out", default=str(HERE / "results" / "stragglers.json"))
    args = p.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-stragglers-") as tmp:
        model = Path(tmp) / "model.yaml"
        model.write_text(MODEL)
        events = f"{args.slow_at}:slow=1@{args.factor:g}"
        for layout in args.layouts.split(";"):
            reports = {}
            for name, ev, adaptive in (("healthy", "", False), ("slowed", events, False),
                                       ("policy", events, True)):
                t0 = time.time()
                reports[name] = run(str(model), layout, args.steps, ev, adaptive, args.window,
                                    Path(tmp) / f"{layout}-{name}", args.stretch)
                print(f"{layout} {name}: {time.time() - t0:.0f} s", flush=True)
            thr = {k: throughput(r, args.slow_at, args.steps) for k, r in reports.items()}
            tail = {k: tail_step(r, args.tail) for k, r in reports.items()}
            lost = thr["healthy"] - thr["slowed"]
            chosen = plans(reports["policy"])
            first = next((c for c in chosen if c.get("decided_at") is not None), None)
            slow_report = reports["slowed"]["stragglers"]
            rows.append({
                "layout": layout, "factor": args.factor, "slow_at": args.slow_at, "steps": args.steps,
                "stretch": args.stretch,
                "throughput": thr, "tail_step_seconds": tail,
                "recovered": (thr["policy"] - thr["slowed"]) / lost if lost > 0 else None,
                "recovered_tail": ((tail["slowed"] - tail["policy"]) / (tail["slowed"] - tail["healthy"])
                                   if tail["slowed"] > tail["healthy"] else None),
                "detected": slow_report.get("stragglers"),
                "speeds_slowed": {m: v["speed"] for m, v in (slow_report.get("members") or {}).items()},
                "decision_steps_after_slowdown": first["decided_at"] - args.slow_at if first else None,
                # the first switch: the step the new world trains after, counted from the last healthy step
                "switch_steps_after_slowdown": first["switched_at"] - args.slow_at if first else None,
                "plans": chosen,
                "exact": all([s["consumed_samples"] for s in r["steps"]]
                             == [GLOBAL_BATCH * k for k in range(1, args.steps + 1)] for r in reports.values()),
            })
        t0 = time.time()
        healthy = run(str(model), LAYOUTS[0], args.healthy_steps, "", True, 8, Path(tmp) / "healthy-long")
        long_run = {"layout": LAYOUTS[0], "steps": args.healthy_steps, "window": 8,
                    "switches": len(healthy["adaptive"]), "stragglers": healthy["stragglers"].get("stragglers"),
                    "speeds": {m: v["speed"] for m, v in (healthy["stragglers"].get("members") or {}).items()},
                    "seconds": time.time() - t0}

    print()
    print("| layout | healthy | slowed | with policy | recovered (all / steady) | decided after | switched after | "
          "plans chosen: predicted / measured s/step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        t = r["throughput"]
        rec = "-" if r["recovered"] is None else f"{r['recovered']:.0%}"
        rec_tail = "-" if r["recovered_tail"] is None else f"{r['recovered_tail']:.0%}"
        chosen = "; ".join(
            f"{c['config'].split('ep=1,')[-1]} {c['predicted_after']:.3f} / "
            f"{c['measured_after']:.3f}" if c.get("measured_after") else f"{c['config']} {c.get('outcome')}"
            for c in r["plans"]) or "none"
        after = "-" if r["decision_steps_after_slowdown"] is None else f"{r['decision_steps_after_slowdown']} steps"
        switched = "-" if r["switch_steps_after_slowdown"] is None else f"{r['switch_steps_after_slowdown']} steps"
        print(f"| {r['layout']} | {t['healthy']:.1f} | {t['slowed']:.1f} | {t['policy']:.1f} | {rec} / {rec_tail} "
              f"| {after} | {switched} | {chosen} |")
    print(f"\nhealthy {long_run['steps']}-step run with the policy on: {long_run['switches']} switch(es), "
          f"stragglers {long_run['stragglers']}, speeds {long_run['speeds']}")
    out = {"model": "bench-llama-16", "global_batch": GLOBAL_BATCH, "seq_length": SEQ, "rows": rows,
           "healthy_run": long_run, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
