"""Live reshard vs checkpoint round trips, on CPU, same processes, same run.

gpt-125m (124M parameters, fp32, Adam state: 1.5 GB of training state) on 4 and 8 gloo
processes. For each transition every process fills its old shards from the reference, then:

* raw gloo P2P bandwidth: every pair (0,1), (2,3), ... exchanges 256 MB both ways at once, into
  buffers allocated (and first touched) beforehand, best of 3; measured before and again after
  the live runs, and the higher of the two is the reference (a sample depressed by other load
  on the machine cannot inflate the ratio below); for context only, the same exchange receiving
  into newly allocated buffers ("into new memory");
* live reshard: the executor, P2P rounds and all-to-all rounds (``--repeat`` runs each). As the
  live runtime does while the job still trains, each run first allocates and touches the new
  tensors (``allocate_destinations``; timed apart as ``prepare_seconds``), then the executor
  fills them. "executor / P2P" is the busiest device's bytes (the larger of sent and received)
  over the executor's best wall time, divided by the raw P2P GB/s per direction. The executor's
  time still includes the local copies, packing and unpacking, staging buffers and the small
  objects, none of which the raw P2P figure pays. ``p2p_cold`` is the same P2P run with the
  executor allocating the new tensors itself, end to end (first touching fresh memory costs
  page faults: on the 2-core development VM about 0.25-0.3 CPU-s per GB), compared with warm
  P2P and with P2P that receives into new memory;
* megatron-core ``dist_checkpointing`` (torch_dist): save ShardedTensors of the old layout's
  regions (replicas marked by ``replica_id``; distributed-optimizer boxes as an irregular grid),
  then load ShardedTensors of the new layout's regions;
* torch DCP: the same boxes as torch ``ShardedTensor`` local shards, save then resharded load.

Every result (live and both checkpoint paths) is checked bit for bit against the reference.
Checkpoint times are warm: each process first saves and loads a tiny checkpoint (the one-off
start-up cost of the checkpoint machinery is reported separately as ``*_cold_seconds``).
Prints a table and writes ``bench/results/live_vs_checkpoint.json``.

    python bench/bench_live_vs_checkpoint.py [--procs 4 8] [--repeat 2] [--budget 256MiB]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

MODEL = "gpt-125m"
# (name, from, to, leave, gpus per node)
TRANSITIONS = {
    4: [("node loss (DP shrink)", "tp=1,pp=1,dp=4,dist_opt", "tp=1,pp=1,dp=3,dist_opt", "3", 1),
        ("full TP change (tp4 -> pp4)", "tp=4,pp=1,dp=1", "tp=1,pp=4,dp=1", "", 4)],
    8: [("node loss (DP shrink)", "tp=2,pp=1,dp=4,dist_opt", "tp=2,pp=1,dp=3,dist_opt", "6,7", 2),
        ("full TP change (tp4 -> pp4)", "tp=4,pp=1,dp=2", "tp=1,pp=4,dp=2", "", 8)],
}
P2P_BYTES = 256 * 2**20
# p2p / a2a: the new tensors allocated and touched beforehand (prepare, timed apart), as the live
# runtime does while training goes on; p2p_cold: the executor allocates them itself, end to end
LIVE_VARIANTS = ("p2p", "a2a", "p2p_cold")


def _barrier_time(fn):
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t0, out


def p2p_bandwidth(rank: int, world: int, nbytes: int, repeat: int = 3, *, fresh: bool = False) -> float:
    """GB/s per direction with every pair exchanging ``nbytes`` both ways at once (best of
    ``repeat``). ``fresh``: each exchange receives into a newly allocated buffer, so it pays the
    first touch of that memory as the executor does for the new shards; otherwise the receive
    buffer is allocated once and reused (the best repeat sees it warm)."""
    import torch
    import torch.distributed as dist

    peer = rank ^ 1
    send = torch.ones(nbytes, dtype=torch.uint8)
    recv = None if fresh else torch.empty(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeat):
        def go():
            if peer < world:
                into = torch.empty(nbytes, dtype=torch.uint8) if recv is None else recv
                ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, into, peer)]
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
        t, _ = _barrier_time(go)
        best = min(best, t)
    return nbytes / best / 1e9


def megatron_state_dict(layout, rank: int, store, *, loading: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from liveshard.runtime.transfer.storage import view_of

    sd = {}
    for i, reg in enumerate(layout.regions(rank)):
        data = view_of(store.get(reg.state, reg.local_name), (reg.local_name, reg.local_offset, reg.local_shape))
        key = reg.key if reg.state == "param" else f"optimizer.state.{reg.state}.{reg.key}"
        # Prepended (layer/expert) axes as size-1 dims of the box: megatron-core 0.16.1's irregular-
        # grid path (axis_fragmentations=None) pairs a full-rank offset with the unprepended shape.
        box = tuple(reg.box_shape)
        sd[f"{i}"] = ShardedTensor(key, data.view(box), data.dtype, box, tuple(reg.global_shape),
                                   tuple(reg.global_offset), None, 0 if (reg.primary or loading) else 1, 0)
    return sd


def _boxes_class():
    """A tensor stand-in holding a rank's boxes of one logical tensor for torch DCP, through
    torch's ``_Checkpointable`` protocol (torch's ShardedTensor insists the metadata tile the
    whole tensor, which replicas and irregular distributed-optimizer boxes do not)."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    class Boxes(torch.Tensor):
        @staticmethod
        def __new__(cls, boxes, global_shape):
            return torch.Tensor._make_wrapper_subclass(cls, torch.Size(global_shape), dtype=boxes[0][1].dtype)

        def __init__(self, boxes, global_shape):
            self._boxes = boxes  # [(global offset, tensor of the box's shape)]

        def __create_write_items__(self, fqn, obj):
            return [WriteItem(index=MetadataIndex(fqn, torch.Size(off), i), type=WriteItemType.SHARD,
                              tensor_data=TensorWriteData(
                                  chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.size()),
                                  properties=TensorProperties.create_from_tensor(t), size=self.size()))
                    for i, (off, t) in enumerate(self._boxes)]

        def __create_chunk_list__(self):
            return [ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.size()) for off, t in self._boxes]

        def __get_tensor_shard__(self, index):
            for off, t in self._boxes:
                if torch.Size(off) == index.offset:
                    return t
            raise ValueError(f"no box at {index.offset} for {index.fqn}")

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError(f"Boxes does not compute ({func})")

    return Boxes


