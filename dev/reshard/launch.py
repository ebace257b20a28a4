"""Spawn local gloo processes, run one function on each as a rank, collect the results."""

from __future__ import annotations

import os
import queue
import traceback
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

from liveshard.dev.ports import free_port


def _child(rank: int, world: int, port: int, fn, args: tuple, results: Any, timeout_s: float) -> None:
    import torch.distributed as dist

    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        results.put((rank, True, fn(rank, world, *args)))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn, args: tuple, world: int, timeout_s: float = 300.0) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned processes; results in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # many ranks share few cores
    try:
        # not daemonic: checkpoint writers (megatron, DCP) start helper processes of their own
        procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, results, timeout_s), daemon=False)
                 for r in range(world)]
        for p in procs:
            p.start()
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    out: dict[int, Any] = {}
    failed: dict[int, str] = {}
    try:
        while len(out) + len(failed) < world:
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(out) - set(failed))} did not finish "
                                   f"within {timeout_s:.0f} s") from None
            (out if ok else failed)[rank] = value
            if failed:
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not failed else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if failed:
        rank, tb = sorted(failed.items())[0]
        raise RuntimeError(f"rank {rank} failed:\n{tb}")
    return [out[r] for r in range(world)]


def run_local(job, procs: int, timeout_s: float = 300.0) -> list[dict]:
    from liveshard.dev.reshard.harness import run_rank

    return run_ranks(run_rank, (job,), procs, timeout_s)
