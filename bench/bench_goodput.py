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
  notice (``--clouds``, default all four): AWS's two-minute Spot interruption notice; GCP's 30 s
  between the preemption notice (ACPI G2 soft off) and the hard stop; Azure's Preempt scheduled
  event, at its minimum notice of 30 s; GKE's graceful node shutdown of a Spot VM, which gives
  non-system pods 15 s of the VM's 30 s. On AWS, half of them (at least one) are preceded by an
  EC2 instance rebalance recommendation ("can arrive sooner than the two-minute notice"), 0-5
  minutes earlier (the lead is not published: an assumption); the others have none;
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
https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events (Preempt: minimum notice
30 s), https://cloud.google.com/kubernetes-engine/docs/concepts/spot-vms (15 s for non-system pods),
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
or closer than ``--min-gap`` steps, or have no join in the run. AWS and GCP draw from the seed
itself; Azure and GKE from streams of their own (``trace_stream``), so that a seed gives each of
them another trace (Azure's notice is GCP's).

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

**Step records.** Every step of a run must have a record, whatever died after it. A liveshard
worker appends each step's record to its step log (``liveshard worker --step-log``, one JSON line
flushed as the step is recorded: the line is in the kernel before the next step starts, so a
process SIGKILLed later leaves it) and writes its result file when it ends; the bench merges
both, each record once (``step_records``). torchrun's peer appends a line per step as well. A
step from 1 to the last with no record is a measurement error, never lost time: the run is
reported as failed (``records``) with the missing steps named, and the bench exits non-zero.

**A run that fails** (an aborted join that ends ``run-local``, a timeout) is reported as a
failure with its reason, in the table and the JSON; the other runs go on.

**Load.** ``--load`` runs a CPU burner beside every run (``--load-procs`` processes, one per
core by default, each spinning at the bench's own priority, which the job's processes inherit):
a busy node, as on a shared cluster. Its figures go under ``loaded`` in the JSON, a quiet run's
under ``quiet``.

**Runs.** By default every cloud with every seed (``--seeds``, default 1 2) in the three modes;
``--quick``: the first seed only, live mode only (unless ``--modes``). On the 2-core development
machine, shared with other work, a live run took 5-6 minutes and checkpoint mode and torchrun about
10 each: the quick run about 20 minutes, the default (8 traces, 3 modes each) 2-3 hours.

