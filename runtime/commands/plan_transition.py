"""``liveshard plan-transition``: plan moving training state from one layout to another."""

from __future__ import annotations

import argparse
import json
import time

from liveshard.runtime.commands.transition_args import add_transition_args, as_flags, resolve


def configure(p: argparse.ArgumentParser) -> None:
    add_transition_args(p)
    p.add_argument("--intra-gbps", type=float, default=450.0, help="intra-node GB/s per GPU (default 450)")
    p.add_argument("--inter-gbps", type=float, default=50.0, help="inter-node GB/s per GPU (default 50)")
    p.add_argument("--dump", metavar="FILE", help="write the full plan (copies, rounds) as JSON")


def run(args: argparse.Namespace) -> int:
    from liveshard.runtime.vps.bound import modeled_seconds
    from liveshard.runtime.vps.schedule import schedule
    from liveshard.runtime.vps.transition import plan_transition

    spec, old, new, devices, budget = resolve(args)
    t0 = time.perf_counter()
    with as_flags():
        plan = plan_transition(spec, old, new, devices)
        checksum = plan.checksum
        plan_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        sched = schedule(plan, budget)
    schedule_seconds = time.perf_counter() - t1
    model = modeled_seconds(plan, sched, args.intra_gbps, args.inter_gbps)
    report = summary(plan, sched, model, plan_seconds, schedule_seconds, checksum)
    if args.dump:
        dump(plan, sched, report, args.dump)
    if args.json:
        print(json.dumps(report))
    else:
        print_text(report)
    return 0


def summary(plan, sched, model: dict, plan_seconds: float, schedule_seconds: float, checksum: str) -> dict:
    send, recv = plan.link_bytes
    nodes = plan.devices.nodes
    intra = sum(c.nbytes for c in plan.network_copies if nodes[c.src] == nodes[c.dst])
    lb = plan.lower_bound
    bottleneck = plan.bottleneck_bytes
    return {
        "model": plan.spec.name,
        "from": str(plan.old_cfg),
        "to": str(plan.new_cfg),
        "devices": plan.devices.describe(),
        "plan_seconds": plan_seconds,
        "schedule_seconds": schedule_seconds,
        "transfers": len(plan.network_copies),
        "local_copies": len(plan.copies) - len(plan.network_copies),
        "bytes_moved": plan.bytes_moved,
        "intra_node_bytes": intra,
        "inter_node_bytes": plan.bytes_moved - intra,
        "local_copy_bytes": plan.local_copy_bytes,
        "state_bytes": plan.new_layout.state_bytes(),
        "bottleneck_bytes": bottleneck,
        "lower_bound_bytes": lb["lower_bound_bytes"],
        "receive_bound_bytes": lb["receive_bound_bytes"],
        "send_bound_bytes": lb["send_bound_bytes"],
        "bottleneck_over_bound": bottleneck / lb["lower_bound_bytes"] if lb["lower_bound_bytes"] else 1.0,
        "max_send_bytes": max(send, default=0),
        "max_receive_bytes": max(recv, default=0),
        "rounds": sched.rounds,
        "budget_bytes": sched.budget,
        "peak_staging_bytes": sched.peak_staging_bytes,
        "chunks": len(sched.chunks),
        **model,
        "rank_to_device": list(plan.rank_to_device),
        "standbys": list(plan.standbys),
        "checksum": checksum,
    }


def print_text(r: dict) -> None:
    gb = 1e9
    dm = r["devices"]
    print(f"model {r['model']}: {r['from']} -> {r['to']}")
    print(f"devices: {dm['old_world']} old, leaving {_ranges(dm['leaving']) or '-'}, dead {_ranges(dm['dead']) or '-'}, "
          f"joining {dm['joining']}, {dm['gpus_per_node']} per node; standbys {_ranges(r['standbys']) or '-'}")
    moved_ranks = [f"{rk}->{d}" for rk, d in enumerate(r["rank_to_device"]) if rk != d]
    print(f"rank -> device: {len(r['rank_to_device']) - len(moved_ranks)} ranks on their own device"
          + (f"; others: {', '.join(moved_ranks[:16])}{' ...' if len(moved_ranks) > 16 else ''}" if moved_ranks else ""))
    print(f"plan {r['plan_seconds']:.3f} s, schedule {r['schedule_seconds']:.3f} s, checksum {r['checksum'][:16]}")
    print(f"transfers {r['transfers']} ({r['bytes_moved'] / gb:.3f} GB: {r['intra_node_bytes'] / gb:.3f} intra-node, "
          f"{r['inter_node_bytes'] / gb:.3f} inter-node); local copies {r['local_copies']} "
          f"({r['local_copy_bytes'] / gb:.3f} GB); state {r['state_bytes'] / gb:.3f} GB")
    print(f"bottleneck {r['bottleneck_bytes'] / gb:.3f} GB vs lower bound {r['lower_bound_bytes'] / gb:.3f} GB "
          f"(ratio {r['bottleneck_over_bound']:.3f})")
    print(f"rounds {r['rounds']} under a {r['budget_bytes'] / 2**20:.0f} MiB budget, peak staging "
          f"{r['peak_staging_bytes'] / 2**20:.1f} MiB")
    print(f"modeled time {r['modeled_seconds']:.3f} s ({r['intra_node_gbps']:.0f} GB/s intra-node, "
          f"{r['inter_node_gbps']:.0f} GB/s inter-node, {r['round_latency_s'] * 1e6:.0f} us per round)")


def _ranges(ids: list[int]) -> str:
    out, i = [], 0
    ids = sorted(ids)
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def dump(plan, sched, report: dict, path: str) -> None:
    copies = [{"src": c.src, "dst": c.dst, "key": c.key, "states": list(plan.groups[c.group].states),
               "offset": list(c.offset), "shape": list(c.shape), "src_tensor": c.src_view[0],
               "dst_tensor": c.dst_view[0], "bytes": c.nbytes} for c in plan.copies]
    chunks = [{"copy": ch.copy, "round": ch.round, "offset": list(ch.offset), "shape": list(ch.shape),
               "bytes": ch.nbytes} for ch in sched.chunks]
    objects = [m._asdict() for m in plan.objects]
    with open(path, "w") as f:
        json.dump({**report, "copies": copies, "chunks": chunks, "objects": objects}, f)
