"""Goodput through a spot availability trace: liveshard live vs checkpoint/restart vs torchrun.

One model (``gpt-125m``: 124M parameters, fp32, Adam), one trace, three runs in the same
invocation:

* **live**: ``run-local`` mode ``live`` (``liveshard.dev.localrun``): the events are plan requests
  to the coordinator, the world is switched in place;
* **checkpoint**: the same events the restart way (mode ``checkpoint``: at a leave or join every
  worker saves a megatron checkpoint and exits, new processes load it under the new world; a loss
  without notice restarts everybody from the newest complete checkpoint and recomputes the steps
  after it);
* **torchrun**: torchrun's elastic agents (c10d rendezvous, ``--nnodes=1:NODES``, last call 1 s,
  keep-alive at its defaults; one agent per node, the first hosts the store) running
  ``torchrun_peer.py``, driven as ``bench_elastic_runtime.py`` drives them: an agent and its
  worker are killed (a node lost) or a new agent is started (a node joins).

liveshard's coordinator runs with its default heartbeat timeout (3 s, ``--heartbeat-timeout``):
a node lost without notice is declared dead after half of it once the survivor reports its world
broken (its collective failed), and the coordinator plans without it then.

**The trace.** A pool of ``--nodes`` spot nodes (default 2, one worker each) over the run's
``--steps`` steps. Three kinds of interruptions, with rates from published figures:

* spot interruptions, at the rate of an AWS Spot Instance Advisor "frequency of interruption"
  band (``--band``; the bands are ``<5%``, ``5-10%``, ``10-15%``, ``15-20%``, ``>20%`` of
  instances reclaimed over the trailing month; the band's upper edge is used, 25% for ``>20%``),
  turned into a per-node hazard ``-ln(1 - p) / 30 days``. Each one comes with its provider's
  notice: AWS's two-minute Spot interruption notice, or GCP's 30 s between the preemption
  notice (ACPI G2 soft off) and the hard stop (``--cloud gcp``). On AWS, half of them (at least
  one) are preceded by an EC2 instance rebalance recommendation ("can arrive sooner than the
  two-minute notice"), 0-5 minutes earlier (the lead is not published: an assumption);
* losses without notice (hardware failures; AWS also emits its notices "on a best effort
  basis"), at the rate Meta reports for Llama 3 405B's pre-training: 419 unexpected
  interruptions in 54 days on 16,384 H100s, 4.7e-4 per GPU-day, 3.8e-3 per 8-GPU node-day;
* capacity coming back: a replacement node joins 60-180 s after a node is lost (provisioning and
  start-up; an assumption, uniform).

Sources: https://aws.amazon.com/ec2/spot/instance-advisor/ (bands; definition also in the
Advisor's data feed), https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html
(two minutes, best effort), https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/rebalance-recommendations.html,
https://cloud.google.com/compute/docs/instances/spot (Spot VMs: 30 s from the preemption notice
to the stop; also the Compute Engine API's ``scheduling.skipGuestOsShutdown``),
Llama 3 paper (Dubey et al., "The Llama 3 Herd of Models", 2024, section 3.3.4).

**Scaling.** Real rates give a handful of interruptions per node-year, so the run keeps each
event's own durations and cuts out the quiet time between events. One step stands for
``--ref-step-seconds`` (default 10 s, a large job's step), so the two-minute notice lasts 12
steps, GCP's 30 s 3 steps, a replacement 6-18 steps, the operator's 5 s debounce of a rebalance
recommendation half a step. ``--interruptions`` (default 3) interruptions fall in the run, split
between spot interruptions and losses without notice in the ratio of their rates (largest
remainder); the run then stands for ``interruptions / (nodes x total rate)`` of the pool's
real time (reported as ``represents_days``). Given their number, the arrival times of a Poisson
process are independent and uniform: the seed draws them (and the victims, the rebalance leads,
the replacement delays), rejecting draws that would leave no node, put two events on one step
or closer than ``--min-gap`` steps, or have no join in the run.

**From the trace to ``run-local`` events** (a step ``S`` event happens after optimizer step ``S``;
trace times are in steps, step ``k`` runs from ``k-1`` to ``k``):

* a notice at ``t`` with window ``w``: ``leave`` (a planned leave) at the first step boundary
  after ``t`` if it comes before ``t + w``; else the node dies in step ``floor(t + w) + 1``: ``kill``
  at ``floor(t + w)`` (no boundary inside the window: the notice is of no use);
* a rebalance recommendation at ``t``: ``leave`` at the first boundary after ``t`` plus the
  debounce (liveshard acts on it, ``spec.elasticity.actOn``); the interruption that follows finds
  the node gone;
* a loss without notice at ``t``: the node dies during step ``floor(t) + 1``: ``kill`` at
  ``floor(t)`` (SIGKILL of the rank's process group while it is held at that step);
* capacity back at ``t``: ``join=1`` at the first boundary after ``t``.

The victim is a rank of the current world drawn by the seed. torchrun cannot lose the agent that
hosts its c10d store (the job ends with it), so there the victim is always the other agent; the
nodes are identical, so this changes nothing else. For torchrun a leave is a checkpoint saved at
the event's step (``--save-at``: the notice came earlier) and then the node's agent killed; a loss
kills it at once; a join starts an agent, whose arrival restarts the workers from the newest
checkpoint (torchrun's behaviour on a membership change).

**Checkpoints.** checkpoint mode and torchrun save every ``--checkpoint-every`` steps (default 10;
liveshard's periodic saves are asynchronous, torchrun's peer saves synchronously) so that a
loss costs at most that many steps. The live run takes no periodic checkpoint
(``--live-checkpoint-every 0``): each loss leaves a replica of every tensor (DP over the nodes).

**Goodput.** An *execution* is one run of an optimizer step by one world (a step recomputed
after a restore has two). The step number's *counted* execution is its last one: its result is
the one the final model descends from; earlier ones were redone, their time is lost. The time
of an execution is its own duration, from the start of its forward to the end of its optimizer
update (the trainer's clock; the slowest rank). **Wall time** runs from the start of the first
execution to the end of the last step's counted execution. So start-up before the first step
(processes, imports, model build, the first rendezvous) and the final checkpoint after the last
step are out for all three; everything between is in: pauses for a change, detection of a lost
node, restarts and loads, checkpoint saves that block training, steps redone, the agents' work
between steps. ``goodput = sum(counted execution times) / wall``, and ``loss = 1 - goodput``.
``goodput_steady`` counts each counted step at the median duration of its world size's counted
executions instead, so that a step slowed by warm-up after a restart or by a background save
is not counted as useful in full. **Tokens trained** = counted steps x global batch x sequence
length (the same in the three: every run trains ``--steps`` steps), tokens computed also counts
the redone executions, tokens/s = tokens trained / wall.

Events are indexed by steps, so each mode meets them at the same step whatever its speed (a
trace indexed by wall time would put more of them in a slower run).

Writes ``bench/results/goodput.json`` (one entry per seed) and a PNG per seed with one panel per
mode: world size and throughput (tokens/s between consecutive step ends) over wall time, the
trace's events marked, redone executions in red.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("live", "checkpoint", "torchrun")

# AWS Spot Instance Advisor bands: fraction of instances reclaimed over the trailing month,
# each band taken at its upper edge (">20%" at 25%).
BANDS = {"<5%": 0.05, "5-10%": 0.10, "10-15%": 0.15, "15-20%": 0.20, ">20%": 0.25}
NOTICE_SECONDS = {"aws": 120.0, "gcp": 30.0}  # AWS interruption notice; GCP preemption notice to stop
# Llama 3 405B pre-training: 419 unexpected interruptions in 54 days on 16,384 GPUs.
UNEXPECTED_PER_GPU_DAY = 419 / (54 * 16384)
GPUS_PER_NODE = 8
REBALANCE_SHARE = 0.5  # share of AWS interruptions announced by a rebalance recommendation (assumed)
REBALANCE_LEAD_SECONDS = (0.0, 300.0)  # recommendation to interruption notice (assumed)
DEBOUNCE_SECONDS = 5.0  # the operator's default debounce of withdrawable signals (rebalance)
REPLACEMENT_SECONDS = (60.0, 180.0)  # a lost node's replacement ready (assumed)


@dataclass(frozen=True)
class TraceEvent:
    step: int  # the run-local event's step
    action: str  # leave, kill, join
    cause: str  # notice, rebalance, loss (without notice), capacity
    at: float  # when the signal came (a notice, a recommendation) or the node died / came back, in steps
    rank: int | None  # leave, kill: the victim's rank in the current world
    world_after: int
    window: float | None = None  # notice: its length in steps

    @property
    def localrun(self) -> str:
        return f"{self.step}:join=1" if self.action == "join" else f"{self.step}:{self.action}={self.rank}"


def rates_per_node_day(band: str) -> dict[str, float]:
    p = BANDS[band]
    return {"spot": -math.log(1.0 - p) / 30.0, "unexpected": UNEXPECTED_PER_GPU_DAY * GPUS_PER_NODE}


def _split(total: int, weights: dict[str, float]) -> dict[str, int]:
    """``total`` split in proportion to ``weights`` by largest remainder (ties: first key)."""
    s = sum(weights.values())
    exact = {k: total * w / s for k, w in weights.items()}
    out = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: out[k] - exact[k])[: total - sum(out.values())]:
        out[k] += 1
    return out


def make_trace(steps: int, seed: int, *, nodes: int = 2, cloud: str = "aws", band: str = ">20%",
               interruptions: int = 3, ref_step_seconds: float = 10.0, min_gap: int = 3,
               max_tries: int = 20000) -> dict:
    """The trace for a run of ``steps`` steps (see the module docstring): its events in step
    order, the ``run-local`` event list, and the numbers it was made from. Deterministic in
    ``seed``."""
    if nodes < 2:
        raise ValueError("a pool of at least 2 nodes (one must stay)")
    if steps < 4 * min_gap:
        raise ValueError(f"{steps} steps are too few for events {min_gap} steps apart")
    rates = rates_per_node_day(band)
    counts = _split(interruptions, rates)
    total_rate = sum(rates.values())
    represents_days = interruptions / (nodes * total_rate)
    scale = 1.0 / ref_step_seconds  # seconds -> steps
    window = NOTICE_SECONDS[cloud] * scale
    n_rebalance = 0 if cloud != "aws" or counts["spot"] == 0 else max(1, round(REBALANCE_SHARE * counts["spot"]))
    rng = random.Random(seed)
    for _ in range(max_tries):
        trace = _draw(rng, steps, nodes, counts, n_rebalance, window, scale, min_gap)
        if trace is not None:
            break
    else:
        raise RuntimeError(f"no valid trace in {max_tries} draws: fewer --interruptions or more --steps")
    return {
        "seed": seed, "steps": steps, "nodes": nodes, "cloud": cloud, "band": band,
        "interruptions": interruptions, "counts": {**counts, "rebalance": n_rebalance},
        "rates_per_node_day": rates, "represents_days": represents_days,
        "ref_step_seconds": ref_step_seconds, "notice_steps": window, "min_gap": min_gap,
        "events": [asdict(e) for e in trace], "localrun": " ".join(e.localrun for e in trace),
    }


def _draw(rng: random.Random, steps: int, nodes: int, counts: dict[str, int], n_rebalance: int,
          window: float, scale: float, min_gap: int) -> list[TraceEvent] | None:
    """One draw of the trace, or None when it breaks a rule (then the caller draws again)."""
    # (time the node leaves the job's view, action, cause, signal time, window)
    losses: list[tuple[float, str, str, float, float | None]] = []
    kinds = ["rebalance"] * n_rebalance + ["notice"] * (counts["spot"] - n_rebalance) + ["loss"] * counts["unexpected"]
    for kind in kinds:
        t = rng.uniform(0.0, steps)  # the interruption (its notice) or the failure
        if kind == "loss":
            losses.append((math.floor(t), "kill", "loss", t, None))
        elif kind == "rebalance":
            rec = t - rng.uniform(*REBALANCE_LEAD_SECONDS) * scale
            losses.append((math.floor(rec + DEBOUNCE_SECONDS * scale) + 1, "leave", "rebalance", rec, None))
        else:
            b = math.floor(t) + 1
            if b < t + window:
                losses.append((b, "leave", "notice", t, window))
            else:
                losses.append((math.floor(t + window), "kill", "notice", t, window))
    timeline: list[tuple[int, str, str, float, float | None]] = []
    for step, action, cause, at, w in losses:
        timeline.append((int(step), action, cause, at, w))
        died = at + (w or 0.0) if action == "kill" or cause == "notice" else float(step)
        back = max(float(step), died) + rng.uniform(*REPLACEMENT_SECONDS) * scale
        if math.floor(back) + 1 <= steps - min_gap:  # capacity back after the run: no join
            timeline.append((math.floor(back) + 1, "join", "capacity", back, None))
    timeline.sort(key=lambda x: x[0])
    world = nodes
    out: list[TraceEvent] = []
    last = -min_gap
    for step, action, cause, at, w in timeline:
        if step < min_gap or step > steps - min_gap or step - last < min_gap:
            return None
        last = step
        if action == "join":
            world += 1
            out.append(TraceEvent(step, action, cause, at, None, world, w))
        else:
            if world <= 1:
                return None
            rank = rng.randrange(world)
            world -= 1
            out.append(TraceEvent(step, action, cause, at, rank, world, w))
        if world > nodes:
            return None
    if not any(e.action == "join" for e in out):
        return None
    return out


# ---- measurements --------------------------------------------------------------------------

@dataclass
class Execution:
    step: int
    start: float
    end: float
    world: int
    counted: bool = False


def executions_of_localrun(workdir: Path) -> list[Execution]:
    """Every execution of every step in a ``run-local`` run's worker results: a step is one
    execution per (segment, generation) that ran it; its duration is the slowest rank's."""
    by_key: dict[tuple, dict] = {}
    for f in workdir.glob("*.json"):
        if f.name == "run.json":
            continue
        try:
            data = json.loads(f.read_text())
        except json.JSONDecodeError:
            continue
        wid = str(data.get("id", f.stem))
        segment = wid.split("w")[0] if wid.startswith("s") else ""
        for rec in data.get("steps", []):
            key = (segment, rec["generation"], rec["step"])
            cur = by_key.setdefault(key, {"end": rec["time"], "seconds": rec.get("seconds") or 0.0,
                                          "world": rec["world_size"]})
            cur["end"] = max(cur["end"], rec["time"])
            cur["seconds"] = max(cur["seconds"], rec.get("seconds") or 0.0)
    return _mark_counted([Execution(k[2], v["end"] - v["seconds"], v["end"], v["world"]) for k, v in by_key.items()])