Writes ``bench/results/goodput.json`` (per condition, per cloud: each seed's runs and a summary:
goodput pooled over the seeds, lowest, highest, failures, loss ratios) and prints a table per
run and one per cloud. ``--plot``: a PNG per run with one panel per mode: world size and
throughput (tokens/s between consecutive step ends) over wall time, the trace's events marked,
redone executions in red.
"""

from __future__ import annotations

import argparse
import contextlib
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
# From the notice to the node's stop: AWS's Spot interruption notice; GCP's preemption notice (ACPI
# G2 soft off) to the stop; Azure's Preempt scheduled event (its minimum notice); GKE's graceful node
# shutdown, which gives non-system pods 15 s of the VM's 30 s.
NOTICE_SECONDS = {"aws": 120.0, "gcp": 30.0, "azure": 30.0, "gke": 15.0}
CLOUDS = tuple(NOTICE_SECONDS)
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


def trace_stream(cloud: str, seed: int) -> int | str:
    """The random stream a cloud's trace of ``seed`` is drawn from. AWS and GCP draw from the
    seed itself (their traces are the ones earlier runs measured); Azure has GCP's notice and
    GKE nearly so, so they draw from streams of their own and get other traces."""
    return seed if cloud in ("aws", "gcp") else f"{cloud}:{seed}"


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
    rng = random.Random(trace_stream(cloud, seed))
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


class MissingRecords(RuntimeError):
    """A run trained steps the bench found no record of: a measurement error, never lost time."""

    def __init__(self, missing: list[int], last: int, where: str = "") -> None:
        self.missing, self.last = missing, last
        super().__init__(f"{where + ': ' if where else ''}no record of step(s) {step_ranges(missing)} "
                         f"of 1-{last} ({len(missing)} missing)")


def step_ranges(steps: list[int]) -> str:
    """``[1, 2, 3, 7, 9, 10]`` -> ``"1-3, 7, 9-10"``."""
    out: list[str] = []
    for s in sorted(set(steps)):
        if out and s == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{s}"
        else:
            out.append(str(s))
    return ", ".join(out)


def step_records(workdir: Path) -> list[dict]:
    """Every step record a ``run-local`` run's workers left, each once. Two sources: the step
    logs (``ID.steps.jsonl``, a line appended and flushed as each step is made: they survive the
    death of their process) and the result files (``ID.json``, written when a worker ends: a
    worker SIGKILLed later leaves none). A record is one worker's one step in one generation at
    one time; found in both, it is kept once."""
    from liveshard.runtime.agent.step_log import read_step_log

    seen: dict[tuple, dict] = {}

    def add(wid: str, rec: dict) -> None:
        key = (wid, rec["generation"], rec["step"], round(float(rec["time"]), 6))
        seen.setdefault(key, {**rec, "id": wid})

    for f in sorted(workdir.glob("*.steps.jsonl")):
        for rec in read_step_log(f):
            add(str(rec.get("id", f.name.removesuffix(".steps.jsonl"))), rec)
    for f in sorted(workdir.glob("*.json")):
        if f.name == "run.json":
            continue
        try:
            data = json.loads(f.read_text())
        except (json.JSONDecodeError, OSError):
            continue
        for rec in data.get("steps", []):
            add(str(data.get("id", f.stem)), rec)
    return list(seen.values())


def executions_of_records(records: list[dict]) -> list[Execution]:
    """The executions of a ``run-local`` run's step records: one per (segment, generation, step)
    that ran it (a checkpoint-mode restart starts a segment: its workers are named ``sNwM``), its
    end the last rank's, its duration the slowest rank's."""
    by_key: dict[tuple, dict] = {}
    for rec in records:
        wid = str(rec["id"])
        segment = wid.split("w")[0] if wid.startswith("s") else ""
        key = (segment, rec["generation"], rec["step"])
        cur = by_key.setdefault(key, {"end": rec["time"], "seconds": rec.get("seconds") or 0.0,
                                      "world": rec["world_size"]})
        cur["end"] = max(cur["end"], rec["time"])
        cur["seconds"] = max(cur["seconds"], rec.get("seconds") or 0.0)
    return _mark_counted([Execution(k[2], v["end"] - v["seconds"], v["end"], v["world"]) for k, v in by_key.items()])


def executions_of_localrun(workdir: Path) -> list[Execution]:
    """Every execution of every step of a ``run-local`` run (``step_records``)."""
    return executions_of_records(step_records(workdir))


def check_complete(execs: list[Execution], last: int, where: str = "") -> None:
    """Raise ``MissingRecords`` unless every step from 1 to ``last`` has an execution."""
    have = {e.step for e in execs}
    missing = [s for s in range(1, last + 1) if s not in have]
    if missing:
        raise MissingRecords(missing, last, where)


def event_pauses(execs: list[Execution], events: list[dict]) -> list[dict]:
    """Per trace event (at step S), the seconds training stood still for it: the longest time with
    no execution running between the end of the execution of step S that was running when the
    event came and the end of the next event's step (a change's pause, a loss's detection and
    recovery, a restart, which torchrun makes at its next rendezvous, a few steps after a join).
    Steps redone afterwards are not in it (they are lost time of their own). From the step
    records, like the goodput, so a worker that died leaves no hole in it."""
    evs = sorted(events, key=lambda ev: ev["step"])
    by_start = sorted(execs, key=lambda x: x.start)
    out: list[dict] = []
    after = -math.inf  # the previous event's step ended here
    for i, ev in enumerate(evs):
        label = f"{ev['step']}:{ev['action']}"
        cur = [e for e in execs if e.step == ev["step"] and e.end >= after]
        if not cur:
            out.append({"event": label, "action": ev["action"], "seconds": None})
            continue
        e0 = min(cur, key=lambda e: e.end)
        limit = math.inf
        if i + 1 < len(evs):
            ends = [e.end for e in execs if e.step == evs[i + 1]["step"] and e.end > e0.end]
            limit = min(ends, default=math.inf)
        window = [x for x in by_start if e0.end < x.end <= limit]
        longest, reach = 0.0, e0.end
        for x in window:
            longest = max(longest, x.start - reach)
            reach = max(reach, x.end)
        out.append({"event": label, "action": ev["action"], "seconds": longest if window else None})
        after = e0.end
    return out


def _execs_of_timeline(r: dict) -> list[Execution]:
    return [Execution(t["step"], t["start"], t["end"], t["world"], t["counted"]) for t in r.get("timeline", [])]


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
    shutil.rmtree(workdir / "checkpoints", ignore_errors=True)  # 1.5 GB per checkpoint
    execs = executions_of_localrun(workdir)
    check_complete(execs, args.steps, f"{mode} (records in {workdir})")
    result = goodput(execs, args.global_batch * args.seq_length)
    result["run_seconds"] = time.time() - t
    result["checkpoint_every"] = every
    result["events"] = [{k: ev.get(k) for k in ("event", "outcome", "downtime", "to_next_step", "config")}
                        for ev in report["events"]]
    result["checksums"] = report["checksums"]
    result["pauses"] = event_pauses(execs, trace["events"])
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

    def read(path: Path) -> list[dict]:  # a line torn by a kill mid-write is skipped
        from liveshard.runtime.agent.step_log import read_step_log

        return read_step_log(path) if path.exists() else []

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
    check_complete(execs, args.steps, f"torchrun (records in {log})")
    result = goodput(execs, args.global_batch * args.seq_length)
    result["run_seconds"] = time.time() - t_run
    result["checkpoint_every"] = args.checkpoint_every
    result["actions"] = actions
    result["saves"] = [{"step": s["step"], "seconds": s["time"] - s["start"]} for s in read(saves)]
    result["pauses"] = event_pauses(execs, trace["events"])
    return result


# ---- output ----------------------------------------------------------------------------------

def plot(seed_result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES if m in seed_result["modes"] and "failed" not in seed_result["modes"][m]]
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


class CpuBurner:
    """``procs`` processes that spin on a core each (``--load``): other work on the node. They run
    at the bench's own priority, which the job's processes inherit too (``nice`` applies to all)."""

    def __init__(self, procs: int) -> None:
        self.procs = procs
        self._running: list[subprocess.Popen] = []

    def __enter__(self) -> CpuBurner:
        for _ in range(self.procs):
            self._running.append(subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                                  stdin=subprocess.DEVNULL, start_new_session=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self._running:
            p.kill()
        for p in self._running:
            p.wait()
        self._running.clear()


def run_mode(args, trace: dict, mode: str, workdir: Path) -> dict:
    """One mode on one trace: its goodput figures, or a failure with its reason (``failed``:
    ``run``, the run itself failed; ``records``, the run trained steps the bench has no record of).
    A failure is reported, never raised: the other runs go on."""
    load0 = os.getloadavg()[0]
    t = time.time()
    try:
        with CpuBurner(args.load_procs) if args.load else contextlib.nullcontext():
            r = run_torchrun(args, trace, workdir) if mode == "torchrun" else run_liveshard(args, trace, mode, workdir)
    except MissingRecords as e:
        r = {"failed": "records", "reason": str(e), "missing_steps": e.missing}
    except Exception as e:  # the run failed (an aborted join that ended it, a timeout, a crash)
        r = {"failed": "run", "reason": f"{type(e).__name__}: {e}"}
    if "failed" in r:
        print(f"{trace['cloud']} seed {trace['seed']}, {mode} FAILED ({r['failed']}): {r['reason']}",
              file=sys.stderr, flush=True)
        r["run_seconds"] = time.time() - t
        for ckpt in ("checkpoints", "ckpt"):
            shutil.rmtree(workdir / ckpt, ignore_errors=True)
    r["loadavg_1min"] = [load0, os.getloadavg()[0]]  # at the start and at the end
    return r


def run_pauses(r: dict, trace: dict) -> list[dict]:
    """A run's per-event pauses (``event_pauses``, from its timeline)."""
    return event_pauses(_execs_of_timeline(r), trace.get("events", [])) if r.get("timeline") else r.get("pauses", [])


