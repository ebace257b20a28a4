"""``liveshard run-local``: a whole job on local processes through a list of world changes."""

from __future__ import annotations

import argparse
import json
import sys


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset name or YAML file")
    p.add_argument("--workers", type=int, required=True, help="workers at the start")
    p.add_argument("--parallel", required=True, help="the starting config, e.g. tp=2,pp=1,dp=2")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps in total")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--events", default="", help='e.g. "5:leave=1 10:join=1 15:kill=0 20:parallel=tp=2,pp=1,dp=1"')
    p.add_argument("--mode", choices=("live", "checkpoint"), default="live")
    p.add_argument("--checkpoint-every", type=int, default=0, help="periodic checkpoint interval (steps)")
    p.add_argument("--verify", action="store_true", help="checksum every transferred region")
    p.add_argument("--preallocate", choices=("auto", "all", "joiners"), default="auto",
                   help="which workers allocate their new tensors while training goes on (liveshard worker)")
    p.add_argument("--workdir", default=None, help="logs, checkpoints and per-worker results")
    p.add_argument("--out", default="run.json")
    p.add_argument("--quiet", action="store_true")


def run(args: argparse.Namespace) -> int:
    from liveshard.dev.localrun.driver import RunSpec, run_local
    from liveshard.dev.localrun.events import parse_events
    from liveshard.runtime.spec import load_model

    spec = load_model(args.model)
    events = parse_events(args.events)
    if any(e.step >= args.steps for e in events):
        from liveshard.runtime.errors import ConfigError

        raise ConfigError("--events", "every event must come before the last step", "raise --steps")
    report = run_local(RunSpec(
        model=args.model, spec=spec, workers=args.workers, parallel=args.parallel, steps=args.steps,
        global_batch=args.global_batch, events=events, mode=args.mode, seq_length=args.seq_length,
        micro_batch=args.micro_batch, lr=args.lr, verify=args.verify, preallocate=args.preallocate,
        checkpoint_every=args.checkpoint_every,
        workdir=args.workdir, log=None if args.quiet else sys.stderr))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    for e in report["events"]:
        dt = e.get("downtime")
        print(f"{e['event']:<28} {e['outcome']:<10} downtime {'-' if dt is None else f'{dt:.3f} s'}")
    last = report["steps"][-1] if report["steps"] else {}
    print(f"{len(report['steps'])} steps, final loss {last.get('loss')}, consumed {last.get('consumed_samples')}"
          f" samples; report: {args.out}")
    return 0
