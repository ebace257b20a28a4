"""One training process per GPU: the per-pod supervisor of ``liveshard worker``.

A worker pod with ``gpusPerWorker = g`` stands for the workers ``<pod>/0 .. <pod>/g-1`` (rank
``r`` of a plan is local GPU ``r % g`` of pod ``members[r // g]``). When ``liveshard worker``
starts with more than one local worker (``--local-workers``, default
``$LIVESHARD_GPUS_PER_WORKER``) and ``LOCAL_RANK`` is not set, it does not train itself: it
starts ``g`` copies of its own command line with ``LOCAL_RANK=i`` and ``LOCAL_WORLD_SIZE=g``,
forwards SIGTERM and SIGINT to them, and exits when all of them have exited.

A child that dies is **not** a reason to stop its siblings: the runtime survives lost ranks
(the coordinator publishes a recovery plan without them), so the other GPUs of the pod keep
training. The supervisor's exit code is 0 only if every child exited 0; otherwise the first
failing child's code (``128 + N`` for a child killed by signal ``N``, as a shell reports it).

Per-process values (pure helpers below): a child's worker id is ``<id>/<local rank>`` when an
explicit ``--id`` is given to a multi-process pod, and its ``--result FILE`` gets ``.<local
rank>`` before the extension (``out/pod.json`` -> ``out/pod.0.json``, ``out/pod.1.json``).
A pod with one process keeps both unchanged.

Standard library only: this module is imported before torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import PurePath

from liveshard.runtime import lifeline
from liveshard.runtime.contract.env import Env
from liveshard.runtime.errors import exit_text

log = logging.getLogger("liveshard.local_workers")

GPUS_ENV = Env.GPUS_PER_WORKER
FORWARDED = (signal.SIGTERM, signal.SIGINT)


# ---- pure ------------------------------------------------------------------------------------
def default_local_workers(env: Mapping[str, str]) -> int:
    """``$LIVESHARD_GPUS_PER_WORKER`` (what the operator sets on worker pods), else 1."""
    text = (env.get(GPUS_ENV) or "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else 1


def should_supervise(local_workers: int, env: Mapping[str, str]) -> bool:
    """True for the pod's first process when it must start ``local_workers`` children; a child
    (``LOCAL_RANK`` set, by this supervisor or by torchrun) always trains itself."""
    return local_workers > 1 and "LOCAL_RANK" not in env


def local_rank(env: Mapping[str, str]) -> tuple[int, int]:
    """(local rank, local world size) of this process: ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``, else (0, 1)."""
    rank = int(env.get("LOCAL_RANK") or 0)
    size = int(env.get("LOCAL_WORLD_SIZE") or 1)
    return rank, max(size, rank + 1)


def child_env(env: Mapping[str, str], rank: int, size: int) -> dict[str, str]:
    return {**env, "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(size)}


def per_process_id(worker_id: str, rank: int, size: int) -> str:
    """An explicit ``--id`` in a pod of ``size`` processes: ``<id>/<rank>`` (unchanged for one)."""
    return worker_id if size <= 1 else f"{worker_id}/{rank}"


def per_process_path(path: str, rank: int, size: int) -> str:
    """``--result FILE`` in a pod of ``size`` processes: ``.<rank>`` goes before the extension
    (``r.json`` -> ``r.0.json``; ``r`` -> ``r.0``), so the processes never overwrite each other."""
    if size <= 1:
        return path
    p = PurePath(path)
    if p.suffix:
        return str(p.with_name(f"{p.stem}.{rank}{p.suffix}"))
    return f"{path}.{rank}"


def exit_code(codes: Sequence[int]) -> int:
    """0 if every child exited 0; else the first failure (``128 + N`` for death by signal ``N``)."""
    for code in codes:
        if code < 0:
            return 128 - code
        if code > 0:
            return code
    return 0


# ---- the supervisor --------------------------------------------------------------------------
def child_command(argv: Sequence[str] | None = None) -> list[str]:
    """This process's own ``liveshard`` command line, run with this Python."""
    args = list(sys.argv[1:] if argv is None else argv)
    return [sys.executable, "-m", "liveshard.runtime.cli", *args]


def supervise(command: Sequence[str], n: int, env: Mapping[str, str] | None = None, poll: float = 0.2,
              spawn: Callable[..., subprocess.Popen] = subprocess.Popen) -> int:
    """Run ``command`` ``n`` times (``LOCAL_RANK`` 0..n-1), forward SIGTERM/SIGINT, wait for all.

    Returns :func:`exit_code` of the children's exit codes in local-rank order.
    """
    base = dict(os.environ if env is None else env)
    children: list[subprocess.Popen] = []
    preexec = lifeline.preexec()  # Linux: SIGKILL to the child if the supervisor dies (no orphans training)
    received: list[int] = []

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        for c in children:
            if c.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    c.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        try:
            for i in range(n):
                children.append(spawn(list(command), env=child_env(base, i, n), preexec_fn=preexec))
                log.info("local worker %d/%d: pid %d", i, n, children[-1].pid)
        except BaseException:
            for c in children:  # a pod with fewer processes than GPUs would stall every plan
                c.kill()
                c.wait()
            raise
        if received:  # a signal that arrived while the children were starting
            forward(received[-1], None)
        running = set(range(n))
        while running:
            for i in sorted(running):
                code = children[i].poll()
                if code is not None:
                    running.discard(i)
                    how = exit_text(code)
                    level = logging.INFO if code == 0 else logging.WARNING
                    log.log(level, "local worker %d/%d (pid %d) ended: %s; %d still running",
                            i, n, children[i].pid, how, len(running))
            if running:
                time.sleep(poll)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return exit_code([c.returncode for c in children])