def pauses(r: dict, trace: dict) -> str:
    """A run's per-event pauses (stop of training to training again), ``step:event seconds``."""
    return ", ".join(f"{p['event']} {p['seconds']:.2f}s" if p["seconds"] is not None else f"{p['event']} -"
                     for p in run_pauses(r, trace))


def summary(seed_result: dict) -> dict:
    m = {k: v for k, v in seed_result["modes"].items() if "failed" not in v}
    live = m.get("live", {}).get("goodput_loss")
    out = {}
    for mode in ("checkpoint", "torchrun"):
        if mode in m and live:
            out[f"{mode}_loss_over_live"] = m[mode]["goodput_loss"] / live
            out[f"{mode}_steady_loss_over_live"] = m[mode]["goodput_steady_loss"] / m["live"]["goodput_steady_loss"]
    return out


def cloud_summary(seeds: dict[str, dict]) -> dict:
    """Per mode over a cloud's seeds: runs, failures, goodput pooled (useful seconds over wall
    seconds of every run that finished), lowest and highest; loss ratios of the pooled figures."""
    out: dict = {"seeds": sorted(int(s) for s in seeds), "modes": {}}
    for mode in MODES:
        runs = [e["modes"][mode] for e in seeds.values() if mode in e["modes"]]
        if not runs:
            continue
        ok = [r for r in runs if "failed" not in r]
        row: dict = {"runs": len(runs), "failed": len(runs) - len(ok),
                     "failures": [r["reason"] for r in runs if "failed" in r]}
        if ok:
            useful, wall = sum(r["useful_seconds"] for r in ok), sum(r["wall_seconds"] for r in ok)
            row.update({"goodput": useful / wall, "goodput_loss": 1.0 - useful / wall,
                        "goodput_min": min(r["goodput"] for r in ok), "goodput_max": max(r["goodput"] for r in ok),
                        "goodput_steady": sum(r["goodput_steady"] * r["wall_seconds"] for r in ok) / wall})
            by_kind: dict[str, list[float]] = {}
            for e in seeds.values():
                r = e["modes"].get(mode, {})
                if "failed" in r:
                    continue
                for pause in run_pauses(r, e.get("trace", {})):
                    if pause["seconds"] is not None:
                        by_kind.setdefault(pause["action"], []).append(pause["seconds"])
            if by_kind:
                row["pauses_seconds"] = {k: {"n": len(v), "median": statistics.median(v), "max": max(v)}
                                         for k, v in sorted(by_kind.items())}
        out["modes"][mode] = row
    live = out["modes"].get("live", {}).get("goodput_loss")
    for mode in ("checkpoint", "torchrun"):
        loss = out["modes"].get(mode, {}).get("goodput_loss")
        if live and loss is not None:
            out[f"{mode}_loss_over_live"] = loss / live
    return out