def _mark_counted(execs: list[Execution]) -> list[Execution]:
    execs.sort(key=lambda e: e.end)
    last: dict[int, Execution] = {}
    for e in execs:
        last[e.step] = e
    for e in last.values():
        e.counted = True
    return execs


def goodput(execs: list[Execution], tokens_per_step: int) -> dict:
    counted = [e for e in execs if e.counted]
    t0 = min(e.start for e in execs)
    t1 = max(e.end for e in counted)
    wall = t1 - t0
    useful = sum(e.end - e.start for e in counted)
    redone = sum(e.end - e.start for e in execs if not e.counted)
    by_world: dict[int, list[float]] = {}
    for e in counted:
        by_world.setdefault(e.world, []).append(e.end - e.start)
    steady = {w: statistics.median(v) for w, v in by_world.items()}
    useful_steady = sum(steady[e.world] for e in counted)
    return {
        "wall_seconds": wall,
        "counted_steps": len(counted),
        "executions": len(execs),
        "redone_steps": len(execs) - len(counted),
        "useful_seconds": useful,
        "goodput": useful / wall,
        "goodput_loss": 1.0 - useful / wall,
        "lost_seconds": wall - useful,
        "lost_redone_seconds": redone,
        "lost_other_seconds": wall - useful - redone,
        "steady_step_seconds": {str(w): s for w, s in sorted(steady.items())},
        "goodput_steady": useful_steady / wall,
        "goodput_steady_loss": 1.0 - useful_steady / wall,
        "tokens_trained": len(counted) * tokens_per_step,
        "tokens_computed": len(execs) * tokens_per_step,
        "tokens_per_second": len(counted) * tokens_per_step / wall,
        "t0": t0,
        "timeline": [{"step": e.step, "start": round(e.start - t0, 3), "end": round(e.end - t0, 3), "world": e.world,
                      "counted": e.counted} for e in execs],
    }


