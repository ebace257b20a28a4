"""Per-device health for straggler-aware planning: compute speed, and GPU health through NVML.

``gpu_health()`` reads the worker's GPU with nvidia-ml-py (clocks, throttle reasons, temperature,
ECC errors, power); without a GPU or NVML it returns ``None`` — not an error. ``SpeedTracker``
turns the compute measurements in the heartbeats the coordinator collects into what the job's
status shows: each device's relative speed and which devices are stragglers.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

# NVML throttle-reason bits that mean "slowed down by the hardware", not by being idle.
_THROTTLE_BITS = {
    0x0000000000000002: "applications_clocks",
    0x0000000000000004: "sw_power_cap",
    0x0000000000000008: "hw_slowdown",
    0x0000000000000020: "sw_thermal_slowdown",
    0x0000000000000040: "hw_thermal_slowdown",
    0x0000000000000080: "hw_power_brake_slowdown",
}


# The reasons that mean the GPU itself is slowed (not an application clock or power cap it was set to).
HARDWARE_THROTTLE = frozenset({"hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown"})


@lru_cache(maxsize=1)
def _nvml() -> Any:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # no driver, no GPU, or nvidia-ml-py missing
        return None


def _device_index() -> int:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.current_device()
    except Exception:
        pass
    visible = os.environ.get("LOCAL_RANK")
    return int(visible) if visible and visible.isdigit() else 0


def gpu_health() -> dict | None:
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        h = nvml.nvmlDeviceGetHandleByIndex(_device_index())
        reasons = nvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)
        out: dict[str, Any] = {
            "sm_clock_mhz": nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM),
            "max_sm_clock_mhz": nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_SM),
            "temperature_c": nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),
            "power_w": nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
            "throttle": sorted(name for bit, name in _THROTTLE_BITS.items() if reasons & bit),
        }
        with contextlib.suppress(Exception):  # ECC not supported on this GPU
            out["ecc_uncorrected"] = nvml.nvmlDeviceGetTotalEccErrors(
                h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
        xid = _poll_xid(nvml, h)
        if xid is not None:
            out["last_xid"] = xid
        return out
    except Exception as e:
        return {"error": str(e)[:120]}


_xid: dict[str, Any] = {"set": None, "last": None, "registered": False}


def _poll_xid(nvml: Any, handle: Any) -> int | None:
    """The newest critical XID error of this GPU (a driver-reported fault: 79 fallen off the bus,
    48 double-bit ECC, 63/64 row remapping...), polled without waiting; None when there was none
    or the driver does not deliver events (e.g. inside a container without them)."""
    with contextlib.suppress(Exception):
        if not _xid["registered"]:
            _xid["registered"] = True
            events = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
            _xid["set"] = events
        if _xid["set"] is not None:
            while True:
                data = nvml.nvmlEventSetWait_v2(_xid["set"], 0)
                _xid["last"] = int(data.eventData)
    return _xid["last"]


def _lower_quartile(values: Iterable[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 4]


# CONFIRM_STEPS slow steps whose mean speed is below SEVERE_SPEED are a change point. Simulated
# with ±35 % uniform noise per step (4 devices, 300 seeds each): a 2x slowdown is found within 4
# steps 96 % of the time, within 5 98 %, a 2.9x one always within 3; a healthy device is never
# found in 200 steps, and one that a busy host slows 3x for 1-2 steps at 5 % of steps in 16 % of
# 200-step runs (against 36-54 % for rules without the per-step conditions).
SEVERE_SPEED = 0.62
CONFIRM_STEPS = 4
# A sharper slowdown is found a step sooner: SHARP_CONFIRM_STEPS steps, each below the threshold,
# whose mean speed is below SHARP_SPEED. A device at 0.4x under ±35 % noise is at most 0.62 in
# any step (0.41 on average): it is found in 3 steps nearly always; a healthy one under that noise
# is never below 0.74 in a step, and a busy host's burst must fill all 3 steps.
SHARP_SPEED = 0.55
SHARP_CONFIRM_STEPS = 3


@dataclass
class _Device:
    rates: deque  # (step, seconds per layer unit) since the last change point, newest last
    slow_since: float | None = None  # wall time the device became a straggler
    below_since: int | None = None  # the step from which its estimate has stayed below the threshold
    last_step: int | None = None  # the newest step taken (samples of older steps are repeats)
    throttled: bool = False
    last_rate: float | None = None  # kept when the device stops computing (standby)
    changed_at: int | None = None  # the step its window restarted at (a change point), if it did


class SpeedTracker:
    """Each device's compute speed from the members' heartbeats: a robust rolling estimate, and
    two ways of finding a straggler.

    A heartbeat's ``compute`` list holds ``[step, compute seconds, layer units]`` of the rank's
    recent steps (``agent.compute_clock``: forward and backward only, no waits); the rate is
    seconds per layer unit. Per device the estimate is the lower quartile of its rates over the
    last ``window`` steps since its last change point (a busy host only ever adds time:
    scheduling delays, a noisy neighbour's burst; a slow device is slow in every step, so its
    fast steps are slow too); the job's reference is the median of the estimates; a device's
    relative speed is reference / its estimate (1.0 = the median device, 0.5 = half as fast).

    - **A sharp slowdown** (a change point) is found in ``confirm`` steps: each of the device's
      newest ``confirm`` steps is slow against the other devices' median rate (below
      ``threshold + recover_margin``, all but one below ``threshold``) and their mean speed is
      below ``severe`` (each device measured against the others, so a world of two finds its
      slow half); or in ``SHARP_CONFIRM_STEPS`` (3) steps, each below ``threshold``, whose mean
      is below ``SHARP_SPEED``. Noise of a loaded host (±35 % per step) does not reach that, and
      a busy host's burst on one device must (nearly) fill those steps to. The device's window
      then restarts at the change point, so its estimate is the new speed, not a blend with the
      old.
    - **A mild one**: the speed has stayed below ``threshold`` for another ``window`` steps after
      a full window first put it there; or at once when its GPU reports hardware throttling.

    A straggler stops being one only when its speed is back above ``threshold +
    recover_margin``. Steps are deduplicated, so a heartbeat that repeats a step counts once.
    """

    def __init__(self, threshold: float = 0.7, window: int = 8, recover_margin: float = 0.1,
                 severe: float = SEVERE_SPEED, confirm: int = CONFIRM_STEPS) -> None:
        self.threshold = threshold
        self.window = window
        self.recover_margin = recover_margin
        self.severe = min(severe, threshold)
        self.confirm = confirm
        self.devices: dict[str, _Device] = {}

    def observe(self, member: str, heartbeat: dict, now: float | None = None) -> None:
        """Take a heartbeat's new compute samples. Whatever is malformed (an older or foreign
        writer) is skipped, never raised: the coordinator's loop must go on."""
        device = self.devices.setdefault(member, _Device(deque(maxlen=self.window)))
        samples = heartbeat.get("compute") if isinstance(heartbeat, dict) else None
        for sample in samples if isinstance(samples, list) else ():
            try:
                step, seconds, units = int(sample[0]), float(sample[1]), float(sample[2])
            except Exception:
                continue
            if not (math.isfinite(seconds) and math.isfinite(units)) or units <= 0 or seconds <= 0:
                continue
            if device.last_step is not None and step <= device.last_step:
                continue  # seen (also across a new world's emptied window)
            device.last_step = step
            device.rates.append((step, seconds / units))
        health = heartbeat.get("health") if isinstance(heartbeat, dict) else None
        throttle = health.get("throttle") if isinstance(health, dict) else None
        device.throttled = isinstance(throttle, list) and bool(set(map(str, throttle)) & HARDWARE_THROTTLE)

    def forget(self, member: str) -> None:
        self.devices.pop(member, None)

    def restart_window(self, members: Iterable[str]) -> None:
        """A new world: its rates follow new work; older samples of these devices are dropped
        (the last estimate is kept for devices that stop computing)."""
        for m in members:
            d = self.devices.get(m)
            if d is not None:
                if d.rates:
                    d.last_rate = _lower_quartile(r for _, r in d.rates)
                d.rates.clear()
                d.below_since = None
                d.changed_at = None

    def rates(self, members: Iterable[str], full_only: bool = False) -> dict[str, float]:
        """Seconds per layer unit of each device with samples (``full_only``: of each device
        measured enough: a full window, or ``confirm`` steps since a change point)."""
        out = {}
        for m in members:
            d = self.devices.get(m)
            if d is None or not d.rates or (full_only and len(d.rates) < self._enough(d)):
                continue
            out[m] = _lower_quartile(r for _, r in d.rates)
        return out

    def decision_rates(self, members: Iterable[str]) -> dict[str, float] | None:
        """Every member's estimate, once each is measured enough to decide on: a full window,
        or ``confirm - 1`` steps once a change point found a straggler among them (a sharp
        slowdown is acted on at once, against what the others measured so far); None before."""
        members = list(members)
        sharp = any(self.devices[m].changed_at is not None and self.devices[m].slow_since is not None
                    for m in members if m in self.devices)
        least = self.confirm - 1 if sharp else None
        out = {}
        for m in members:
            d = self.devices.get(m)
            if d is None or not d.rates or len(d.rates) < (least or self._enough(d)):
                return None
            out[m] = _lower_quartile(r for _, r in d.rates)
        return out

    def _enough(self, d: _Device) -> int:
        """Samples a device's estimate needs: a full window, or since a change point the slow
        steps that found it."""
        return self.confirm - 1 if d.changed_at is not None else self.window

    def last_rate(self, member: str) -> float | None:
        d = self.devices.get(member)
        if d is None:
            return None
        return _lower_quartile(r for _, r in d.rates) if d.rates else d.last_rate

    def update(self, members: Iterable[str], now: float | None = None) -> None:
        """Move the hysteresis on: which of the running world's ``members`` are stragglers now
        (compared among themselves; devices that do not compute keep their state)."""
        now = time.time() if now is None else now
        members = list(members)
        self._find_change_points(members, now)
        rates = self.rates(members)
        if not rates:
            return
        reference = statistics.median(rates.values())
        for m, rate in rates.items():
            d = self.devices[m]
            speed = reference / rate if rate > 0 else 1.0
            full = len(d.rates) >= self._enough(d)
            newest = d.rates[-1][0]
            if full and speed < self.threshold:
                d.below_since = newest if d.below_since is None else d.below_since
            else:
                d.below_since = None
            held = d.below_since is not None and newest - d.below_since >= self.window
            if d.slow_since is None and (held or d.throttled):
                d.slow_since = now
            elif d.slow_since is not None and full and speed >= self.threshold + self.recover_margin \
                    and not d.throttled:
                d.slow_since = None

    def _find_change_points(self, members: list[str], now: float) -> None:
        """A device whose newest steps are all slow against the other devices is a straggler
        now, its window restarted at the first slow one of them: ``confirm`` steps (each below
        ``threshold + recover_margin``, all but one below ``threshold``, their mean below
        ``severe``), or ``SHARP_CONFIRM_STEPS`` steps each below ``threshold`` with their mean
        below ``SHARP_SPEED`` (a sharper slowdown, found a step sooner)."""
        sharp = min(SHARP_CONFIRM_STEPS, self.confirm)
        recent: dict[str, list[float]] = {}
        typical: dict[str, float] = {}
        for m in members:
            d = self.devices.get(m)
            if d is not None and d.rates:
                typical[m] = statistics.median(r for _, r in d.rates)
                if len(d.rates) >= sharp:
                    recent[m] = [r for _, r in list(d.rates)[-self.confirm:]]
        if len(typical) < 2:
            return
        for m, rs in recent.items():
            d = self.devices[m]
            if d.slow_since is not None:
                continue
            others = statistics.median(v for k, v in typical.items() if k != m)
            speeds = [others / r for r in rs]
            newest = speeds[-sharp:]
            # a busy host only adds time: one slow step among fast ones is not the device, so
            # every step must be slow, all but one clearly, and the mean by a margin
            if all(v < self.severe for v in newest) and sum(newest) / sharp < min(SHARP_SPEED, self.severe):
                start = len(speeds) - sharp  # a sharp slowdown: its first slow step is the change point
            elif len(speeds) >= self.confirm and self._slow_for_confirm(speeds):
                start = next(i for i, v in enumerate(speeds) if v < self.threshold)  # the change point
            else:
                continue
            kept = list(d.rates)[-len(speeds) + start:]
            d.rates = deque(kept, maxlen=d.rates.maxlen)
            d.changed_at, d.slow_since, d.below_since = kept[0][0], now, None

    def _slow_for_confirm(self, speeds: list[float]) -> bool:
        """``confirm`` steps' speeds: each below ``threshold + recover_margin``, all but one below
        ``threshold``, their mean below ``severe``."""
        fastest_first = sorted(speeds, reverse=True)
        return (fastest_first[0] < self.threshold + self.recover_margin and fastest_first[1] < self.threshold
                and sum(speeds) / len(speeds) < self.severe)

    def summary(self, members: Iterable[str]) -> dict:
        """Relative speed per device among ``members`` and which are stragglers (read-only:
        ``update`` moves the hysteresis)."""
        members = list(members)
        rates = self.rates(members)
        if not rates:
            return {"members": {}, "stragglers": []}
        reference = statistics.median(rates.values())
        out: dict[str, dict] = {}
        stragglers = []
        for m in sorted(rates):
            d = self.devices[m]
            speed = reference / rates[m] if rates[m] > 0 else 1.0
            out[m] = {"speed": round(speed, 3), "seconds_per_unit": rates[m], "samples": len(d.rates),
                      "throttled": d.throttled}
            if d.slow_since is not None:
                out[m]["slow_since"] = d.slow_since
                stragglers.append(m)
        return {"members": out, "stragglers": stragglers, "reference_seconds_per_unit": reference,
                "threshold": self.threshold, "window": self.window}
