"""Checkpoint mode: the same world changes done the way restart-based systems do them.

The run is cut into segments at the events. Each segment is a fresh set of processes (and a
fresh coordinator) under one config that loads the previous segment's megatron checkpoint,
trains up to the next event, saves and exits. A kill stops every process of the segment (as an
elastic agent does when a member dies) and the next segment restarts from the last periodic
checkpoint, recomputing the steps after it.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from liveshard.dev.localrun.driver import LocalRun, plan_local_world
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.parallel import ParallelConfig


def run_checkpoint_mode(job: LocalRun) -> dict:
    from liveshard.runtime.coordinator import PlanRequest, StorePlanSource

    r = job.run
    if any(e.kind == "kill" for e in r.events) and not r.checkpoint_every:
        raise ConfigError("--checkpoint-every", "a kill in checkpoint mode needs periodic checkpoints",
                          "set --checkpoint-every N")
    periodic = job.checkpoint_dir
    cfg = job.cfg
    workers = r.workers
    load_dir: Path | None = None
    history: list[dict] = []
    events = list(r.events)
    seg = 0
    start_step = 0
    while True:
        ev = events[0] if events else None
        end_step = ev.step if ev is not None else r.steps
        # The segment's save at its event goes with the periodic ones: the next segment's
        # coordinator continues from the newest complete checkpoint there (by step), which is
        # this one, not an older periodic save.
        save_dir = periodic / f"seg{seg}-step{end_step:08d}"
        job.procs.workers.clear()
        port, store = job.serve()
        ids = [f"s{seg}w{i}" for i in range(cfg.world_size)]
        for wid in ids:
            extra: list[str] = []
            if load_dir is not None:
                extra += ["--load", str(load_dir)]
            if ev is not None and ev.kind != "kill":
                extra += ["--save-dir", str(save_dir), "--save-at-step", str(end_step)]
            holds = (ev.step,) if ev is not None and ev.kind == "kill" else ()
            job.start_worker(wid, port, extra=extra, holds=holds)
        t0 = time.time()
        StorePlanSource.post(store, PlanRequest(members=tuple(ids), config=str(cfg), reason=f"segment {seg}"))
        job.say(f"segment {seg}: {cfg} on {len(ids)} new processes from step {start_step}")
        history.append({"generation": seg, "config": str(cfg), "world_size": cfg.world_size,
                        "outcome": "committed", "reason": "start" if seg == 0 else str(r.events[seg - 1]),
                        "phases": {}, "started": t0})
        if ev is not None and ev.kind == "kill":
            job.kill_at_step(store, [ids[rank] for rank in ev.ranks], ev.step)
            for rank in ev.ranks:
                job.procs.workers[ids[rank]].wait(timeout=600)
            job.say(f"step {ev.step}: killed rank(s) {list(ev.ranks)}; restarting everybody")
            # The elastic agent's reaction: stop the rest (through the store, so that they
            # write the steps they did before exiting; killed if they do not exit).
            store.set(Keys.STOP, "1")
            for p in job.procs.workers.values():
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
            # the newest complete checkpoint: a periodic one, or the one an earlier segment
            # saved at its event (newer when the last periodic save came before that event)
            load_dir = _latest(periodic)
            if load_dir is None:  # killed before the first save: a restart-based system starts over
                job.say(f"step {ev.step}: no checkpoint yet; the next processes start from the beginning")
            workers -= len(ev.ranks)
        else:
            for p in job.procs.workers.values():
                try:
                    p.wait(timeout=900)
                except subprocess.TimeoutExpired:
                    p.kill()
            if ev is None:
                break
            load_dir = save_dir
            if ev.kind == "leave":
                workers -= len(ev.ranks)
            elif ev.kind == "join":
                workers += ev.count
        store.set(Keys.STOP, "1")
        try:
            job.procs.coordinator.wait(timeout=30)
        except subprocess.TimeoutExpired:
            job.procs.coordinator.kill()
        if ev.kind == "parallel":
            cfg = ParallelConfig.parse(ev.config)
        elif ev.kind == "stop":
            pass  # saved, stopped, resumed under the same config
        else:
            cfg = plan_local_world(r, cfg, [f"w{i}" for i in range(workers)]).config
        events.pop(0)
        seg += 1
        start_step = ev.step
    store.set(Keys.STOP, "1")
    try:
        job.procs.coordinator.wait(timeout=30)
    except subprocess.TimeoutExpired:
        job.procs.coordinator.kill()
    report = job._report(history)
    return report


def _latest(directory: Path) -> Path | None:
    """The complete checkpoint of the highest step under ``directory`` (periodic saves and the
    segments' saves at their events have different names: compare steps, not names)."""
    from liveshard.runtime.agent.checkpoint import is_complete, read_meta

    found = [p for p in (directory.iterdir() if directory.exists() else ()) if is_complete(p)]
    return max(found, key=lambda p: int(read_meta(p).get("step", -1)), default=None)
