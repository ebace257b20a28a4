"""``liveshard reshard-local``: run a transition for real on local gloo processes and check it."""

from __future__ import annotations

import argparse
import json
import sys

from liveshard.runtime.commands.transition_args import add_transition_args, as_flags, resolve
from liveshard.runtime.errors import ConfigError


def configure(p: argparse.ArgumentParser) -> None:
    from liveshard.runtime.cli import add_preallocate, alias

    add_transition_args(p)
    p.add_argument("--procs", type=int, required=True, help="processes to spawn: old world + joiners")
    p.add_argument("--collective", dest="mode", choices=("p2p", "a2a"), default="p2p",
                   help="one batched P2P group per round (default) or one all-to-all per round")
    alias(p, "--collective", "--mode")  # --mode: run-local's live|checkpoint
    p.add_argument("--verify", action="store_true",
                   help="checksum every piece at both ends, and check every new shard bit for bit "
                        "against the reference; exit 0 only if all match")
    p.add_argument("--repeat", type=int, default=1, help="run the transfer this many times (timing)")
    add_preallocate(p, None, "who allocates and touches its new tensors before each timed transfer, as a live "
                             "job does while it still trains (timed apart: prepare_seconds): joiners, all "
                             "members, or auto (all: gloo runs on the CPU); default: nobody")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the run is abandoned")


def run(args: argparse.Namespace) -> int:
    spec, old, new, devices, budget = resolve(args)
    if args.dead:
        raise ConfigError("--dead", "reshard-local runs every old device", "use --leave")
    if args.procs != devices.num_devices:
        raise ConfigError("--procs", f"{args.procs} processes for {devices.old_world} old devices + "
                                     f"{devices.joining} joining", f"use --procs {devices.num_devices}")
    from liveshard.dev.reshard.harness import LocalJob
    from liveshard.dev.reshard.launch import run_local
    from liveshard.runtime.vps.schedule import schedule

    job = LocalJob(spec, str(old), str(new), args.leave, args.join, args.gpus_per_node, budget, args.mode,
                   verify=args.verify, check=args.verify, repeat=max(1, args.repeat),
                   preallocate=args.preallocate)
    with as_flags():
        plan = job.plan()
        schedule(plan, budget)  # fail here, before spawning, on a bad budget
    results = run_local(job, args.procs, timeout_s=args.timeout)
    report = _report(plan, job, results)
    if args.json:
        print(json.dumps(report))
    else:
        _print(report)
    sys.stdout.flush()
    return 0 if report["ok"] else 1


def _report(plan, job, results: list[dict]) -> dict:
    errors = {r["rank"]: r["error"] for r in results if r["error"]}
    if errors:
        return {"model": plan.spec.name, "from": str(plan.old_cfg), "to": str(plan.new_cfg), "ok": False,
                "procs": len(results), "checksum": plan.checksum, "verified": job.verify,
                "transfer_error": sorted(set(errors.values())),
                "old_intact": not any(r["old_mismatches"] for r in results)}
    seconds = [max(r["seconds"][i] for r in results) for i in range(len(results[0]["seconds"]))]
    stats = [r["stats"] for r in results]
    mismatches = {r["rank"]: r["mismatches"] for r in results if r["mismatches"]}
    old_changed = {r["rank"]: r["old_mismatches"] for r in results if r["old_mismatches"]}
    objects = {r["rank"]: r["object_errors"] for r in results if r["object_errors"]}
    best = min(seconds)
    sent = [s["bytes_sent"] for s in stats]
    recv = [s["bytes_received"] for s in stats]
    bottleneck = max(max(sent), max(recv))
    return {
        "model": plan.spec.name, "from": str(plan.old_cfg), "to": str(plan.new_cfg),
        "procs": len(results), "mode": job.mode, "budget_bytes": job.budget,
        "seconds": seconds, "best_seconds": best,
        "prepare_seconds": [max(r["prepare_seconds"][i] for r in results)
                            for i in range(len(results[0]["prepare_seconds"]))],
        "bytes_moved": sum(sent), "bottleneck_bytes": bottleneck,
        "bottleneck_gbps": bottleneck / best / 1e9 if best else 0.0,
        "local_bytes": sum(s["local_bytes"] for s in stats),
        "aliased_bytes": sum(s["aliased_bytes"] for s in stats),
        "peak_staging_bytes": max(s["peak_staging_bytes"] for s in stats),
        "peak_extra_bytes": max(s["peak_extra_bytes"] for s in stats),
        "rounds": len(stats[0]["round_seconds"]),
        "rank_to_device": list(plan.rank_to_device),
        "checksum": plan.checksum,
        "verified": job.verify,
        "mismatched_regions": sum(len(v) for v in mismatches.values()),
        "ok": not mismatches and not old_changed and not objects,
        "errors": {"new": {k: v[:5] for k, v in mismatches.items()},
                   "old_changed": {k: v[:5] for k, v in old_changed.items()},
                   "objects": objects},
    }


def _print(r: dict) -> None:
    if "transfer_error" in r:
        print(f"model {r['model']}: {r['from']} -> {r['to']}: transfer FAILED ({'; '.join(r['transfer_error'])}); "
              f"old shards {'intact' if r['old_intact'] else 'CHANGED'}")
        return
    print(f"model {r['model']}: {r['from']} -> {r['to']} on {r['procs']} gloo processes ({r['mode']})")
    print(f"rank -> device {r['rank_to_device']}, checksum {r['checksum'][:16]}")
    print(f"moved {r['bytes_moved'] / 1e6:.2f} MB in {r['rounds']} rounds, local {r['local_bytes'] / 1e6:.2f} MB, "
          f"kept in place {r['aliased_bytes'] / 1e6:.2f} MB")
    if r["prepare_seconds"]:
        print(f"prepare (new tensors allocated and touched ahead) {', '.join(f'{s:.3f}' for s in r['prepare_seconds'])} s")
    print(f"time {', '.join(f'{s:.3f}' for s in r['seconds'])} s; busiest device "
          f"{r['bottleneck_bytes'] / 1e6:.2f} MB at {r['bottleneck_gbps']:.3f} GB/s")
    print(f"peak staging {r['peak_staging_bytes']} bytes (budget {r['budget_bytes']}), "
          f"peak extra {r['peak_extra_bytes']} bytes")
    if r["verified"]:
        if r["ok"]:
            print("verify: every new shard matches the reference bit for bit; old shards untouched")
        else:
            print(f"verify: FAILED: {json.dumps(r['errors'])[:2000]}")