# ---- the three runs ------------------------------------------------------------------------

def run_liveshard(args, trace: dict, mode: str, workdir: Path) -> dict:
    from liveshard.dev.localrun.driver import RunSpec, run_local
    from liveshard.dev.localrun.events import parse_events

    every = args.live_checkpoint_every if mode == "live" else args.checkpoint_every
    t = time.time()
    report = run_local(RunSpec.mock(
        args.model, workers=args.nodes, parallel=f"tp=1,pp=1,dp={args.nodes}", steps=args.steps,
        global_batch=args.global_batch, seq_length=args.seq_length, events=parse_events(trace["localrun"]),
        mode=mode, checkpoint_every=every, heartbeat_timeout=args.heartbeat_timeout, workdir=str(workdir),
        log=sys.stderr))
    result = goodput(executions_of_localrun(workdir), args.global_batch * args.seq_length)
    shutil.rmtree(workdir / "checkpoints", ignore_errors=True)  # 1.5 GB per checkpoint
    result["run_seconds"] = time.time() - t
    result["checkpoint_every"] = every
    result["events"] = [{k: ev.get(k) for k in ("event", "outcome", "downtime", "to_next_step", "config")}
                        for ev in report["events"]]
    result["checksums"] = report["checksums"]
    return result


def run_torchrun(args, trace: dict, workdir: Path) -> dict:
    from bench_elastic_runtime import _kill_tree

    from liveshard.dev.ports import free_port

    workdir.mkdir(parents=True, exist_ok=True)
    log, saves = workdir / "steps.jsonl", workdir / "saves.jsonl"
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1")
    leaves = [e["step"] for e in trace["events"] if e["action"] == "leave"]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes=1:{args.nodes}", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=goodput", "--max-restarts=50",
           str(HERE / "torchrun_peer.py"), "--model", args.model, "--steps", str(args.steps),
           "--global-batch", str(args.global_batch), "--seq-length", str(args.seq_length),
           "--ckpt", str(workdir / "ckpt"), "--step-log", str(log), "--save-log", str(saves),
           "--save-every", str(args.checkpoint_every), "--save-at", ",".join(map(str, leaves))]
    # keep-alive at its defaults (5 s, 3 attempts): tuned down to 1 s and 2, a joining agent took the
    # running one for dead and trained on its own
    rdzv_conf = "last_call_timeout=1"
    i_conf = cmd.index(str(HERE / "torchrun_peer.py"))
    files: list = []
    agents: list[subprocess.Popen] = []

    def start_agent() -> None:
        # The first agent hosts the c10d store; the others are told to connect to it: left to
        # guess (every agent runs on this host), an agent started later can bind the port
        # itself and train on its own as a second job.
        conf = f"{rdzv_conf},is_host={'false' if agents else 'true'}"
        f = open(workdir / f"agent{len(agents)}.log", "w")  # noqa: SIM115 - closed below
        files.append(f)
        agents.append(subprocess.Popen([*cmd[:i_conf], f"--rdzv-conf={conf}", *cmd[i_conf:]], env=env, stdout=f,
                                       stderr=subprocess.STDOUT, start_new_session=True))

    def read(path: Path) -> list[dict]:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []

    alive = lambda: [a for a in agents if a.poll() is None]  # noqa: E731
    t_run = time.time()
    actions = []
    for _ in range(args.nodes):  # together, so that the first rendezvous has them all
        start_agent()
    try:
        deadline = time.monotonic() + args.torchrun_timeout
        for ev in trace["events"]:
            since = time.time() if not actions else actions[-1]["time"]
            need_world = ev["world_after"] + (1 if ev["action"] != "join" else -1)
            while True:  # the event's step reached by the world the trace has there, since the last action
                rows = [r for r in read(log) if r["time"] >= since]
                hit = next((r for r in rows if r["step"] >= ev["step"] and r["world"] == need_world), None)
                if hit is not None:
                    break
                if time.monotonic() > deadline or not alive():
                    raise RuntimeError(f"torchrun: step {ev['step']} never reached (see {workdir})")
                time.sleep(0.05)
            if ev["action"] == "leave":  # the save at the step (--save-at), then the node goes
                while not any(s["step"] >= ev["step"] and s["start"] >= hit["time"] - 1.0 for s in read(saves)):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"torchrun: no save at step {ev['step']}")
                    time.sleep(0.05)
            if ev["action"] == "join":
                start_agent()
            else:
                victim = next(a for a in alive() if a is not agents[0])  # agents[0] hosts the store
                _kill_tree(victim.pid)
                victim.wait(timeout=60)
            actions.append({"event": ev["step"], "action": ev["action"], "time": time.time(), "seen_step": hit["step"]})
        while alive():
            if time.monotonic() > deadline:
                raise RuntimeError(f"torchrun did not finish in {args.torchrun_timeout} s (see {workdir})")
            time.sleep(0.1)
    finally:
        for a in agents:
            _kill_tree(a.pid)
        for f in files:
            f.close()
    shutil.rmtree(workdir / "ckpt", ignore_errors=True)
    rows = read(log)
    execs = _mark_counted([Execution(r["step"], r["time"] - r["seconds"], r["time"], r["world"]) for r in rows])
    result = goodput(execs, args.global_batch * args.seq_length)
    if result["counted_steps"] != args.steps:
        raise RuntimeError(f"torchrun trained {result['counted_steps']} of {args.steps} steps (see {workdir})")
    result["run_seconds"] = time.time() - t_run
    result["checkpoint_every"] = args.checkpoint_every
    result["actions"] = actions
    result["saves"] = [{"step": s["step"], "seconds": s["time"] - s["start"]} for s in read(saves)]
    return result


