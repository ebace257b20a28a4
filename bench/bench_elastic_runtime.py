"""Downtime of a world change: liveshard live vs checkpoint/restart vs torchrun's elastic agent.

Same model (``gpt-125m``: 124M parameters, fp32, Adam), same machine, same run:

* **live**: ``run-local --mode live`` with a spot notice (a member leaves) and a join;
* **checkpoint**: the same events the restart way (megatron checkpoint, new processes, load);
* **torchrun**: two elastic agents (``--nnodes=1:2``, c10d rendezvous with tuned timeouts, the
  mechanism under Kubeflow PyTorchJob's elasticPolicy) training the same megatron model with a
  checkpoint after every step; one agent and its worker are killed (a node lost);
* **overhead**: median step time of the agent vs a plain megatron loop, no events;
* **ahead**: the same leave and join, and the reshape, with the new world's communicators
  connected during prepare (``--build-world-ahead on``) and at the commit (``off``), alternating,
  ``--ahead-rounds`` each: the commit split into its parts (retire the old world, meet, make the
  world, build the model, load, decide) and the pause;
* **reshape**: a parallelism change on 4 workers (``tp=4`` -> ``pp=4``: every member's state
  changes shape), live with every member allocating its new tensors while it waits
  (``--preallocate all``, the CPU default), live with only joiners doing so (the transfer then
  allocates them), and checkpoint/restart.

Downtime is measured on wall clocks from the end of the last step before the change to the end
of the first step after it (``to_next_step``); ``lost`` is that less one steady step of the new
world (median over its later steps, same run): the training time the change cost. For
liveshard also the moment the new world can train (``ready``). Prints a table and writes
``bench/results/elastic_runtime.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from liveshard.dev.ports import free_port

HERE = Path(__file__).resolve().parent
PARTS = ("live", "checkpoint", "torchrun", "overhead", "reshape", "ahead")
# The commit's parts (max over members, as the coordinator records them; agent/switch.py).
COMMIT_PHASES = ("transfer", "retire", "meet", "world", "model", "load", "decide", "commit", "downtime")
RESHAPE = {"workers": 4, "parallel": "tp=4,pp=1,dp=1", "global_batch": 4, "events": "2:parallel=tp=1,pp=4,dp=1",
           "steps": 6}


def run_liveshard(args, mode: str, events: str, steps: int, workdir: Path, *, workers: int = 2,
                  parallel: str = "tp=1,pp=1,dp=2", global_batch: int | None = None,
                  preallocate: str = "auto", build_world_ahead: str = "auto") -> dict:
    from liveshard.dev.localrun.driver import RunSpec, run_local
    from liveshard.dev.localrun.events import parse_events

    return run_local(RunSpec.mock(args.model, workers=workers, parallel=parallel, steps=steps,
                                  global_batch=global_batch or args.global_batch, seq_length=args.seq_length,
                                  events=parse_events(events), mode=mode, preallocate=preallocate,
                                  build_world_ahead=build_world_ahead, workdir=str(workdir)))


def _kill_tree(pid: int) -> None:
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for p in [*root.children(recursive=True), root]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)


def _store_host(agents: list, port: int):
    import psutil

    for a in agents:
        procs = [psutil.Process(a.pid), *psutil.Process(a.pid).children(recursive=True)]
        for p in procs:
            try:
                if any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
                       for c in p.net_connections(kind="tcp")):
                    return a
            except psutil.Error:
                continue
    return agents[0]


def run_torchrun(args, workdir: Path, kill_after: int, steps: int) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "steps.jsonl"
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=bench", "--max-restarts=3",
           "--rdzv-conf=last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2",
           str(HERE / "torchrun_peer.py"), "--model", args.model, "--steps", str(steps),
           "--global-batch", str(args.global_batch), "--seq-length", str(args.seq_length),
           "--ckpt", str(workdir / "ckpt"), "--step-log", str(log)]
    # Both agents start together so the first rendezvous has both (min 1, max 2).
    logs = [open(workdir / f"agent{i}.log", "w") for i in range(2)]  # noqa: SIM115 - closed below
    agents = [subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
              for f in logs]
    t_kill = None
    survivor = None
    try:
        end = time.monotonic() + 1200
        while time.monotonic() < end:
            rows = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
            if t_kill is None and any(r["step"] >= kill_after and r["world"] == 2 for r in rows):
                # Kill the agent that does not host the rendezvous store (killing the host ends
                # the whole job), with its worker: a node lost.
                host = _store_host(agents, port)
                victim = next(a for a in agents if a is not host)
                survivor = host
                _kill_tree(victim.pid)
                t_kill = time.time()
            if survivor is not None and survivor.poll() is not None:
                break
            if all(a.poll() is not None for a in agents):
                break
            time.sleep(0.05)
    finally:
        for a in agents:
            _kill_tree(a.pid)
        for f in logs:
            f.close()
    rows = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    before = [r for r in rows if r["world"] == 2]
    after = [r for r in rows if r["world"] == 1]
    steady = [b["time"] - a["time"] for a, b in itertools.pairwise(rows) if a["world"] == b["world"] == 2]
    steady_after = [b["time"] - a["time"] for a, b in itertools.pairwise(after[1:]) if a["world"] == b["world"] == 1]
    to_next = (after[0]["time"] - before[-1]["time"]) if after and before else None
    return {
        "kill_time": t_kill,
        "last_step_before": before[-1] if before else None,
        "first_step_after": after[0] if after else None,
        "kill_to_next_step": (after[0]["time"] - t_kill) if after and t_kill else None,
        "to_next_step": to_next,
        "steady_step_seconds": statistics.median(steady) if steady else None,
        "steady_step_seconds_after": statistics.median(steady_after) if steady_after else None,
        "lost": to_next - statistics.median(steady_after) if to_next is not None and steady_after else None,
        "rows": rows,
    }


def run_plain(args, steps: int) -> list[float]:
    out = subprocess.run([sys.executable, str(HERE / "plain_loop.py"), "--model", args.model, "--steps", str(steps),
                          "--global-batch", str(args.global_batch), "--seq-length", str(args.seq_length)],
                         capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=1800)
    times = [json.loads(x)["time"] for x in out.stdout.splitlines() if x.startswith("{")]
    return [b - a for a, b in itertools.pairwise(times)]


def _step_gaps(report: dict) -> list[float]:
    t = [s["time"] for s in report["steps"]]
    return [b - a for a, b in itertools.pairwise(t)]


def add_lost_time(report: dict) -> None:
    """Per event: ``lost`` = to_next_step less the new world's steady step time (median gap
    between its later consecutive steps, up to the next event)."""
    steps = report["steps"]
    prev = {s["step"]: s for s in steps}
    evs = report["events"]
    for i, ev in enumerate(evs):
        end = evs[i + 1]["step"] if i + 1 < len(evs) else None
        later = [s for s in steps if s["step"] > ev["step"] + 1 and (end is None or s["step"] <= end)]
        gaps = [s["time"] - prev[s["step"] - 1]["time"] for s in later if s["step"] - 1 in prev
                and prev[s["step"] - 1]["step"] > ev["step"]]
        ev["steady_after"] = statistics.median(gaps) if gaps else None
        ev["lost"] = ev["to_next_step"] - ev["steady_after"] if gaps and ev.get("to_next_step") else None


def _f(x, fmt=".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _ratio(a, b):
    return a / b if a is not None and b else None


def print_table(result: dict) -> None:
    print(f"{'event':<12} {'live ready':>10} {'live->step':>10} {'live lost':>9} {'ckpt->step':>10} "
          f"{'ckpt lost':>9} {'x (->step)':>10} {'x (lost)':>8}")
    for lv, ck in zip(result.get("live", {}).get("events", []), result.get("checkpoint", {}).get("events", [])):
        print(f"{lv['event']:<12} {_f(lv.get('downtime')):>10} {_f(lv.get('to_next_step')):>10} "
              f"{_f(lv.get('lost')):>9} {_f(ck.get('to_next_step')):>10} {_f(ck.get('lost')):>9} "
              f"{_f(_ratio(ck.get('to_next_step'), lv.get('to_next_step')), '.1f'):>10} "
              f"{_f(_ratio(ck.get('lost'), lv.get('lost')), '.1f'):>8}")
    tr = result.get("torchrun") or {}
    if tr:
        leave = (result.get("live", {}).get("events") or [{}])[0]
        print(f"torchrun elastic: node lost -> next step {_f(tr.get('kill_to_next_step'), '.2f')} s; last step "
              f"before -> next step {_f(tr.get('to_next_step'), '.2f')} s, lost {_f(tr.get('lost'), '.2f')} s; "
              f"vs liveshard leave: {_f(_ratio(tr.get('to_next_step'), leave.get('to_next_step')), '.1f')}x "
              f"(->step), {_f(_ratio(tr.get('lost'), leave.get('lost')), '.1f')}x (lost)")
    ov = result.get("overhead")
    if ov:
        print(f"steady state: plain {ov['plain_step_seconds']:.3f} s/step, agent {ov['agent_step_seconds']:.3f} "
              f"s/step -> overhead {100 * ov['overhead']:+.2f}%")
    print(f"live and checkpoint final state bit-identical: {result.get('bit_identical')}")
    rs = result.get("reshape")
    if rs:
        print(f"\nreshape on {rs['workers']} workers, {rs['parallel']} -> {rs['events'].split('=', 1)[1]}:")
        print(f"{'run':<18} {'prepare':>8} {'transfer':>8} {'commit':>7} {'ready':>7} {'->step':>7} {'lost':>7}")
        ck = rs["checkpoint"]["event"]
        for name in ("live", "live_joiners_only", "checkpoint"):
            ev = rs[name]["event"]
            ph = ev.get("phases", {})
            print(f"{name:<18} {_f(ph.get('prepare')):>8} {_f(ph.get('transfer')):>8} {_f(ph.get('commit')):>7} "
                  f"{_f(ev.get('downtime')):>7} {_f(ev.get('to_next_step')):>7} {_f(ev.get('lost')):>7}")
        lv = rs["live"]["event"]
        print(f"live vs checkpoint: {_f(_ratio(ck.get('lost'), lv.get('lost')), '.1f')}x (lost), "
              f"{_f(_ratio(ck.get('downtime'), lv.get('downtime')), '.1f')}x (ready); final state bit-identical "
              f"across the three: {rs['bit_identical']}")


def print_ahead(ah: dict) -> None:
    print("\ncommit split, median over rounds (s; max over members), new world built ahead vs at the commit:")
    print(f"{'event':<14} {'ahead':<5} " + " ".join(f"{p:>8}" for p in COMMIT_PHASES) + f" {'lost':>7}")
    for event, by_mode in ah["median"].items():
        for mode, row in by_mode.items():
            print(f"{event:<14} {mode:<5} " + " ".join(f"{_f(row.get(p)):>8}" for p in COMMIT_PHASES)
                  + f" {_f(row.get('lost')):>7}")


def run_ahead(args, root: Path) -> dict:
    """Leave, join and reshape with the new world connected ahead and at the commit, alternating."""
    runs: dict[str, list[dict]] = {}
    kw = {k: RESHAPE[k] for k in ("workers", "parallel", "global_batch")}
    for k in range(args.ahead_rounds):
        for mode in ("on", "off"):
            rep = run_liveshard(args, "live", "2:leave=1 5:join=1", args.steps, root / f"ahead-{mode}{k}",
                                build_world_ahead=mode)
            add_lost_time(rep)
            rs = run_liveshard(args, "live", RESHAPE["events"], RESHAPE["steps"], root / f"ahead-reshape-{mode}{k}",
                               preallocate="all", build_world_ahead=mode, **kw)
            add_lost_time(rs)
            for ev in [*rep["events"], *rs["events"]]:
                row = {p: ev.get("phases", {}).get(p) for p in COMMIT_PHASES}
                row["downtime"] = ev.get("downtime")
                row["lost"] = ev.get("lost")
                runs.setdefault(f"{ev['kind']}|{mode}", []).append(row)
    median: dict[str, dict[str, dict]] = {}
    for key, rows in runs.items():
        kind, mode = key.split("|")
        median.setdefault(kind, {})[mode] = {
            p: statistics.median(v) if (v := [r[p] for r in rows if r.get(p) is not None]) else None
            for p in (*COMMIT_PHASES, "lost")}
    return {"rounds": args.ahead_rounds, "runs": runs, "median": median}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-125m")
    p.add_argument("--global-batch", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--overhead-steps", type=int, default=10)
    p.add_argument("--overhead-rounds", type=int, default=2)
    p.add_argument("--ahead-rounds", type=int, default=2)
    p.add_argument("--out", default=str(HERE / "results" / "elastic_runtime.json"))
    p.add_argument("--parts", default=",".join(PARTS),
                   help="which measurements to run (others are kept from an existing --out file)")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="liveshard-bench-"))
    events = "2:leave=1 5:join=1"
    parts = set(args.parts.split(","))
    out = Path(args.out)
    result: dict = json.loads(out.read_text()) if out.exists() and parts != set(PARTS) else {}
    result.update({"model": args.model, "machine": f"{os.cpu_count()} CPU cores, gloo", "events": events})

    if "live" in parts:
        live = run_liveshard(args, "live", events, args.steps, root / "live")
        add_lost_time(live)
        result["live"] = {"events": live["events"], "checksums": live["checksums"]}
    if "checkpoint" in parts:
        ckpt = run_liveshard(args, "checkpoint", events, args.steps, root / "checkpoint")
        add_lost_time(ckpt)
        result["checkpoint"] = {"events": ckpt["events"], "checksums": ckpt["checksums"]}
    if "live" in result and "checkpoint" in result:
        a, b = result["live"]["checksums"], result["checkpoint"]["checksums"]
        result["bit_identical"] = bool(a) and a == b
    if "torchrun" in parts:
        result["torchrun"] = run_torchrun(args, root / "torchrun", kill_after=2, steps=args.steps)
    if "overhead" in parts:
        # Alternate the two (plain, agent, plain, agent, ...) so that drift of the machine's speed
        # falls on both; the first two steps of every run are warm-up.
        plain_gaps: list[float] = []
        agent_gaps: list[float] = []
        for k in range(args.overhead_rounds):
            plain_gaps += run_plain(args, args.overhead_steps)[2:]
            agent_gaps += _step_gaps(run_liveshard(args, "live", "", args.overhead_steps, root / f"overhead{k}"))[2:]
        pm, am = statistics.median(plain_gaps), statistics.median(agent_gaps)
        result["overhead"] = {"plain_step_seconds": pm, "agent_step_seconds": am, "overhead": am / pm - 1,
                              "plain_steps": plain_gaps, "agent_steps": agent_gaps}

    if "reshape" in parts:
        kw = {k: RESHAPE[k] for k in ("workers", "parallel", "global_batch")}
        runs = {}
        for name, mode, pre in (("live", "live", "all"), ("live_joiners_only", "live", "joiners"),
                                ("checkpoint", "checkpoint", "auto")):
            rep = run_liveshard(args, mode, RESHAPE["events"], RESHAPE["steps"], root / f"reshape-{name}",
                                preallocate=pre, **kw)
            add_lost_time(rep)
            runs[name] = {"event": rep["events"][0], "checksums": rep["checksums"],
                          "losses": [s["loss"] for s in rep["steps"]]}
        result["reshape"] = {**RESHAPE, **runs,
                             "bit_identical": len({json.dumps(r["checksums"], sort_keys=True)
                                                   for r in runs.values()}) == 1}

    if "ahead" in parts:
        result["ahead"] = run_ahead(args, root)

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(result)
    if "ahead" in result:
        print_ahead(result["ahead"])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