def print_table(seed_result: dict) -> None:
    t = seed_result["trace"]
    print(f"\n{t['cloud']} seed {seed_result['seed']}: {t['localrun']}")
    print(f"{'mode':<11} {'wall s':>7} {'useful s':>8} {'goodput':>8} {'loss':>6} {'steady gp':>9} {'redone':>6} "
          f"{'lost: redone s':>14} {'other s':>7} {'tokens':>7} {'tok/s':>6}")
    for mode in MODES:
        r = seed_result["modes"].get(mode)
        if not r:
            continue
        if "failed" in r:
            print(f"{mode:<11} FAILED ({r['failed']}): {r['reason']}")
            continue
        print(f"{mode:<11} {r['wall_seconds']:>7.1f} {r['useful_seconds']:>8.1f} {100 * r['goodput']:>7.2f}% "
              f"{100 * r['goodput_loss']:>5.2f}% {100 * r['goodput_steady']:>8.2f}% {r['redone_steps']:>6} "
              f"{r['lost_redone_seconds']:>14.1f} {r['lost_other_seconds']:>7.1f} {r['tokens_trained']:>7} "
              f"{r['tokens_per_second']:>6.1f}")
        print(f"{'':<11} pauses: {pauses(r, t)}")
    for k, v in summary(seed_result).items():
        print(f"{k}: {v:.1f}x")


