"""Member loss mid-step: is any survivor left hanging, and how long until the survivors train again?

Every run is a ``run-local`` job (real coordinator and worker processes, gloo on CPU) in which
the last rank of the world is SIGKILLed half a second into the step after step 2
(``RunSpec.kill_delay``), while its peers are in that step's collectives (the pipeline's
sends and receives, the gradient all-reduce). The last rank is in the last pipeline stage: with
pp > 1 the first stages wait on a survivor whose own receive failed, the case gloo never
releases by itself. The collective timeout is set far above the hang threshold, so a survivor
that only a timeout would release counts as a hang; none is allowed.

Per case (world size, parallel config) the table gives the runs, the hangs (a run that did not
recover within ``--hang-after`` seconds, or failed), the recovery seconds (from the SIGKILL to
the survivors' new world ready: detection, the cut, the recovery's plan, transfer or checkpoint
load, and commit; median and max), and how many survivors were blocked
until their world was cut off (their collective failed only when the control thread shut the
world's connections down: ``agent.cutoff``).

    python bench/bench_member_loss.py [--runs 3] [--worlds 3,4,6] [--json bench/results/member_loss.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name, workers, initial parallel config, safety checkpoints every step (state with no other copy)
CASES = (
    ("dp=3", 3, "tp=1,pp=1,dp=3", 0),
    ("pp=3", 3, "tp=1,pp=3,dp=1,layers=2+1+1", 1),
    ("dp=4", 4, "tp=1,pp=1,dp=4", 0),
    ("tp=2,dp=2", 4, "tp=2,pp=1,dp=2", 0),
    ("pp=2,dp=2", 4, "tp=1,pp=2,dp=2", 0),
    ("dp=6", 6, "tp=1,pp=1,dp=6", 0),
    ("tp=2,dp=3", 6, "tp=2,pp=1,dp=3", 0),
    ("pp=2,dp=3", 6, "tp=1,pp=2,dp=3", 0),
)
STEPS = 5
KILL_AT = 2  # the victim dies during the step after this one
GLOBAL_BATCH = 12  # whole micro-batches on every data-parallel size up to 6 but 5
HEARTBEAT_TIMEOUT = 2.0


def run_once(model: str, workers: int, parallel: str, checkpoint_every: int, workdir: Path,
             collective_timeout: float) -> dict:
    from liveshard.dev.localrun.driver import RunSpec, run_local
    from liveshard.dev.localrun.events import parse_events

    return run_local(RunSpec.mock(model, workers=workers, parallel=parallel, steps=STEPS, global_batch=GLOBAL_BATCH,
                                  events=parse_events(f"{KILL_AT}:kill={workers - 1}"), workdir=str(workdir),
                                  heartbeat_timeout=HEARTBEAT_TIMEOUT, collective_timeout=collective_timeout,
                                  checkpoint_every=checkpoint_every, kill_delay=0.5, stretch=_stretch(parallel)))


def _stretch(parallel: str) -> float:
    """Devices emulated 4x slower (steps long enough for the kill to land mid-step), except with
    tensor parallelism: its all-reduces lie inside the compute a ``Slowdown`` stretches, so each
    rank's sleep would include its wait for the other's sleep and the step would grow without bound."""
    from liveshard.runtime.parallel import ParallelConfig

    return 4.0 if ParallelConfig.parse(parallel).tp == 1 else 1.0


def survivors(report: dict, victim: str) -> list[dict]:
    """Per survivor of the old world: when its world was cut off and when its collective failed."""
    out = []
    for f in Path(report["workdir"]).glob("*.json"):
        data = json.loads(f.read_text())
        if not isinstance(data, dict) or "id" not in data or data["id"] == victim:
            continue
        events = data.get("events", [])
        cut = next((e for e in events if e["kind"] == "cut-off" and e["generation"] == 0), None)
        broken = next((e for e in events if e["kind"] == "broken"), None)
        out.append({"id": data["id"], "cut": cut is not None, "broken": broken is not None,
                    # its collective failed within 50 ms after its own cut: the cut released it
                    "released_by_cut": bool(cut and broken and 0 <= broken["time"] - cut["time"] < 0.05)})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--runs", type=int, default=1, help="runs per case")
    p.add_argument("--worlds", default="3,4,6", help="world sizes to run (comma-separated)")
    p.add_argument("--only", help="run only the cases whose name contains this")
    p.add_argument("--hang-after", type=float, default=60.0,
                   help="a run whose survivors are not training again this many seconds after the kill hangs")
    p.add_argument("--json", default=str(HERE / "results" / "member_loss.json"), help="write the results here")
    args = p.parse_args()
    worlds = {int(w) for w in args.worlds.split(",") if w.strip()}
    # far above the hang threshold: only a cut releases a blocked survivor in time
    collective_timeout = 5 * args.hang_after
    root = Path(tempfile.mkdtemp(prefix="bench-member-loss-"))
    rows = []
    print(f"{'case':12s} {'world':>5s} {'runs':>4s} {'hangs':>5s} {'recovery s (median / max)':>26s} "
          f"{'blocked until cut':>18s}", flush=True)
    for i, (name, workers, parallel, checkpoint_every) in enumerate(CASES):
        if workers not in worlds or (args.only and args.only not in name):
            continue
        runs = []
        for k in range(args.runs):
            t0 = time.time()
            entry: dict = {"run": k}
            try:
                report = run_once(args.model, workers, parallel, checkpoint_every, root / f"case{i}-{k}",
                                  collective_timeout)
                kill = report["events"][0]
                recovery = kill.get("recovery")
                entry.update(outcome=kill["outcome"], recovery_seconds=recovery, downtime=kill["downtime"],
                             config_after=kill["config"], survivors=survivors(report, f"w{workers - 1}"),
                             steps=[s["step"] for s in report["steps"]])
                entry["hang"] = (recovery is None or recovery > args.hang_after
                                 or entry["steps"] != list(range(1, STEPS + 1)))
            except Exception as e:  # a run that does not recover is a row, not the end of the table
                entry.update(outcome=f"FAILED: {type(e).__name__}: {e}"[:300], hang=True)
            entry["wall_seconds"] = round(time.time() - t0, 1)
            runs.append(entry)
        recoveries = [r["recovery_seconds"] for r in runs if not r["hang"]]
        blocked = sum(s["released_by_cut"] for r in runs for s in r.get("survivors", []))
        total = sum(len(r.get("survivors", [])) for r in runs)
        row = {"case": name, "workers": workers, "parallel": parallel, "checkpoint_every": checkpoint_every,
               "runs": len(runs), "hangs": sum(r["hang"] for r in runs),
               "recovery_median": round(statistics.median(recoveries), 2) if recoveries else None,
               "recovery_max": round(max(recoveries), 2) if recoveries else None,
               "blocked_until_cut": blocked, "survivors": total, "detail": runs}
        rows.append(row)
        rec = (f"{row['recovery_median']:.1f} / {row['recovery_max']:.1f}" if recoveries else "-")
        print(f"{name:12s} {workers:5d} {len(runs):4d} {row['hangs']:5d} {rec:>26s} {blocked:>10d} of {total:<5d}",
              flush=True)
    out = {"model": args.model, "steps": STEPS, "kill_at": KILL_AT, "global_batch": GLOBAL_BATCH,
           "heartbeat_timeout": HEARTBEAT_TIMEOUT, "collective_timeout": collective_timeout,
           "hang_after": args.hang_after, "cases": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0 if all(r["hangs"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
