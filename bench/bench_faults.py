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

A second table covers the ends of a run (``dev.localrun.end_faults``) and damaged files: the
final checkpoint on a full disk (a tmpfs in a user and mount namespace of its own; skipped where
``unshare`` cannot make one) going to the fallback directory, waiting for space, or failing the
job with one line; a member killed during the final save or while the first world starts; a
byte flipped in a saved shard (found by ``verify``); and a ``.metadata`` that runs a command when
unpickled, handed to ``liveshard convert`` (refused with one line; the command never runs).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
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

# the ends of a run: name, end_faults arguments, tmpfs size for the checkpoint directory (None: none)
END_CASES = (
    ("final save: disk full -> fallback", ["--fallback", "{tmp}/fallback", "--patience", "60"], "2m"),
    ("final save: disk full -> waits for space", ["--patience", "120", "--grow-tmpfs", "64m"], "512k"),
    ("final save: disk full, nowhere to go", ["--patience", "3"], "2m"),
    ("member @ final-save (dp=3)", ["--workers", "3", "--parallel", "tp=1,pp=1,dp=3", "--kill", "2@final-save",
                                    "--collective-timeout", "300"], None),
    ("member @ final-save (pp=3, restore)", ["--workers", "3", "--parallel", "tp=1,pp=3,dp=1,layers=2+1+1",
                                             "--kill", "2@final-save", "--checkpoint-every", "1",
                                             "--collective-timeout", "300"], None),
    ("member @ first world's start", ["--workers", "3", "--parallel", "tp=1,pp=1,dp=3", "--kill", "2@start"], None),
)
END_STEPS = 3
END_GLOBAL_BATCH = 6


def run(model: str, events: str, workers: int, parallel: str, workdir: Path) -> dict:
    from liveshard.dev.localrun.driver import RunSpec, run_local
    from liveshard.dev.localrun.events import parse_events

    return run_local(RunSpec.mock(model, workers=workers, parallel=parallel, steps=STEPS, global_batch=GLOBAL_BATCH,
                                  events=parse_events(events), workdir=str(workdir), heartbeat_timeout=2.0,
                                  collective_timeout=10.0, checkpoint_every=1))


def exact(report: dict) -> bool:
    return ([s["step"] for s in report["steps"]] == list(range(1, STEPS + 1))
            and [s["consumed_samples"] for s in report["steps"]] == [GLOBAL_BATCH * k for k in range(1, STEPS + 1)])


def namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True).returncode == 0


def run_end_case(model: str, args: list[str], tmpfs: str | None, tmp: Path) -> dict:
    """One end-of-run case through ``python -m liveshard.dev.localrun.end_faults`` (inside a user
    and mount namespace with the checkpoint directory on a tmpfs of ``tmpfs``, when given)."""
    workdir, out = tmp / "run", tmp / "end.json"
    (workdir / "checkpoints" / "periodic").mkdir(parents=True)
    command = [sys.executable, "-m", "liveshard.dev.localrun.end_faults", "--workdir", str(workdir), "--out", str(out),
               "--model", model, "--steps", str(END_STEPS), "--global-batch", str(END_GLOBAL_BATCH),
               *[a.replace("{tmp}", str(tmp)) for a in args]]
    if tmpfs is not None:
        mount = f"mount -t tmpfs -o size={tmpfs} tmpfs {workdir}/checkpoints/periodic && exec "
        command = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount + " ".join(command)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}")
    return json.loads(out.read_text())


def end_row(name: str, result: dict, wall: float) -> dict:
    status, report = result["status"], result["report"]
    failure = status.get("failure")
    steps = report.get("steps") or []
    exact_steps = ([x["step"] for x in steps] == list(range(1, END_STEPS + 1))
                   and [x["consumed_samples"] for x in steps] == [END_GLOBAL_BATCH * k for k in range(1, END_STEPS + 1)])
    generations = [h["outcome"].split(":")[0] for h in status.get("history") or [] if h.get("generation") is not None]
    return {"case": name, "outcome": f"failed: {failure['reason']}" if failure else
            ("finished" if status.get("finished") else "neither finished nor failed"),
            "message": failure.get("message") if failure else None,
            "final_checkpoint": report.get("final_checkpoint"), "verified": result.get("verify") is None,
            "exact_training": exact_steps, "generations": generations, "exit_codes": result.get("exit_codes"),
            "wall_seconds": round(wall, 1)}