def dcp_state_dict(layout, rank: int, store, *, loading: bool) -> dict:
    """One DCP entry per logical tensor: this rank's boxes of it (primaries only when saving)."""
    from liveshard.runtime.transfer.storage import view_of

    boxes_cls = _boxes_class()
    per_key: dict[str, list] = {}
    shapes: dict[str, tuple] = {}
    for reg in layout.regions(rank):
        if not (reg.primary or loading):  # a replica is written once, by its primary
            continue
        data = view_of(store.get(reg.state, reg.local_name), (reg.local_name, reg.local_offset, reg.local_shape))
        key = f"{reg.state}/{reg.key}"
        per_key.setdefault(key, []).append((tuple(reg.global_offset), data.view(tuple(reg.box_shape))))
        shapes[key] = tuple(reg.global_shape)
    return {key: boxes_cls(boxes, shapes[key]) for key, boxes in per_key.items()}


def bench_rank(rank: int, world: int, params: dict) -> dict:
    import torch
    import torch.distributed as dist

    from liveshard.runtime.megatron import compat

    compat.install()  # megatron's checkpoint writer calls torch.cuda.synchronize()
    torch.set_num_threads(1)
    from megatron.core import dist_checkpointing
    from torch.distributed import checkpoint as dcp

    from liveshard.dev.reshard.harness import reference_objects
    from liveshard.dev.reshard.reference import check_reference, fill_reference
    from liveshard.runtime.parallel import ParallelConfig
    from liveshard.runtime.spec import load_model
    from liveshard.runtime.transfer.executor import allocate_destinations, execute
    from liveshard.runtime.transfer.storage import LocalShards, allocate
    from liveshard.runtime.vps.devices import DeviceMap, parse_devices
    from liveshard.runtime.vps.schedule import schedule
    from liveshard.runtime.vps.transition import plan_transition

    spec = load_model(params["model"])
    old_cfg, new_cfg = ParallelConfig.parse(params["old"]), ParallelConfig.parse(params["new"])
    devices = DeviceMap(old_cfg.world_size, params["gpn"], parse_devices(params["leave"]), 0)
    t0 = time.perf_counter()
    plan = plan_transition(spec, old_cfg, new_cfg, devices)
    checksum = plan.checksum
    plan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    sched = schedule(plan, params["budget"])
    schedule_s = time.perf_counter() - t0
    old_layout, new_layout = plan.old_layout, plan.new_layout
    new_rank = plan.device_to_rank.get(rank)
    old = fill_reference(old_layout, rank)
    objects = reference_objects(rank)
    out: dict = {"rank": rank, "plan_seconds": plan_s, "schedule_seconds": schedule_s, "checksum": checksum,
                 "old_bytes": old.nbytes()}

    out["p2p_gbps"] = p2p_bandwidth(rank, world, P2P_BYTES)

    for variant in LIVE_VARIANTS:
        mode, prepared = variant.split("_")[0], not variant.endswith("_cold")
        times, prepare, stats, bad = [], [], None, None
        for _ in range(params["repeat"]):
            dest = None
            if prepared:  # a live job does this while it still trains
                t, dest = _barrier_time(lambda: allocate_destinations(plan, rank))
                prepare.append(t)
            t, res = _barrier_time(lambda mode=mode, dest=dest: execute(plan, sched, rank, old, objects, mode=mode,
                                                                         destinations=dest))
            times.append(t)
            stats = res.stats
            bad = check_reference(new_layout, new_rank, res.shards) if new_rank is not None else []
            del res, dest
        out[f"live_{variant}"] = {"seconds": times, "prepare_seconds": prepare, "bytes_sent": stats.bytes_sent,
                               "bytes_received": stats.bytes_received, "peak_staging_bytes": stats.peak_staging_bytes,
                               "aliased_bytes": stats.aliased_bytes, "local_bytes": stats.local_bytes,
                               "local_seconds": stats.local_seconds, "rounds_seconds": stats.rounds_seconds,
                               "rounds": len(stats.round_seconds), "mismatches": len(bad),
                               "peak_extra_bytes": stats.peak_extra_bytes,
                               "max_rounds_in_flight": stats.max_rounds_in_flight}
    out["p2p_gbps_after"] = p2p_bandwidth(rank, world, P2P_BYTES)
    out["p2p_fresh_gbps"] = p2p_bandwidth(rank, world, P2P_BYTES, fresh=True)

    root = params["dir"]
    target = allocate(new_layout, new_rank) if new_rank is not None else LocalShards()
    for name, save, load, make in (
        ("megatron", lambda sd, d: dist_checkpointing.save(sd, d),
         lambda sd, d: dist_checkpointing.load(sd, d), megatron_state_dict),
        ("dcp", lambda sd, d: dcp.save(sd, checkpoint_id=d),
         lambda sd, d: dcp.load(sd, checkpoint_id=d) or sd, dcp_state_dict),
    ):
        # warm-up: the checkpoint machinery's one-off start-up cost, paid on a tiny checkpoint
        warm = os.path.join(root, f"{name}-warm")
        if rank == 0:
            os.makedirs(warm, exist_ok=True)
        if name == "megatron":
            from megatron.core.dist_checkpointing.mapping import ShardedTensor

            def tiny():
                return {"w": ShardedTensor.from_rank_offsets("warm", torch.zeros(1, 4), (0, rank, world))}
        else:
            def tiny():
                return {"warm": torch.zeros(4)}
        dist.barrier()
        t0 = time.perf_counter()
        save(tiny(), warm)
        load(tiny(), warm)
        dist.barrier()
        cold = time.perf_counter() - t0
        d = os.path.join(root, name)
        if rank == 0:
            os.makedirs(d, exist_ok=True)
        dist.barrier()
        save_s, _ = _barrier_time(lambda d=d, make=make, save=save: save(make(old_layout, rank, old, loading=False), d))

        def do_load(d=d, make=make, load=load, name=name):
            if new_rank is None:
                return load({}, d) if name == "megatron" else None
            sd = make(new_layout, new_rank, target, loading=True)
            loaded = load(sd, d)
            if name == "megatron":  # copy back when megatron handed out new tensors
                for k, st in sd.items():
                    got = loaded[k]
                    if got.data_ptr() != st.data.data_ptr():
                        st.data.copy_(got)
            return None

        if new_rank is None and name == "dcp":
            load_s, _ = _barrier_time(lambda d=d: dcp.load({}, checkpoint_id=d))
        else:
            load_s, _ = _barrier_time(do_load)
        bad = check_reference(new_layout, new_rank, target) if new_rank is not None else []
        size = sum(f.stat().st_size for f in Path(d).rglob("*") if f.is_file()) if rank == 0 else 0
        out[name] = {"save_seconds": save_s, "load_seconds": load_s, "cold_seconds": cold,
                     "mismatches": len(bad), "checkpoint_bytes": size}
        dist.barrier()
        if rank == 0:
            shutil.rmtree(d, ignore_errors=True)
            shutil.rmtree(warm, ignore_errors=True)
        dist.barrier()
    return out