# ---- output ----------------------------------------------------------------------------------

def plot(seed_result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES if m in seed_result["modes"]]
    fig, axes = plt.subplots(len(modes), 1, figsize=(11, 2.8 * len(modes)), sharex=True, squeeze=False)
    tokens_per_step = seed_result["tokens_per_step"]
    for ax, mode in zip(axes[:, 0], modes):
        r = seed_result["modes"][mode]
        tl = sorted(r["timeline"], key=lambda e: e["end"])
        counted = [e for e in tl if e["counted"]]
        xs, ys = [], []
        prev = 0.0
        for e in counted:  # tokens/s between consecutive counted step ends (pauses show as dips)
            xs += [prev, e["end"]]
            ys += [tokens_per_step / max(e["end"] - prev, 1e-9)] * 2
            prev = e["end"]
        ax.plot(xs, ys, color="tab:blue", lw=1.2, label="throughput (tokens/s)")
        red = [e for e in tl if not e["counted"]]
        for e in red:
            ax.axvspan(e["start"], e["end"], color="tab:red", alpha=0.25, lw=0)
        ax.set_ylabel("tokens/s")
        ax.set_ylim(0, max(ys) * 1.15 if ys else 1)
        ax2 = ax.twinx()
        wx, wy = [], []
        for e in sorted(tl, key=lambda e: e["start"]):  # 0 where no world trains for over a second
            if wx and e["start"] - wx[-1] > 1.0:
                wx.append(wx[-1])
                wy.append(0)
            wx += [e["start"], e["end"]]
            wy += [e["world"]] * 2
        ax2.plot(wx, wy, color="tab:green", lw=1.5, drawstyle="steps-post", label="world size (training)")
        ax2.set_ylim(0, seed_result["nodes"] + 0.5)
        ax2.set_yticks(range(seed_result["nodes"] + 1))
        ax2.set_ylabel("world size")
        step_end = {e["step"]: e["end"] for e in counted}
        for ev in seed_result["trace"]["events"]:
            x = step_end.get(ev["step"])
            if x is not None:
                ax.axvline(x, color="grey", ls=":", lw=0.8)
                ax.text(x, ax.get_ylim()[1] * 0.97, f"{ev['action']} ({ev['cause']})", rotation=90, va="top",
                        ha="right", fontsize=7, color="dimgrey")
        ax.set_title(f"{mode}: goodput {100 * r['goodput']:.1f}%, wall {r['wall_seconds']:.0f} s, "
                     f"{r['redone_steps']} steps redone (red)", fontsize=9)
    axes[-1, 0].set_xlabel("seconds since the first step started")
    fig.suptitle(f"{seed_result['model']}, {seed_result['nodes']} nodes, trace seed {seed_result['seed']}: "
                 f"{seed_result['trace']['localrun']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(seed_result: dict) -> dict:
    m = seed_result["modes"]
    live = m.get("live", {}).get("goodput_loss")
    out = {}
    for mode in ("checkpoint", "torchrun"):
        if mode in m and live:
            out[f"{mode}_loss_over_live"] = m[mode]["goodput_loss"] / live
            out[f"{mode}_steady_loss_over_live"] = m[mode]["goodput_steady_loss"] / m["live"]["goodput_steady_loss"]
    return out


def print_table(seed_result: dict) -> None:
    print(f"\nseed {seed_result['seed']}: {seed_result['trace']['localrun']}")
    print(f"{'mode':<11} {'wall s':>7} {'useful s':>8} {'goodput':>8} {'loss':>6} {'steady gp':>9} {'redone':>6} "
          f"{'lost: redone s':>14} {'other s':>7} {'tokens':>7} {'tok/s':>6}")
    for mode in MODES:
        r = seed_result["modes"].get(mode)
        if not r:
            continue
        print(f"{mode:<11} {r['wall_seconds']:>7.1f} {r['useful_seconds']:>8.1f} {100 * r['goodput']:>7.2f}% "
              f"{100 * r['goodput_loss']:>5.2f}% {100 * r['goodput_steady']:>8.2f}% {r['redone_steps']:>6} "
              f"{r['lost_redone_seconds']:>14.1f} {r['lost_other_seconds']:>7.1f} {r['tokens_trained']:>7} "
              f"{r['tokens_per_second']:>6.1f}")
    for k, v in summary(seed_result).items():
        print(f"{k}: {v:.1f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-125m")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--nodes", type=int, default=2, help="the spot pool: nodes, one worker each")
    p.add_argument("--global-batch", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--cloud", choices=sorted(NOTICE_SECONDS), default="aws")
    p.add_argument("--band", choices=list(BANDS), default=">20%")
    p.add_argument("--interruptions", type=int, default=3)
    p.add_argument("--ref-step-seconds", type=float, default=10.0)
    p.add_argument("--min-gap", type=int, default=3)
    p.add_argument("--checkpoint-every", type=int, default=10, help="checkpoint mode and torchrun")
    p.add_argument("--live-checkpoint-every", type=int, default=0)
    p.add_argument("--heartbeat-timeout", type=float, default=3.0, help="the coordinator's default")
    p.add_argument("--torchrun-timeout", type=float, default=1500.0)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--trace-only", action="store_true", help="print the traces and stop")
    p.add_argument("--out", default=str(HERE / "results" / "goodput.json"))
    args = p.parse_args()
    modes = args.modes.split(",")
    out = Path(args.out)
    result: dict = json.loads(out.read_text()) if out.exists() else {}
    result.update({"model": args.model, "machine": f"{os.cpu_count()} CPU cores, gloo", "steps": args.steps,
                   "nodes": args.nodes, "global_batch": args.global_batch, "seq_length": args.seq_length})
    result.setdefault("seeds", {})
    root = None if args.trace_only else Path(tempfile.mkdtemp(prefix="liveshard-goodput-"))
    for seed in args.seeds:
        trace = make_trace(args.steps, seed, nodes=args.nodes, cloud=args.cloud, band=args.band,
                           interruptions=args.interruptions, ref_step_seconds=args.ref_step_seconds,
                           min_gap=args.min_gap)
        print(f"seed {seed}: {trace['localrun']}  (stands for {trace['represents_days']:.0f} days of the pool)")
        if args.trace_only:
            continue
        entry = {"seed": seed, "model": args.model, "nodes": args.nodes,
                 "tokens_per_step": args.global_batch * args.seq_length, "trace": trace, "modes": {}}
        old = result["seeds"].get(str(seed), {})
        if old.get("trace", {}).get("localrun") == trace["localrun"]:
            entry["modes"] = {m: r for m, r in old.get("modes", {}).items() if m not in modes}
        for mode in modes:
            print(f"--- seed {seed}, {mode}", file=sys.stderr, flush=True)
            d = root / f"seed{seed}-{mode}"
            try:
                entry["modes"][mode] = run_torchrun(args, trace, d) if mode == "torchrun" else \
                    run_liveshard(args, trace, mode, d)
            except Exception as e:  # one mode failing leaves the others' figures
                print(f"seed {seed}, {mode} failed: {e}", file=sys.stderr, flush=True)
                entry.setdefault("errors", {})[mode] = str(e)
                for ckpt in ("checkpoints", "ckpt"):
                    shutil.rmtree(d / ckpt, ignore_errors=True)
        live, ckpt = entry["modes"].get("live"), entry["modes"].get("checkpoint")
        if live and ckpt:
            entry["live_checkpoint_bit_identical"] = bool(live["checksums"]) and live["checksums"] == ckpt["checksums"]
        entry["summary"] = summary(entry)
        png = out.parent / f"goodput_seed{seed}.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        plot(entry, png)
        entry["figure"] = png.name
        result["seeds"][str(seed)] = entry
        out.write_text(json.dumps(result, indent=1))
        print_table(entry)
    if not args.trace_only:
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
