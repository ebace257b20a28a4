"""Faults at the two ends of a run, on local processes: a worker SIGKILLed while the first world
starts or during the final checkpoint, and a final checkpoint on a volume with no space.

    python -m liveshard.dev.localrun.end_faults --workdir DIR --workers 3 --parallel tp=1,pp=1,dp=3 \\
        --steps 3 --kill 2@final-save --out end.json

The real coordinator and workers run as ``run-local`` runs them (``driver.LocalRun``'s
processes), with phase holds: the worker that was rank R of the first world waits at ``PHASE``
(``start``: after the first world's members met, before its rendezvous; ``final-save``: before
each attempt of the final checkpoint) until it is SIGKILLed there. No step is held. The run then
goes until the coordinator reports the job finished or failed and every other worker has exited.

A full disk is a real one: run this inside a mount namespace with a small tmpfs mounted on
``DIR/checkpoints/periodic`` (``unshare --user --map-root-user --mount``, as the tests do), so
the checkpoint's writes fail with ``ENOSPC``. ``--fallback DIR`` and ``--patience S`` are the
workers' ``--fallback-checkpoint-dir`` and ``--final-save-patience``; ``--grow-tmpfs SIZE``
remounts that tmpfs to ``SIZE`` once a final save has failed (space coming back while the
workers wait for it).

The result (``--out``, JSON): the coordinator's last status (``finished``, ``failure``,
``checkpoints``), each worker's exit code and result file, the run's report (steps, final
checkpoint), when the victim was killed, and the final checkpoint's verification
(``checkpoint.verify``: None when every file is as saved), made before a tmpfs goes away.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from liveshard.dev.localrun.driver import LocalRun, RunSpec
from liveshard.runtime.contract.env import Env
from liveshard.runtime.contract.keys import Keys

PHASES = ("start", "final-save")  # where a worker's phase gate can hold it at the ends of a run


class EndRun(LocalRun):
    """A local run whose workers get extra environment (the final save's options)."""

    def __init__(self, run: RunSpec, env: dict[str, str] | None = None) -> None:
        super().__init__(run)
        self.extra_env = dict(env or {})

    def _env(self) -> dict:
        return {**super()._env(), **self.extra_env}


def run_end(run: RunSpec, *, kill: tuple[int, str] | None = None, env: dict[str, str] | None = None,
            grow_tmpfs: str | None = None, timeout: float = 600.0) -> dict[str, Any]:
    """Run ``run`` (no events) with the fault of ``kill`` (the first world's rank, a phase of
    ``PHASES``); the result described in the module's docstring."""
    from liveshard.runtime.agent.checkpoint import verify
    from liveshard.runtime.coordinator import PlanRequest, StorePlanSource

    if run.events:
        raise ValueError("end faults take no events")
    if kill is not None and kill[1] not in PHASES:
        raise ValueError(f"unknown phase {kill[1]!r}: one of {', '.join(PHASES)}")
    job = EndRun(run, env)
    out: dict[str, Any] = {"killed": None, "grown": None}
    try:
        port, store = job.serve()
        ids = [f"w{i}" for i in range(run.workers)]
        for wid in ids:
            # a hold at the last step is never reached (no step boundary follows it): the held
            # worker is used for its phase gate alone
            job.start_worker(wid, port, holds=(run.steps,), extra=["--phase-holds"])
        victim = ids[kill[0]] if kill is not None else None
        if victim is not None:
            store.set(Keys.hold_phase(victim), kill[1])
        job._wait_registered(store, ids)
        StorePlanSource.post(store, PlanRequest(members=tuple(ids), config=str(job.cfg), reason="start"))
        job.say(f"started {len(ids)} workers, config {job.cfg}" + (f"; {victim} dies at {kill[1]}" if victim else ""))
        status = _until_the_end(job, store, victim, out, grow_tmpfs, timeout)
        out["status"] = {k: status.get(k) for k in ("finished", "failure", "checkpoints", "history", "generation",
                                                     "members", "dead")}
        with contextlib.suppress(Exception):  # workers still waiting for a plan (a standby) finish too
            store.set(Keys.STOP, "1")
        for proc in job.procs.workers.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=60)
        out["exit_codes"] = {wid: p.poll() for wid, p in job.procs.workers.items()}
        out["results"] = job._worker_results()
        out["report"] = job._report([job.history[g] for g in sorted(job.history)])
        final = out["report"].get("final_checkpoint")
        out["verify"] = verify(final) if final else "no final checkpoint"
        return out
    finally:
        job.procs.kill_all()