class _RunsACommand:
    """Unpickling it runs a shell command that creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def damaged_file_rows(checkpoint: str, tmp: Path) -> list[dict]:
    """A copy of ``checkpoint`` with 4 KiB flipped in its largest file (``verify`` must name it),
    and one whose torch DCP ``.metadata`` runs a command when unpickled (``liveshard convert``
    must refuse it with one line, exit 2, and the command never run)."""
    from liveshard.runtime.agent.checkpoint import verify

    rows = []
    flipped = tmp / "flipped"
    shutil.copytree(checkpoint, flipped)
    largest = max((f for f in flipped.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    data = bytearray(largest.read_bytes())
    at = len(data) // 2
    data[at:at + 4096] = bytes(b ^ 0xFF for b in data[at:at + 4096])
    largest.write_bytes(bytes(data))
    problem = verify(flipped)
    rows.append({"case": "4 KiB flipped in a saved shard", "outcome": "found" if problem else "MISSED",
                 "message": problem, "file": largest.name})
    forged = tmp / "forged"
    shutil.copytree(checkpoint, forged)
    marker = tmp / "the-command-ran"
    for metadata in forged.rglob(".metadata"):
        metadata.write_bytes(pickle.dumps(_RunsACommand(str(marker))))
    done = subprocess.run([sys.executable, "-m", "liveshard.runtime.cli", "convert", "--from", str(forged), "--to",
                           f"hf:{tmp / 'hf'}"], capture_output=True, text=True, timeout=300)
    one_line = done.stderr.strip().count("\n") == 0
    ok = done.returncode == 2 and one_line and not marker.exists()
    rows.append({"case": "a .metadata that runs a command, to convert", "outcome": "refused" if ok else "NOT REFUSED",
                 "message": done.stderr.strip()[-300:], "exit_code": done.returncode, "command_ran": marker.exists()})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--out", default=str(HERE / "results" / "faults.json"))
    p.add_argument("--only", help="run only the cases whose name contains this")
    p.add_argument("--no-ends", action="store_true", help="leave out the ends of a run and the damaged files")
    p.add_argument("--ends-only", action="store_true", help="only the ends of a run and the damaged files")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-faults-"))
    references: dict[tuple, dict] = {}
    rows = []
    for i, (name, events, workers, parallel, planned) in enumerate(CASES):
        if args.ends_only or (args.only and args.only not in name):
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
    ends = [] if args.no_ends else end_rows(args, root)
    Path(args.out).write_text(json.dumps({"model": args.model, "steps": STEPS, "global_batch": GLOBAL_BATCH,
                                          "heartbeat_timeout": 2.0, "collective_timeout": 10.0, "cases": rows,
                                          "ends": ends}, indent=1) + "\n")
    print(f"wrote {args.out}")
    bad = [r for r in (*rows, *ends) if any(w in str(r.get("outcome", "")) for w in ("FAILED", "MISSED", "NOT ", "neither"))]
    return 0 if not bad else 1


# what each end case must end as (the job fails only where there is nowhere to save)
END_EXPECTED = {name: ("failed: FinalCheckpointFailed" if "nowhere" in name else "finished") for name, _, _ in END_CASES}


def end_rows(args: argparse.Namespace, root: Path) -> list[dict]:
    rows: list[dict] = []
    namespaces = namespaces_work()
    checkpoint = None
    print(f"\n{'end of a run':40s} {'outcome':32s} verified exact generations", flush=True)
    for i, (name, extra, tmpfs) in enumerate(END_CASES):
        if args.only and args.only not in name:
            continue
        if tmpfs is not None and not namespaces:
            rows.append({"case": name, "outcome": "skipped: no unprivileged user and mount namespaces here"})
            print(f"{name:40s} skipped (no namespaces)", flush=True)
            continue
        t0 = time.time()
        try:
            result = run_end_case(args.model, extra, tmpfs, root / f"end{i}")
        except Exception as e:
            rows.append({"case": name, "outcome": f"FAILED: {e}", "wall_seconds": round(time.time() - t0, 1)})
            print(f"{name:40s} FAILED: {e}", flush=True)
            continue
        row = end_row(name, result, time.time() - t0)
        if row["outcome"] != END_EXPECTED[name]:
            row["outcome"] = f"FAILED: {row['outcome']} (expected {END_EXPECTED[name]})"
        rows.append(row)
        if tmpfs is None and row["verified"] and row["final_checkpoint"] and checkpoint is None:
            checkpoint = row["final_checkpoint"]
        print(f"{name:40s} {row['outcome'][:32]:32s} {row['verified']!s:8s} {row['exact_training']!s:5s} "
              f"{' -> '.join(row['generations'])}", flush=True)
    if checkpoint is not None and not args.only:
        for row in damaged_file_rows(checkpoint, root / "damaged"):
            rows.append(row)
            print(f"{row['case']:40s} {row['outcome']:32s} {(row['message'] or '')[:80]}", flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
