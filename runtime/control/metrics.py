"""Prometheus metrics a job's coordinator exports: training progress, goodput, reconfigurations.

Each ``JobMetrics`` has its own ``CollectorRegistry``: the process-wide default registry would
make two coordinators in one process (tests, the local demo) collide on metric names, and it
keeps the job's endpoint free of the operator's metrics. Every series carries a ``job`` label;
the chart's PodMonitor scrapes with ``honorLabels`` so it is not renamed to ``exported_job``.

The coordinator sees heartbeats, not steps: ``observe_heartbeats`` turns the heartbeats of the
running world into progress and goodput (``GoodputTracker``), and ``observe_generation`` records
what ``Coordinator._finish`` decided about a generation and the phase timings its members reported.
``observe_store_tampering`` exports what the coordinator's ``JobStore`` found forged, replayed or
deleted in the job's store (``JobStore.tampering_counts``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

__all__ = ["OUTCOMES", "PHASES", "TAMPERING_KINDS", "GoodputTracker", "JobMetrics"]

# The phase timings workers put in their MemberResult (agent/switch.py), the coordinator keeps
# the slowest member's: a live switch reports prepare, transfer, commit and downtime (stop of
# training to training again); a switch through a checkpoint reports prepare, save, build, load.
PHASES = ("prepare", "transfer", "commit", "downtime", "save", "build", "load")
OUTCOMES = ("committed", "aborted")
# The kinds of store tampering a reader tells apart (control.store.Seen, less valid and absent).
TAMPERING_KINDS = ("forged", "replayed", "deleted")
# Reconfigurations take from a fraction of a second (a small live switch) to minutes (a restore).
RECONFIGURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class GoodputTracker:
    """Seconds spent in steps that count, and wall seconds, since the first step it saw.

    Heartbeats are samples: between two, the job may have done several steps, each taking
    about the latest ``step_seconds``. A step that goes backwards (a restore from a checkpoint)
    un-counts the steps that were lost, at the average step time so far. Reconfigurations,
    restores and stalls are in the wall time but not in the productive time.
    """

    def __init__(self) -> None:
        self.first_time: float | None = None
        self.step: int | None = None
        self.productive_seconds = 0.0
        self.counted_steps = 0

    def update(self, step: int, step_seconds: float | None, now: float) -> tuple[float, float]:
        """(productive seconds, wall seconds) after seeing the job at ``step`` at time ``now``."""
        if self.step is None or self.first_time is None:
            self.step, self.first_time = step, now
            return 0.0, 0.0
        if step > self.step and step_seconds is not None and step_seconds > 0:
            self.productive_seconds += (step - self.step) * step_seconds
            self.counted_steps += step - self.step
        elif step < self.step and self.counted_steps:
            lost = min(self.step - step, self.counted_steps)
            self.productive_seconds -= lost * self.productive_seconds / self.counted_steps
            self.counted_steps -= lost
        self.step = step
        return self.productive_seconds, now - self.first_time


class JobMetrics:
    """The metrics of one job, in a registry of their own (``registry``), labelled ``job``."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.registry = CollectorRegistry()
        self.goodput = GoodputTracker()

        # Gauges get their series on first set: before the first step there is no loss, not a loss of 0.
        self.gauges = {name: Gauge(name, doc, ["job"], registry=self.registry) for name, doc in (
            ("liveshard_job_step", "Optimizer steps done (the newest step any member reports)"),
            ("liveshard_job_train_iters", "Optimizer steps the job trains for"),
            ("liveshard_job_loss", "Training loss of the newest step (last pipeline stage)"),
            ("liveshard_job_tokens_per_second", "Tokens of the global batch per second of step time"),
            ("liveshard_job_world_size", "Training ranks in the running world"),
            ("liveshard_job_generation", "Generation of the running world plan"),
            ("liveshard_job_goodput_ratio", "Time in steps that count over wall time since the first step"),
            ("liveshard_job_consumed_samples", "Training samples consumed"),
            ("liveshard_job_checkpoint_failures", "Checkpoint saves that failed (a full disk, an I/O error)"),
            ("liveshard_job_checkpoint_step", "Step of the newest complete checkpoint"),
        )}
        self.device_speed = Gauge("liveshard_device_relative_speed",
                                  "Compute speed of a device relative to the job's median device (forward and "
                                  "backward per unit of work, waits excluded)", ["job", "device"],
                                  registry=self.registry)
        self.device_straggler = Gauge("liveshard_device_straggler",
                                      "1 while the device is a straggler (slower than the threshold for a window)",
                                      ["job", "device"], registry=self.registry)
        self.adaptive_switches = Counter("liveshard_job_adaptive_switches",
                                         "Switches the straggler policy made", ["job"], registry=self.registry)
        self.adaptive_switches.labels(job=job)
        self._devices: set[str] = set()
        self.reconfiguration_seconds = Histogram(
            "liveshard_job_reconfiguration_seconds",
            "Seconds of each phase of a committed reconfiguration (slowest member), by phase",
            ["job", "phase"], buckets=RECONFIGURATION_BUCKETS, registry=self.registry)
        self.reconfigurations = Counter("liveshard_job_reconfigurations",
                                        "Reconfigurations the coordinator finished, by outcome",
                                        ["job", "outcome"], registry=self.registry)
        # Series that exist from the start read 0 instead of "no data", and rate() sees the first one.
        for outcome in OUTCOMES:
            self.reconfigurations.labels(job=job, outcome=outcome)
        for phase in ("prepare", "transfer", "commit", "downtime"):
            self.reconfiguration_seconds.labels(job=job, phase=phase)
        self.store_tampering = Counter("liveshard_store_tampering",
                                       "Values in the job's store the coordinator found forged (no valid MAC), "
                                       "replayed (older than one it accepted) or deleted, by kind",
                                       ["job", "kind"], registry=self.registry)
        for kind in TAMPERING_KINDS:
            self.store_tampering.labels(job=job, kind=kind)

    # ---- observations ------------------------------------------------------------------------
    def observe_progress(self, step: int, train_iters: int | None, loss: float | None,
                         tokens_per_second: float | None, world_size: int, generation: int,
                         consumed_samples: int | None) -> None:
        """The job's progress; a None leaves that gauge at its last value."""
        for name, value in (("step", step), ("world_size", world_size), ("generation", generation),
                            ("train_iters", train_iters), ("loss", loss),
                            ("tokens_per_second", tokens_per_second), ("consumed_samples", consumed_samples)):
            if value is not None:
                self._set(name, value)

    def _set(self, name: str, value: float) -> None:
        self.gauges[f"liveshard_job_{name}"].labels(job=self.job).set(value)

    def observe_generation(self, outcome: str, phases: Mapping[str, float]) -> None:
        """A finished generation: ``outcome`` as ``Coordinator._finish`` writes it ("committed"
        or "aborted: <why>"), ``phases`` its per-phase seconds. Phase timings are observed for
        committed generations only: an aborted one's time is lost, which goodput shows."""
        kind = outcome.split(":", 1)[0].strip()
        if kind not in OUTCOMES:
            raise ValueError(f"outcome must be 'committed' or 'aborted[: why]', got {outcome!r}")
        self.reconfigurations.labels(job=self.job, outcome=kind).inc()
        if kind != "committed":
            return
        for phase, seconds in phases.items():
            if phase in PHASES:  # a fixed label set: no series for names a future worker invents
                self.reconfiguration_seconds.labels(job=self.job, phase=phase).observe(seconds)

    def observe_checkpoints(self, report: Mapping[str, Any]) -> None:
        """The coordinator's checkpoint report (``Coordinator._checkpoints``)."""
        failed, latest = report.get("failed") or {}, report.get("latest") or {}
        self._set("checkpoint_failures", float(failed.get("count") or 0))
        if latest.get("step") is not None:
            self._set("checkpoint_step", float(latest["step"]))

    def observe_speeds(self, health: Mapping[str, Any]) -> None:
        """The coordinator's straggler summary (``SpeedTracker.summary``); devices no longer
        measured lose their series."""
        members = health.get("members") or {}
        slow = set(health.get("stragglers") or ())
        for device in self._devices - set(members):
            self.device_speed.remove(self.job, device)
            self.device_straggler.remove(self.job, device)
        self._devices = set(members)
        for device, m in members.items():
            self.device_speed.labels(job=self.job, device=device).set(float(m.get("speed") or 1.0))
            self.device_straggler.labels(job=self.job, device=device).set(1.0 if device in slow else 0.0)
        switches = int((health.get("adaptive") or {}).get("switches") or 0)
        counted = self.adaptive_switches.labels(job=self.job)._value.get()
        if switches > counted:
            self.adaptive_switches.labels(job=self.job).inc(switches - counted)

    def observe_store_tampering(self, counts: Mapping[str, int]) -> None:
        """The coordinator store's tampering totals by kind (``JobStore.tampering_counts``): the
        counter goes up by what is new since the last call; unknown kinds are ignored."""
        for kind in TAMPERING_KINDS:
            total = int(counts.get(kind) or 0)
            counted = self.store_tampering.labels(job=self.job, kind=kind)._value.get()
            if total > counted:
                self.store_tampering.labels(job=self.job, kind=kind).inc(total - counted)

    def observe_goodput(self, productive_seconds: float, wall_seconds: float) -> None:
        if wall_seconds <= 0:
            return
        # Sampled step times can add up to a hair over the wall time: a ratio is at most 1.
        self._set("goodput_ratio", min(1.0, max(0.0, productive_seconds / wall_seconds)))

    def observe_heartbeats(self, heartbeats: Mapping[str, Mapping[str, Any]], members: Iterable[str], *,
                           generation: int, train_iters: int | None = None,
                           tokens_per_step: int | None = None, now: float | None = None) -> None:
        """Progress and goodput from the running world's heartbeats (``Coordinator.telemetry``).

        The step is the newest any member reports; the loss comes from a member at that step
        that knows it (the last pipeline stage); the step time is the slowest such member's (a
        synchronous step ends when its slowest rank does). ``tokens_per_step``: global batch x
        sequence length; consumed samples are read from a heartbeat's ``consumed_samples`` if
        workers send it. Does nothing before any member has reported a step.
        """
        members = tuple(members)
        beats = [heartbeats[m] for m in members if m in heartbeats and heartbeats[m].get("step") is not None]
        if not beats:
            return
        step = max(int(hb["step"]) for hb in beats)
        newest = [hb for hb in beats if int(hb["step"]) == step]
        loss = next((float(hb["loss"]) for hb in newest if hb.get("loss") is not None), None)
        times = [float(hb["step_seconds"]) for hb in newest if hb.get("step_seconds")]
        step_seconds = max(times) if times else None
        samples = [int(hb["consumed_samples"]) for hb in beats if hb.get("consumed_samples") is not None]
        tokens_per_second = (tokens_per_step / step_seconds) if tokens_per_step and step_seconds else None
        self.observe_progress(step, train_iters, loss, tokens_per_second, len(members), generation,
                              max(samples) if samples else None)
        productive, wall = self.goodput.update(step, step_seconds, time.time() if now is None else now)
        self.observe_goodput(productive, wall)

    # ---- export ------------------------------------------------------------------------------
    def serve(self, port: int, addr: str = "0.0.0.0") -> Any:
        """Serve ``/metrics`` from a daemon thread; returns the HTTP server (``server_port``,
        ``shutdown()``). Port 0 picks a free port."""
        server, _thread = start_http_server(port, addr, registry=self.registry)
        return server

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format, as a scrape would see it."""
        return generate_latest(self.registry)