def print_cloud_table(condition: str, clouds: dict[str, dict]) -> None:
    print(f"\n== goodput per cloud ({condition}) ==")
    print(f"{'cloud':<6} {'notice':>6} {'seeds':<9} {'mode':<11} {'goodput':>8} {'min':>7} {'max':>7} "
          f"{'failed':>6} {'loss/live':>9}")
    for cloud, c in clouds.items():
        s = c["summary"]
        for mode, row in s["modes"].items():
            gp = f"{100 * row['goodput']:>7.2f}%" if "goodput" in row else f"{'-':>8}"
            lo = f"{100 * row['goodput_min']:>6.2f}%" if "goodput_min" in row else f"{'-':>7}"
            hi = f"{100 * row['goodput_max']:>6.2f}%" if "goodput_max" in row else f"{'-':>7}"
            ratio = s.get(f"{mode}_loss_over_live")
            print(f"{cloud:<6} {c['notice_seconds']:>5.0f}s {','.join(map(str, s['seeds'])):<9} {mode:<11} {gp} "
                  f"{lo} {hi} {row['failed']:>3}/{row['runs']:<2} {f'{ratio:.1f}x' if ratio else '':>9}")
            if row.get("pauses_seconds"):
                print(f"{'':<6} {'':>6} {'':<9} {'':<11} pauses (median/max s): " + ", ".join(
                    f"{k} {v['median']:.2f}/{v['max']:.2f} (n={v['n']})" for k, v in row["pauses_seconds"].items()))
            for reason in row["failures"]:
                print(f"{'':<6} {'':>6} {'':<9} {'':<11} failed: {reason}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-125m")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--nodes", type=int, default=2, help="the spot pool: nodes, one worker each")
    p.add_argument("--global-batch", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="trace seeds, run on every cloud")
    p.add_argument("--clouds", default=",".join(CLOUDS),
                   help=f"comma-separated, of {', '.join(CLOUDS)} (notice windows: "
                        + ", ".join(f"{c} {NOTICE_SECONDS[c]:.0f} s" for c in CLOUDS) + ")")
    p.add_argument("--cloud", choices=CLOUDS, default=None, help="one cloud only (same as --clouds CLOUD)")
    p.add_argument("--quick", action="store_true",
                   help="the first seed only, and live mode only unless --modes is given")
    p.add_argument("--load", action="store_true",
                   help="run a CPU burner beside the job (--load-procs spinning processes); results go under "
                        "'loaded' in the JSON, a quiet run's under 'quiet'")
    p.add_argument("--load-procs", type=int, default=os.cpu_count() or 1, help="burner processes (default: one per core)")
    p.add_argument("--band", choices=list(BANDS), default=">20%")
    p.add_argument("--interruptions", type=int, default=3)
    p.add_argument("--ref-step-seconds", type=float, default=10.0)
    p.add_argument("--min-gap", type=int, default=3)
    p.add_argument("--checkpoint-every", type=int, default=10, help="checkpoint mode and torchrun")
    p.add_argument("--live-checkpoint-every", type=int, default=0)
    p.add_argument("--heartbeat-timeout", type=float, default=3.0, help="the coordinator's default")
    p.add_argument("--torchrun-timeout", type=float, default=1500.0)
    p.add_argument("--modes", default=None, help=f"comma-separated, of {', '.join(MODES)} (default: all)")
    p.add_argument("--plot", action="store_true", help="a PNG per run: world size and tokens/s over wall time")
    p.add_argument("--trace-only", action="store_true", help="print the traces and stop")
    p.add_argument("--table", action="store_true", help="print the tables of --out's results and stop")
    p.add_argument("--out", default=str(HERE / "results" / "goodput.json"))
    args = p.parse_args()
    clouds = [args.cloud] if args.cloud else [c for c in args.clouds.split(",") if c]
    if bad := [c for c in clouds if c not in NOTICE_SECONDS]:
        p.error(f"unknown cloud(s) {', '.join(bad)}: choose from {', '.join(CLOUDS)}")
    seeds = args.seeds[:1] if args.quick else args.seeds
    modes = args.modes.split(",") if args.modes else (["live"] if args.quick else list(MODES))
    condition = "loaded" if args.load else "quiet"
    out = Path(args.out)
    if args.table:
        stored = json.loads(out.read_text()).get("conditions", {})
        for name, cond in stored.items():
            for c in cond["clouds"].values():
                c["summary"] = cloud_summary(c["seeds"])
                for entry in c["seeds"].values():
                    print_table(entry)
            print_cloud_table(name, cond["clouds"])
        return 0
    result: dict = json.loads(out.read_text()) if out.exists() else {}
    if "conditions" not in result:
        result = {}  # an older layout: start afresh
    result.update({"model": args.model, "machine": f"{os.cpu_count()} CPU cores, gloo", "steps": args.steps,
                   "nodes": args.nodes, "global_batch": args.global_batch, "seq_length": args.seq_length,
                   "interruptions": args.interruptions, "band": args.band, "ref_step_seconds": args.ref_step_seconds})
    cond = result.setdefault("conditions", {}).setdefault(condition, {"clouds": {}})
    cond["load"] = {"burner_processes": args.load_procs, "priority": "the bench's own"} if args.load else None
    root = None if args.trace_only else Path(tempfile.mkdtemp(prefix="liveshard-goodput-"))
    missing: list[str] = []
    t_start = time.time()
    for cloud in clouds:
        c = cond["clouds"].setdefault(cloud, {"seeds": {}})
        c["notice_seconds"] = NOTICE_SECONDS[cloud]
        for seed in seeds:
            trace = make_trace(args.steps, seed, nodes=args.nodes, cloud=cloud, band=args.band,
                               interruptions=args.interruptions, ref_step_seconds=args.ref_step_seconds,
                               min_gap=args.min_gap)
            print(f"{cloud} seed {seed}: {trace['localrun']}  (stands for {trace['represents_days']:.0f} days "
                  f"of the pool)", flush=True)
            if args.trace_only:
                continue
            entry = {"seed": seed, "model": args.model, "nodes": args.nodes,
                     "tokens_per_step": args.global_batch * args.seq_length, "trace": trace, "modes": {}}
            old = c["seeds"].get(str(seed), {})
            if old.get("trace", {}).get("localrun") == trace["localrun"]:
                entry["modes"] = {m: r for m, r in old.get("modes", {}).items() if m not in modes}
            for mode in modes:
                print(f"--- {condition}, {cloud} seed {seed}, {mode}", file=sys.stderr, flush=True)
                r = run_mode(args, trace, mode, root / f"{cloud}-seed{seed}-{mode}")
                entry["modes"][mode] = r
                if r.get("failed") == "records":
                    missing.append(f"{condition} {cloud} seed {seed} {mode}: {r['reason']}")
                c["seeds"][str(seed)] = entry  # written after every run: an interrupted invocation keeps it
                c["summary"] = cloud_summary(c["seeds"])
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(result, indent=1))
            live, ckpt = entry["modes"].get("live"), entry["modes"].get("checkpoint")
            if live and ckpt and "failed" not in live and "failed" not in ckpt:
                entry["live_checkpoint_bit_identical"] = bool(live["checksums"]) and live["checksums"] == ckpt["checksums"]
            entry["summary"] = summary(entry)
            out.parent.mkdir(parents=True, exist_ok=True)
            if args.plot and any("failed" not in r for r in entry["modes"].values()):
                suffix = "_loaded" if args.load else ""
                png = out.parent / f"goodput_{cloud}_seed{seed}{suffix}.png"
                plot(entry, png)
                entry["figure"] = png.name
            c["seeds"][str(seed)] = entry
            c["summary"] = cloud_summary(c["seeds"])
            out.write_text(json.dumps(result, indent=1))
            print_table(entry)
    if args.trace_only:
        return 0
    print_cloud_table(condition, {k: v for k, v in cond["clouds"].items() if k in clouds})
    print(f"\n{time.time() - t_start:.0f} s; wrote {out}")
    if missing:
        for line in missing:
            print(f"MISSING STEP RECORDS: {line}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
