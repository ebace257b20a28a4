"""The coordinator's side of the straggler loop: measurements in, at most one plan request out.

Every heartbeat's compute samples go to a ``telemetry.SpeedTracker``; its summary (relative
speed per device, stragglers with the time they became one) is the job's ``status.stragglers``
and the ``liveshard_device_relative_speed`` gauge. With ``AdaptivePolicy.enabled``, once every
member has a full window of measurements in the running world and a device is slow (or the
running plan is an adaptive one, which may be undone), ``planner.adapt.decide`` compares the
running plan with the best one for the measured speeds, and a switch becomes a ``PlanRequest``
with its numbers in ``decisions``.

Every switch is on trial: once its world has a window of step times, it is kept if the step got
faster and undone otherwise (then no switch for ``probation`` steps); how far the measured step
was from the prediction becomes the least gain the next switch must promise.

A device set aside for slowness stays on standby for ``probation`` steps (it cannot be measured
while it does not compute); after that the policy counts it healthy again and brings it back if
that pays, and measures it anew. Pure bookkeeping: the coordinator publishes the plans.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from liveshard.runtime.contract.causes import Cause
from liveshard.runtime.control.protocol import WorldPlan
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.planner.adapt import AdaptivePolicy, LayerCaps, decide
from liveshard.runtime.spec import ModelSpec
from liveshard.runtime.telemetry import SpeedTracker

log = logging.getLogger("liveshard.coordinator")

DEFAULT_SWITCH_SECONDS = 2.0  # the cost of a switch before one was measured
MAX_DECISIONS = 20  # kept in the status
MAX_LEAD_STEPS = 1000  # a switch's step is at most this far after the decision's


class StragglerLoop:
    def __init__(self, spec: ModelSpec, policy: AdaptivePolicy, *, global_batch: int, micro_batch: int,
                 seq_length: int, granularity: int = 1, layer_caps: LayerCaps | None = None,
                 allowed_pp: tuple[int, ...] | None = None, max_world: int | None = None) -> None:
        self.spec = spec
        self.policy = policy
        self.global_batch, self.micro_batch, self.seq_length = global_batch, micro_batch, seq_length
        self.granularity = granularity
        self.layer_caps = layer_caps
        self.allowed_pp, self.max_world = allowed_pp, max_world  # the job's constraints
        self.tracker = SpeedTracker(policy.threshold, policy.window)
        self.decisions: list[dict[str, Any]] = []  # every switch taken, and each new reason not to
        self.baseline: ParallelConfig | None = None  # the job's layout before its first adaptive switch
        self.adaptive_generations: set[int] = set()
        self.probation: dict[str, int] = {}  # device -> the step it was set aside at
        self.switches = 0
        self._proposed: dict[str, Any] | None = None  # a switch requested, not yet published
        self._evaluated_at = -1
        self._last_reason: str | None = None
        # step times per generation: {generation: {step: seconds of its slowest member}}
        self._step_seconds: dict[int, dict[int, float]] = {}
        # the switch on trial: the layout it left, the step time measured before, its generation
        self._trial: dict[str, Any] | None = None
        self._hold_until = -1  # no new switch before this step (after one that did not pay)
        # how far the newest switch's measured step was from its prediction (share of the step):
        # a later switch must promise more than that
        self.model_error = 0.0

    def set_policy(self, policy: AdaptivePolicy) -> None:
        log.info("straggler policy: %s", policy)
        self.policy = policy
        self.tracker.threshold, self.tracker.window = policy.threshold, policy.window
        for device in self.tracker.devices.values():
            device.rates = deque(device.rates, maxlen=policy.window)

    # ---- measurements --------------------------------------------------------------------
    def observe(self, member: str, heartbeat: dict[str, Any]) -> None:
        self.tracker.observe(member, heartbeat)
        gen, step, seconds = heartbeat.get("generation"), heartbeat.get("step"), heartbeat.get("step_seconds")
        if (isinstance(gen, int) and isinstance(step, int) and isinstance(seconds, int | float)
                and not isinstance(seconds, bool) and math.isfinite(seconds) and seconds > 0):
            steps = self._step_seconds.setdefault(gen, {})
            steps[step] = max(steps.get(step, 0.0), float(seconds))
            if len(steps) > 4 * self.policy.window:
                del steps[min(steps)]
            for old in [g for g in self._step_seconds if g < gen - 4]:
                del self._step_seconds[old]

    def measured_step(self, generation: int) -> float | None:
        """The median step time of the newest steps of ``generation`` (its first two steps, which
        pay a new world's one-off costs, left out); None before there are enough of them."""
        steps = self._step_seconds.get(generation) or {}
        recent = [steps[k] for k in sorted(steps)[2:]][-self.policy.window:]
        return statistics.median(recent) if len(recent) >= min(3, self.policy.window) else None

    def committed(self, plan: WorldPlan) -> None:
        """A new world runs: its rates follow new work, measure afresh."""
        self.tracker.restart_window(plan.members)
        if plan.generation not in self.adaptive_generations:
            self.baseline = None  # a plan from elsewhere (a loss, a scale change) is the job's layout now
            self.probation.clear()
        self._evaluated_at = -1

    def update(self, members: Iterable[str], *, now: float) -> None:
        """The running world's members measured against each other (the stragglers' hysteresis);
        ``now``: the observation's unix time (a straggler's ``slow_since``)."""
        self.tracker.update(members, now)

    def summary(self, members: Iterable[str]) -> dict[str, Any]:
        out = self.tracker.summary(members)
        out["adaptive"] = {"enabled": self.policy.enabled, "switches": self.switches,
                           "decisions": self.decisions[-MAX_DECISIONS:],
                           "probation": dict(self.probation)}
        return out

    # ---- the decision --------------------------------------------------------------------
    def consider(self, current: WorldPlan, step: int, measured_step: float | None,
                 history: Sequence[dict[str, Any]], steps_left: int | None = None, *, now: float) -> dict[str, Any] | None:
        """A plan request (``PlanRequest`` fields) when a switch pays, else None. ``steps_left``:
        the steps training has left (a switch must pay for itself before the end); ``now``: the
        observation's unix time (each decision record's ``time``)."""
        if not self.policy.enabled or current.is_stop or not current.members or not measured_step:
            return None
        if steps_left is not None and steps_left <= self.policy.window:
            return None  # too close to the end for a switch to pay
        if step < self._evaluated_at + max(1, self.policy.window // 2):
            return None  # at most every half window of steps
        rates = self.tracker.decision_rates(current.members)
        if rates is None:
            return None  # not every member is measured enough in this world yet
        measured = self.measured_step(current.generation)
        if self._trial is not None and self._trial["generation"] == current.generation:
            return None if measured is None else self._judge(current, step, measured, now, history)
        measured_step = measured or measured_step
        if step < self._hold_until:
            return None
        summary = self.tracker.summary(current.members)
        slow = summary["stragglers"]
        on_probation = [d for d, at in self.probation.items() if step - at < self.policy.probation]
        if not slow and self.baseline is None:
            return None
        self._evaluated_at = step
        for d in current.standbys:
            last = self.tracker.last_rate(d)
            if d in on_probation and last is not None:
                rates[d] = last
        cfg = ParallelConfig.parse(current.config)
        # A switch for a straggler must promise more than the last prediction missed by; going
        # back to the job's layout once every device is healthy needs only the usual gain.
        margin = min(0.5, self.model_error) if slow else 0.0
        policy = replace(self.policy, min_gain=max(self.policy.min_gain, margin))
        if steps_left is not None:
            policy = replace(policy, horizon=min(policy.horizon, steps_left))
        decision = decide(self.spec, cfg, current.members, current.standbys, rates, measured_step=measured_step,
                          switch_cost=self.switch_cost(history), policy=policy,
                          global_batch=self.global_batch, micro_batch=self.micro_batch,
                          seq_length=self.seq_length, granularity=self.granularity, slow_standbys=on_probation,
                          layer_caps=self.layer_caps, baseline=self.baseline, allowed_pp=self.allowed_pp,
                          max_world=self.max_world)
        record = {**decision.to_dict(), "step": step, "time": now, "stragglers": list(slow),
                  "speeds": {m: summary["members"][m]["speed"] for m in summary["members"]}}
        if not decision.switch:
            if decision.reason != self._last_reason:
                self._record(record, now)
                log.info("straggler policy at step %d: no switch (%s)", step, decision.reason)
            return None
        best = decision.best
        # applied once the coordinator has published it (taken), dropped if it refuses it (rejected)
        self._proposed = {"record": record, "step": step, "config": cfg, "best": best,
                          "trial": {"generation": None, "before": measured_step, "config": current.config,
                                    "members": current.members, "standbys": current.standbys,
                                    "predicted": decision.predicted_after}}
        return {"members": (*best.members, *best.standbys), "config": str(best.config),
                "reason": f"straggler policy: {decision.reason}", "cause": Cause.STRAGGLER.value, "ordered": True,
                "switch_at_step": step + self.switch_lead(history, measured_step)}

    def taken(self, generation: int, *, now: float) -> None:
        """The request was published as generation ``generation``: it counts now (``now``: the
        observation's unix time)."""
        self.adaptive_generations.add(generation)
        proposed, self._proposed = self._proposed, None
        if proposed is None:
            return
        self.switches += 1
        self._record(proposed["record"], now)
        log.warning("straggler policy at step %d: %s", proposed["step"], proposed["record"]["reason"])
        if proposed["trial"] is not None:
            self._trial = {**proposed["trial"], "generation": generation}
            if self.baseline is None:
                self.baseline = proposed["config"]
            for d in proposed["best"].standbys:
                if d in proposed["trial"]["members"]:
                    self.probation[d] = proposed["step"]
            for d in proposed["best"].members:
                self.probation.pop(d, None)

    def rejected(self, *, now: float) -> None:
        """The coordinator refused the request (it cannot place or feed that world): nothing
        changed; the policy looks again a window later."""
        proposed, self._proposed = self._proposed, None
        if proposed is not None:
            self._record({**proposed["record"], "switch": False, "kind": "refused",
                          "reason": f"the coordinator refused {proposed['record']['config']}"}, now)
            self._evaluated_at = proposed["step"] + self.policy.window

    def _judge(self, current: WorldPlan, step: int, measured: float, now: float,
               history: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
        """A switch on trial, measured: kept if the step got faster, else undone (the model was
        wrong for this job: no new switch for a probation)."""
        trial, self._trial = self._trial, None
        assert trial is not None  # judged only with a switch on trial
        self._evaluated_at = step
        before = trial["before"]
        self.model_error = abs(measured - trial["predicted"]) / measured
        if measured < before:
            self._record({"switch": False, "kind": "kept", "config": current.config, "step": step,
                          "reason": f"the switch paid: {measured:.4f} s/step measured against {before:.4f} before"},
                         now)
            return None
        self._hold_until = step + self.policy.probation
        reason = (f"the switch did not pay: {measured:.4f} s/step measured against {before:.4f} before; "
                  f"back to {trial['config']}, no new switch for {self.policy.probation} steps")
        record = {"switch": True, "kind": "undo", "config": trial["config"], "members": list(trial["members"]),
                  "standbys": list(trial["standbys"]), "step": step, "measuredStepSeconds": round(measured, 5),
                  "predictedStepSeconds": round(measured, 5), "predictedStepSecondsAfter": round(before, 5),
                  "time": now, "stragglers": [], "reason": reason}
        self._proposed = {"record": record, "step": step, "config": None, "best": None, "trial": None}
        return {"members": (*trial["members"], *trial["standbys"]), "config": trial["config"],
                "reason": f"straggler policy: {reason}", "cause": Cause.STRAGGLER.value, "ordered": True,
                "switch_at_step": step + self.switch_lead(history, measured)}

    def _record(self, decision: dict[str, Any], now: float) -> None:
        self.decisions.append({"time": now, "stragglers": [], **decision})
        del self.decisions[:-MAX_DECISIONS]
        self._last_reason = decision.get("reason")

    @staticmethod
    def switch_lead(history: Sequence[dict[str, Any]], step_seconds: float | None) -> int:
        """Steps from the step a decision saw to the step its switch follows (``switch_at_step``).

        A straggler makes every step slow, so the switch is bound in steps, not left to whenever
        every rank has prepared (on a loaded host that drifts by steps): the steps the last
        switches' preparation took (their median ``prepare`` phase over the step time), plus
        one; one before any was measured. Preparation runs while those steps train; a rank that
        reaches the step unprepared waits there for its own preparation."""
        prepares = [float(h["phases"]["prepare"]) for h in history[-5:]
                    if h.get("outcome") == "committed" and isinstance(h.get("phases"), dict)
                    and isinstance(h["phases"].get("prepare"), int | float)]
        if not prepares or not step_seconds or step_seconds <= 0:
            return 1
        return 1 + min(MAX_LEAD_STEPS, int(statistics.median(prepares) / step_seconds))

    @staticmethod
    def switch_cost(history: Sequence[dict[str, Any]]) -> float:
        """What the last committed live switches paused training for (their median)."""
        pauses = [float(h["downtime"]) for h in history[-5:]
                  if h.get("outcome") == "committed" and h.get("downtime")]
        return statistics.median(pauses) if pauses else DEFAULT_SWITCH_SECONDS
