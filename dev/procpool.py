"""A pool of spawned processes that run functions as the ranks of a gloo process group.

Starting a process that imports torch and megatron-core costs seconds on a small CPU machine,
so tests keep one pool and run many jobs on it. A job names a world size ``w``: pool members
``0..w-1`` run it as the ranks of a gloo group of that size (re-created when ``w`` changes);
the others sit it out. ``run`` returns every rank's result, or raises with the failing ranks'
tracebacks; a failed or timed-out job discards the pool's processes (the next job starts new
ones), since ranks left waiting in a collective cannot be trusted.

Members are not daemons (megatron's checkpoint writer starts helper processes), so close the
pool when done; it is also closed at interpreter exit, and a member ends when the process that
started the pool dies in any way (``runtime.lifeline``: start the pool from a thread that lives
as long as it, e.g. the main thread).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

from liveshard.dev.ports import free_port
from liveshard.runtime.lifeline import bind_to_parent

_STOP = "stop"


def _worker(member: int, tasks: Any, results: Any, preload: tuple[str, ...], timeout_s: float,
            parent: int | None = None) -> None:
    import importlib

    if parent is not None:  # ends with the process that started the pool, even on its SIGKILL
        bind_to_parent(parent)

    import torch.distributed as dist

    from liveshard.runtime.megatron.compat import eager_fusions

    with eager_fusions():  # megatron-core, if a preloaded module imports it, as a worker imports it
        for name in preload:  # pay the import cost once, while the pool starts
            importlib.import_module(name)
    world = 0
    group_port = 0  # a member that sat out a smaller world still holds an older group
    while True:
        task = tasks.get()
        if task == _STOP:
            break
        job_id, fn, args, job_world, port = task
        if member >= job_world:
            continue
        try:
            if job_world != world or port != group_port:
                if dist.is_initialized():
                    dist.destroy_process_group()
                store = dist.TCPStore("127.0.0.1", port, job_world, is_master=member == 0,
                                      timeout=timedelta(seconds=timeout_s))
                dist.init_process_group("gloo", store=store, rank=member, world_size=job_world,
                                        timeout=timedelta(seconds=timeout_s))
                world = job_world
                group_port = port
            results.put((job_id, member, True, fn(member, job_world, *args)))
        except BaseException:  # report everything; the parent decides
            results.put((job_id, member, False, traceback.format_exc()))
    # Stopped: the parent has every result (it sends the stop only after its last run returned).
    # Exit at once: destroying the group waits on the peers' gloo pairs and the interpreter's
    # exit handlers (torch, megatron) take seconds, for a process whose work is done.
    os._exit(0)


class GlooPool:
    """``size`` spawned processes; ``run(fn, *args, world=w)`` runs ``fn(rank, w, *args)`` on ranks 0..w-1."""

    def __init__(self, size: int, preload: tuple[str, ...] = (), timeout_s: float = 120.0) -> None:
        self.size = size
        self.preload = preload
        self.timeout_s = timeout_s
        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._world = 0
        self._port = 0
        self._job = 0

    def _start(self) -> None:
        self._tasks = [self._ctx.Queue() for _ in range(self.size)]
        self._results = self._ctx.Queue()
        env_threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # many ranks share few cores
        try:
            self._procs = [
                self._ctx.Process(target=_worker, args=(m, self._tasks[m], self._results, self.preload,
                                                        self.timeout_s, os.getpid()))
                for m in range(self.size)
            ]
            for p in self._procs:
                p.start()
        finally:
            if env_threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env_threads
        self._world = 0
        atexit.register(self.close)

    def run(self, fn: Callable[..., Any], *args: Any, world: int | None = None,
            timeout_s: float | None = None) -> list[Any]:
        world = self.size if world is None else world
        if not 1 <= world <= self.size:
            raise ValueError(f"world {world} outside pool of {self.size}")
        if not self._procs:
            self._start()
        if world != self._world:
            self._port = free_port()
            self._world = world
        self._job += 1
        job = self._job
        for m in range(self.size):
            self._tasks[m].put((job, fn, args, world, self._port))
        out: dict[int, Any] = {}
        failed: dict[int, str] = {}
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while len(out) + len(failed) < world:
            try:
                job_id, member, ok, value = self._results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.close()
                missing = sorted(set(range(world)) - set(out) - set(failed))
                detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
                raise TimeoutError(f"{getattr(fn, '__name__', fn)}: ranks {missing} did not answer"
                                   f"{detail}") from None
            if job_id != job:
                continue
            (out if ok else failed)[member] = value
            if not ok:  # the other ranks may now wait forever in a collective: short grace
                deadline = min(deadline, time.monotonic() + 5.0)
        if failed:
            self.close()
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
            raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed on ranks {sorted(failed)}:{detail}")
        return [out[r] for r in range(world)]

    def close(self) -> None:
        for m, p in enumerate(self._procs):
            if p.is_alive():
                with contextlib.suppress(OSError, ValueError):
                    self._tasks[m].put(_STOP)
        deadline = time.monotonic() + 5.0  # one grace period for all members, then kill
        for p in self._procs:
            if p.pid is None:  # never started
                continue
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []
        self._world = 0
