"""``liveshard plan-transition``: plan moving training state from one layout to another.

With ``--device D`` only device D's part is planned (``vps.device_plan``): its local copies,
sends, receives and rounds, equal to D's slice of the whole plan. The rank -> device order is
the one input that needs both whole layouts (``transition.rank_order``): give it with
``--rank-to-device`` (a running job has it from its world plan), or it is computed first and
timed on its own (``mapping_seconds``).
"""

from __future__ import annotations

import argparse
import json
import time

from liveshard.runtime.commands.transition_args import add_transition_args, as_flags, parse_order, resolve


def configure(p: argparse.ArgumentParser) -> None:
    add_transition_args(p)
    p.add_argument("--intra-gbps", type=float, default=450.0, help="intra-node GB/s per GPU (default 450)")
    p.add_argument("--inter-gbps", type=float, default=50.0, help="inter-node GB/s per GPU (default 50)")
    p.add_argument("--dump", metavar="FILE", help="write the full plan (copies, rounds) as JSON")
    p.add_argument("--device", type=int, metavar="D",
                   help="plan only device D's part: its copies, sends, receives and rounds")
    p.add_argument("--rank-to-device", metavar="LIST",
                   help="device of each new rank in rank order, e.g. 8-15,0-7 (default: the planner's choice)")


def run(args: argparse.Namespace) -> int:
    from liveshard.runtime.vps.bound import modeled_seconds
    from liveshard.runtime.vps.schedule import schedule
    from liveshard.runtime.vps.transition import plan_transition

    spec, old, new, devices, budget = resolve(args)
    order = parse_order(args.rank_to_device) if args.rank_to_device else None
    if args.device is not None:
        return run_device(args, spec, old, new, devices, budget, order)
    t0 = time.perf_counter()
    with as_flags():
        plan = plan_transition(spec, old, new, devices, order)
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


def run_device(args: argparse.Namespace, spec, old, new, devices, budget: int, order) -> int:
    """``--device D``: D's part of the plan and its rounds."""
    from liveshard.runtime.vps.device_plan import plan_device
    from liveshard.runtime.vps.schedule import schedule
    from liveshard.runtime.vps.transition import rank_order

    with as_flags():
        t0 = time.perf_counter()
        if order is None:
            order = rank_order(spec, old, new, devices)
        mapping_seconds = time.perf_counter() - t0 if args.rank_to_device is None else 0.0
        t1 = time.perf_counter()
        plan = plan_device(spec, old, new, devices, order, args.device)
        plan_seconds = time.perf_counter() - t1
        t2 = time.perf_counter()
        sched = schedule(plan, budget)
    schedule_seconds = time.perf_counter() - t2
    report = device_report(plan, sched, plan_seconds, schedule_seconds, mapping_seconds)
    if args.json:
        print(json.dumps(report))
    else:
        print_device_text(report)
    return 0


def device_report(plan, sched, plan_seconds: float, schedule_seconds: float, mapping_seconds: float) -> dict:
    """Device ``plan.device``'s copies with their chunks (round, offset, shape, bytes) and rounds."""
    d = plan.device
    chunks: dict[int, list[dict]] = {}
    for ch in sched.chunks:
        chunks.setdefault(ch.copy, []).append({"round": ch.round, "offset": list(ch.offset),
                                               "shape": list(ch.shape), "bytes": ch.nbytes})

    def row(i: int, c, peer: int) -> dict:
        return {"peer": peer, "key": c.key, "states": list(plan.groups[c.group].states),
                "offset": list(c.offset), "shape": list(c.shape), "src_tensor": c.src_view[0],
                "dst_tensor": c.dst_view[0], "bytes": c.nbytes, "chunks": chunks.get(i, [])}

    order = sorted(range(len(plan.copies)), key=lambda i: plan.copies[i])
    sends = [row(i, plan.copies[i], plan.copies[i].dst) for i in order
             if plan.copies[i].src == d and plan.copies[i].dst != d]
    receives = [row(i, plan.copies[i], plan.copies[i].src) for i in order
                if plan.copies[i].dst == d and plan.copies[i].src != d]
    local = [plan.copies[i] for i in order if plan.copies[i].src == d == plan.copies[i].dst]
    rounds: list[dict] = [{"round": r, "send": {}, "receive": {}} for r in range(sched.rounds)]
    staged = [0] * sched.rounds
    for ch in sched.chunks:
        c = plan.copies[ch.copy]
        side, peer = ("send", c.dst) if c.src == d else ("receive", c.src)
        per = rounds[ch.round][side]
        per[str(peer)] = per.get(str(peer), 0) + ch.nbytes
        staged[ch.round] += ch.staging
    for r, st in zip(rounds, staged):
        r["staging_bytes"] = st
    return {
        "model": plan.spec.name,
        "from": str(plan.old_cfg),
        "to": str(plan.new_cfg),
        "devices": plan.devices.describe(),
        "device": d,
        "new_rank": plan.device_to_rank.get(d),
        "plan_seconds": plan_seconds,
        "schedule_seconds": schedule_seconds,
        "mapping_seconds": mapping_seconds,
        "inputs_digest": plan.digest,
        "rank_to_device": list(plan.rank_to_device),
        "local_copies": len(local),
        "local_copy_bytes": sum(c.nbytes for c in local),
        "bytes_sent": sum(s["bytes"] for s in sends),
        "bytes_received": sum(s["bytes"] for s in receives),
        "peers": sorted({s["peer"] for s in sends} | {s["peer"] for s in receives}),
        "rounds": len(rounds),
        "budget_bytes": sched.budget,
        "peak_staging_bytes": max(staged, default=0),
        "sends": sends,
        "receives": receives,
        "round_bytes": rounds,
        "objects": [m._asdict() for m in plan.objects],
    }


def print_device_text(r: dict) -> None:
    gb = 1e9
    print(f"model {r['model']}: {r['from']} -> {r['to']}")
    rank = "no new rank" if r["new_rank"] is None else f"new rank {r['new_rank']}"
    print(f"device {r['device']} ({rank}): plan {r['plan_seconds']:.3f} s, schedule {r['schedule_seconds']:.3f} s"
          + (f", rank order {r['mapping_seconds']:.3f} s" if r["mapping_seconds"] else "")
          + f", inputs digest {r['inputs_digest'][:16]}")
    print(f"sends {len(r['sends'])} copies ({r['bytes_sent'] / gb:.3f} GB), receives {len(r['receives'])} "
          f"({r['bytes_received'] / gb:.3f} GB), local copies {r['local_copies']} "
          f"({r['local_copy_bytes'] / gb:.3f} GB); peers {_ranges(r['peers']) or '-'}")
    print(f"rounds {r['rounds']} under a {r['budget_bytes'] / 2**20:.0f} MiB budget, peak staging "
          f"{r['peak_staging_bytes'] / 2**20:.1f} MiB")