def _until_the_end(job: LocalRun, store: Any, victim: str | None, out: dict[str, Any], grow_tmpfs: str | None,
                   timeout: float) -> dict:
    """Kill the victim when it is held at its phase, grow the tmpfs when a save failed, and
    return the coordinator's status once the job finished or failed and every worker but the
    victim has exited (or every worker has, or the coordinator has)."""
    end = time.monotonic() + timeout
    procs = job.procs
    st: dict = {}
    while True:
        try:
            st = job._status(store)
        except Exception:  # the coordinator is gone: it exits soon after it stopped a failed job
            if procs.coordinator is None:
                raise
            with contextlib.suppress(subprocess.TimeoutExpired):
                procs.coordinator.wait(timeout=30)
            if procs.coordinator.poll() is None:
                raise
            return {**st, "failure": st.get("failure") or _failure_logged(job.dir / "coordinator.log")}
        if victim is not None and out["killed"] is None and store.get(Keys.at_phase(victim)) is not None:
            proc = procs.workers[victim]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
            out["killed"] = {"worker": victim, "at": store.get(Keys.at_phase(victim)), "time": time.time()}
            job.say(f"{victim} killed at {out['killed']['at']}")
        if grow_tmpfs and out["grown"] is None and (st.get("checkpoints") or {}).get("failed"):
            directory = str(job.checkpoint_dir)
            subprocess.run(["mount", "-o", f"remount,size={grow_tmpfs}", directory], check=True)
            out["grown"] = {"size": grow_tmpfs, "time": time.time(), "failed": st["checkpoints"]["failed"]}
            job.say(f"{directory} grown to {grow_tmpfs}")
        others = [p for w, p in procs.workers.items() if w != victim]
        if (st.get("failure") or st.get("finished")) and all(p.poll() is not None for p in others):
            return st
        if all(p.poll() is not None for p in procs.workers.values()):
            time.sleep(1.0)  # the coordinator's last judgement of their exits
            with contextlib.suppress(Exception):
                st = job._status(store)
            return st
        if procs.coordinator is not None and procs.coordinator.poll() is not None:
            return st
        if time.monotonic() > end:
            raise TimeoutError(f"the job neither finished nor failed in {timeout:.0f} s (see {job.dir})")
        time.sleep(0.1)


def _failure_logged(log: Path) -> dict | None:
    """The failure a coordinator that exited logged last (``the job cannot continue (REASON): ...``)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        _, found, rest = line.partition("the job cannot continue (")
        if found:
            reason, _, message = rest.partition("): ")
            return {"reason": reason, "message": message, "from": "coordinator.log"}
    return None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m liveshard.dev.localrun.end_faults", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--out", required=True, help="the result, JSON")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--parallel", default="tp=1,pp=1,dp=2")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=6)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--kill", default=None, help="R@PHASE: the first world's rank R dies at PHASE (start, final-save)")
    p.add_argument("--fallback", default=None, help="the workers' --fallback-checkpoint-dir")
    p.add_argument("--patience", type=float, default=None, help="the workers' --final-save-patience (seconds)")
    p.add_argument("--grow-tmpfs", default=None, help="remount the checkpoint tmpfs to this size once a save failed")
    p.add_argument("--heartbeat-timeout", type=float, default=2.0)
    p.add_argument("--collective-timeout", type=float, default=10.0)
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    kill = None
    if args.kill:
        rank, _, phase = args.kill.partition("@")
        kill = (int(rank), phase)
    env = {}
    if args.fallback:
        env[Env.FALLBACK_CHECKPOINT_DIR] = args.fallback
    if args.patience is not None:
        env[Env.FINAL_SAVE_PATIENCE] = repr(args.patience)
    run = RunSpec.mock(args.model, workers=args.workers, parallel=args.parallel, steps=args.steps,
                       global_batch=args.global_batch, events=[], workdir=args.workdir,
                       heartbeat_timeout=args.heartbeat_timeout, collective_timeout=args.collective_timeout,
                       checkpoint_every=args.checkpoint_every, log=sys.stderr)
    result = run_end(run, kill=kill, env=env, grow_tmpfs=args.grow_tmpfs, timeout=args.timeout)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
