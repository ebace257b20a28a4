"""Fault table: a process killed at each phase of a live reconfiguration, and what the job did.

Every case is a ``run-local`` job (real coordinator and worker processes, gloo on CPU) with a
``kill=R@PHASE`` event before a join, and the planned run it must equal: the same events
without the fault (a joiner that dies: the run as if it never came; a member that dies: a
planned leave at that step). Per case the table gives the generations that followed (aborted,
committed), the time from the kill to training again (``recovery``: detection, the recovery's
plan, transfer and commit, and one step), and whether losses and the final state are bit for
bit those of the planned run.

    python bench/bench_faults.py [--model tiny-llama] [--out bench/results/faults.json]

A member killed while the control thread prepares (``prepare``) dies while its main thread is
still training: the step at which the world breaks depends on timing, so that case is checked
for complete, exact training (every step once, every sample once) but not against a planned run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name, events, workers, initial parallel config, the planned run's events (None: no reference)
CASES = (
    ("joiner @ prepare", "2:kill=+1@prepare 3:join=1", 1, "tp=1,pp=1,dp=1", ""),
    ("joiner @ transfer", "2:kill=+1@transfer 3:join=1", 1, "tp=1,pp=1,dp=1", ""),
    ("joiner @ commit", "2:kill=+1@commit 3:join=1", 1, "tp=1,pp=1,dp=1", ""),
    ("joiner @ built", "2:kill=+1@built 3:join=1", 1, "tp=1,pp=1,dp=1", ""),
    ("joiner @ committed", "2:kill=+1@committed 3:join=1", 1, "tp=1,pp=1,dp=1", ""),
    ("member @ prepare", "2:kill=1@prepare 3:join=1", 2, "tp=1,pp=1,dp=2", None),
    ("member @ transfer", "2:kill=1@transfer 3:join=1", 2, "tp=1,pp=1,dp=2", "3:leave=1"),
    ("member @ commit", "2:kill=1@commit 3:join=1", 2, "tp=1,pp=1,dp=2", "3:leave=1"),
    ("member @ built", "2:kill=1@built 3:join=1", 2, "tp=1,pp=1,dp=2", "3:leave=1"),
    ("member @ committed", "2:kill=1@committed 3:join=1", 2, "tp=1,pp=1,dp=2", ""),
    ("no copy @ commit (tp=2)", "2:kill=1@commit 3:join=1", 2, "tp=2,pp=1,dp=1", None),
)
STEPS = 6
GLOBAL_BATCH = 4


def run(model: str, events: str, workers: int, parallel: str, workdir: Path) -> dict:
    from liveshard.dev.localrun.driver import RunSpec, run_local
    from liveshard.dev.localrun.events import parse_events

    return run_local(RunSpec.mock(model, workers=workers, parallel=parallel, steps=STEPS, global_batch=GLOBAL_BATCH,
                                  events=parse_events(events), workdir=str(workdir), heartbeat_timeout=2.0,
                                  collective_timeout=10.0, checkpoint_every=1))


def exact(report: dict) -> bool:
    return ([s["step"] for s in report["steps"]] == list(range(1, STEPS + 1))
            and [s["consumed_samples"] for s in report["steps"]] == [GLOBAL_BATCH * k for k in range(1, STEPS + 1)])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--out", default=str(HERE / "results" / "faults.json"))
    p.add_argument("--only", help="run only the cases whose name contains this")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-faults-"))
    references: dict[tuple, dict] = {}
    rows = []
    for i, (name, events, workers, parallel, planned) in enumerate(CASES):
        if args.only and args.only not in name:
            continue
        t0 = time.time()
        try:
            report = run(args.model, events, workers, parallel, root / f"case{i}")
        except Exception as e:  # a case that does not recover is a row, not the end of the table
            rows.append({"case": name, "events": events, "outcome": f"FAILED: {e}", "wall_seconds": time.time() - t0})
            print(f"{name:26s} FAILED: {e}", flush=True)
            continue
        fault = report["faults"][0]
        same = None
        if planned is not None:
            key = (planned, workers, parallel)
            if key not in references:
                references[key] = run(args.model, planned, workers, parallel, root / f"planned{len(references)}")
            ref = references[key]
            same = (report["checksums"] == ref["checksums"] and bool(report["checksums"])
                    and [s["loss"] for s in report["steps"]] == [s["loss"] for s in ref["steps"]])
        row = {"case": name, "events": events, "parallel": parallel, "planned": planned,
               "generations": fault["generations"], "recovery_seconds": round(fault["recovery_seconds"], 2),
               "exact_training": exact(report), "equals_planned": same,
               "world_sizes": [s["world_size"] for s in report["steps"]], "wall_seconds": round(time.time() - t0, 1)}
        rows.append(row)
        outcome = " -> ".join(g["outcome"].split(":")[0] for g in fault["generations"])
        print(f"{name:26s} {outcome:32s} recovery {row['recovery_seconds']:5.1f} s  exact {row['exact_training']}  "
              f"equals planned {same}", flush=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "steps": STEPS, "global_batch": GLOBAL_BATCH,
                                          "heartbeat_timeout": 2.0, "collective_timeout": 10.0, "cases": rows},
                                         indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if all("FAILED" not in str(r.get("outcome", "")) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