def summarize(name: str, procs: int, params: dict, results: list[dict]) -> dict:
    def worst(path):
        vals = []
        for r in results:
            v = r
            for p in path:
                v = v[p]
            vals.append(v)
        return vals

    row = {"transition": name, "procs": procs, "from": params["old"], "to": params["new"], "leave": params["leave"],
           "budget_bytes": params["budget"], "checksum": results[0]["checksum"],
           "plan_seconds": max(worst(["plan_seconds"])), "schedule_seconds": max(worst(["schedule_seconds"])),
           "p2p_gbps_before": min(r["p2p_gbps"] for r in results if r["rank"] ^ 1 < procs),
           "p2p_gbps_after": min(r["p2p_gbps_after"] for r in results if r["rank"] ^ 1 < procs)}
    row["p2p_gbps_per_direction"] = max(row["p2p_gbps_before"], row["p2p_gbps_after"])
    row["p2p_fresh_gbps_per_direction"] = min(r["p2p_fresh_gbps"] for r in results if r["rank"] ^ 1 < procs)
    for mode in LIVE_VARIANTS:
        secs = [max(r[f"live_{mode}"]["seconds"][i] for r in results) for i in range(params["repeat"])]
        busiest = max(max(r[f"live_{mode}"]["bytes_sent"], r[f"live_{mode}"]["bytes_received"]) for r in results)
        best = min(secs)
        prep = [max(r[f"live_{mode}"]["prepare_seconds"][i] for r in results)
                for i in range(len(results[0][f"live_{mode}"]["prepare_seconds"]))]
        row[f"live_{mode}"] = {
            "seconds": secs, "best_seconds": best, "prepare_seconds": prep,
            "bytes_moved": sum(r[f"live_{mode}"]["bytes_sent"] for r in results),
            "busiest_device_bytes": busiest,
            "busiest_device_gbps": busiest / best / 1e9 if best else 0.0,
            "peak_staging_bytes": max(r[f"live_{mode}"]["peak_staging_bytes"] for r in results),
            "aliased_bytes": sum(r[f"live_{mode}"]["aliased_bytes"] for r in results),
            "local_bytes": sum(r[f"live_{mode}"]["local_bytes"] for r in results),
            "max_local_seconds": max(r[f"live_{mode}"]["local_seconds"] for r in results),
            "max_rounds_seconds": max(r[f"live_{mode}"]["rounds_seconds"] for r in results),
            "rounds": results[0][f"live_{mode}"]["rounds"],
            "max_rounds_in_flight": max(r[f"live_{mode}"]["max_rounds_in_flight"] for r in results),
            "peak_extra_bytes": max(r[f"live_{mode}"]["peak_extra_bytes"] for r in results),
            "mismatches": sum(r[f"live_{mode}"]["mismatches"] for r in results)}
    for ck in ("megatron", "dcp"):
        row[ck] = {"save_seconds": max(r[ck]["save_seconds"] for r in results),
                   "load_seconds": max(r[ck]["load_seconds"] for r in results),
                   "cold_seconds": max(r[ck]["cold_seconds"] for r in results),
                   "checkpoint_bytes": max(r[ck]["checkpoint_bytes"] for r in results),
                   "mismatches": sum(r[ck]["mismatches"] for r in results)}
        row[ck]["total_seconds"] = row[ck]["save_seconds"] + row[ck]["load_seconds"]
    live = min(row["live_p2p"]["best_seconds"], row["live_a2a"]["best_seconds"])
    row["live_best_seconds"] = live
    row["default_mode"] = "p2p" if row["live_p2p"]["best_seconds"] <= row["live_a2a"]["best_seconds"] else "a2a"
    row["speedup_vs_megatron"] = row["megatron"]["total_seconds"] / live if live else float("inf")
    row["speedup_vs_dcp"] = row["dcp"]["total_seconds"] / live if live else float("inf")
    p2p, cold = row["live_p2p"], row["live_p2p_cold"]
    row["executor_fraction_of_p2p_bandwidth"] = (p2p["busiest_device_gbps"] / row["p2p_gbps_per_direction"]
                                                 if p2p["busiest_device_bytes"] else None)
    # the executor allocating the new tensors itself: against warm P2P, and against P2P that
    # also receives into new memory (like for like)
    row["speedup_vs_megatron_cold"] = row["megatron"]["total_seconds"] / cold["best_seconds"]
    row["speedup_vs_dcp_cold"] = row["dcp"]["total_seconds"] / cold["best_seconds"]
    row["cold_executor_fraction_of_p2p_bandwidth"] = (cold["busiest_device_gbps"] / row["p2p_gbps_per_direction"]
                                                      if cold["busiest_device_bytes"] else None)
    row["cold_executor_fraction_of_fresh_p2p_bandwidth"] = (
        cold["busiest_device_gbps"] / row["p2p_fresh_gbps_per_direction"] if cold["busiest_device_bytes"] else None)
    row["all_bit_exact"] = not any(row[k]["mismatches"] for k in ("live_p2p", "live_a2a", "live_p2p_cold",
                                                                  "megatron", "dcp"))
    return row


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def main(argv: list[str] | None = None) -> int:
    from liveshard.dev.reshard.launch import run_ranks
    from liveshard.runtime.units import parse_bytes

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, nargs="+", default=[4, 8], choices=sorted(TRANSITIONS))
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--budget", default="256MiB")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--only", default="", help="run only transitions whose name contains this")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "live_vs_checkpoint.json"))
    args = ap.parse_args(argv)
    rows = []
    for procs in args.procs:
        for name, old, new, leave, gpn in TRANSITIONS[procs]:
            if args.only and args.only not in name:
                continue
            root = tempfile.mkdtemp(prefix="liveshard-ckpt-")
            params = {"model": args.model, "old": old, "new": new, "leave": leave, "gpn": gpn,
                      "budget": parse_bytes(args.budget, "--budget"), "repeat": args.repeat, "dir": root}
            t0 = time.time()
            try:
                results = run_ranks(bench_rank, (params,), procs, timeout_s=1800)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            row = summarize(name, procs, params, results)
            row["wall_seconds"] = time.time() - t0
            rows.append(row)
            print(f"[{procs} procs] {name}: live p2p {row['live_p2p']['best_seconds']:.3f}s "
                  f"(prepare {max(row['live_p2p']['prepare_seconds']):.3f}s) a2a "
                  f"{row['live_a2a']['best_seconds']:.3f}s p2p cold {row['live_p2p_cold']['best_seconds']:.3f}s | "
                  f"megatron {row['megatron']['save_seconds']:.2f}+{row['megatron']['load_seconds']:.2f}s | "
                  f"dcp {row['dcp']['save_seconds']:.2f}+{row['dcp']['load_seconds']:.2f}s | "
                  f"p2p {row['p2p_gbps_before']:.2f}/{row['p2p_gbps_after']:.2f} GB/s before/after (into new "
                  f"memory {row['p2p_fresh_gbps_per_direction']:.2f}) | executor / P2P "
                  f"{_pct(row['executor_fraction_of_p2p_bandwidth'])}, cold "
                  f"{_pct(row['cold_executor_fraction_of_p2p_bandwidth'])} (into new memory "
                  f"{_pct(row['cold_executor_fraction_of_fresh_p2p_bandwidth'])}) | "
                  f"bit-exact {row['all_bit_exact']}", flush=True)
    print()
    hdr = (f"{'procs':>5} {'transition':<28} {'moved MB':>9} {'live s':>7} {'prep s':>7} {'a2a s':>6} "
           f"{'cold s':>7} {'mcore s':>8} {'dcp s':>6} {'x mcore':>8} {'x dcp':>6} {'x dcp cold':>10} "
           f"{'P2P GB/s':>8} {'exec/P2P':>8} {'cold/P2P':>8} {'exact':>5}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        live, cold = r["live_p2p"], r["live_p2p_cold"]
        print(f"{r['procs']:>5} {r['transition']:<28} {live['bytes_moved'] / 1e6:>9.1f} "
              f"{live['best_seconds']:>7.3f} {max(live['prepare_seconds']):>7.3f} "
              f"{r['live_a2a']['best_seconds']:>6.3f} {cold['best_seconds']:>7.3f} "
              f"{r['megatron']['total_seconds']:>8.2f} {r['dcp']['total_seconds']:>6.2f} "
              f"{r['speedup_vs_megatron']:>8.1f} {r['speedup_vs_dcp']:>6.1f} {r['speedup_vs_dcp_cold']:>10.1f} "
              f"{r['p2p_gbps_per_direction']:>8.2f} {_pct(r['executor_fraction_of_p2p_bandwidth']):>8} "
              f"{_pct(r['cold_executor_fraction_of_p2p_bandwidth']):>8} {'yes' if r['all_bit_exact'] else 'NO':>5}")
    out = {"bench": "live_vs_checkpoint", "model": args.model, "python": sys.version.split()[0],
           "machine": platform.machine(), "cpu_count": os.cpu_count(), "repeat": args.repeat, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
