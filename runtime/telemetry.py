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


@dataclass
class _Device:
    rates: deque  # (step, seconds per layer unit), newest last
    slow_since: float | None = None  # wall time the device became a straggler
    below_since: int | None = None  # the step from which its estimate has stayed below the threshold
    last_step: int | None = None  # the newest step taken (samples of older steps are repeats)
    throttled: bool = False
    last_rate: float | None = None  # kept when the device stops computing (standby)


class SpeedTracker:
    """Each device's compute speed from the members' heartbeats: a robust rolling estimate.

    A heartbeat's ``compute`` list holds ``[step, compute seconds, layer units]`` of the rank's
    recent steps (``agent.compute_clock``: forward and backward only, no waits); the rate is
    seconds per layer unit. Per device the estimate is the lower quartile of its rates over the
    last ``window`` steps (a busy host only ever adds time: scheduling delays, a noisy neighbour's
    burst; a slow device is slow in every step, so its fast steps are slow too); the job's
    reference is the median of the estimates; a device's relative speed is reference / its
    estimate (1.0 = the median device, 0.5 = half as fast).

    Hysteresis: a device becomes a straggler once its speed has stayed below ``threshold`` for
    another ``window`` steps after a full window first put it there (or at once when its GPU
    reports hardware throttling), and stops being one only when its speed is back above
    ``threshold + recover_margin``. Steps are deduplicated, so a heartbeat that repeats a step
    counts once.
    """

    def __init__(self, threshold: float = 0.7, window: int = 8, recover_margin: float = 0.1) -> None:
        self.threshold = threshold
        self.window = window
        self.recover_margin = recover_margin
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

    def rates(self, members: Iterable[str], full_only: bool = False) -> dict[str, float]:
        """Median seconds per layer unit of each device with samples (with a full window only)."""
        out = {}
        for m in members:
            d = self.devices.get(m)
            if d is None or not d.rates or (full_only and len(d.rates) < self.window):
                continue
            out[m] = _lower_quartile(r for _, r in d.rates)
        return out

    def last_rate(self, member: str) -> float | None:
        d = self.devices.get(member)
        if d is None:
            return None
        return _lower_quartile(r for _, r in d.rates) if d.rates else d.last_rate

    def update(self, members: Iterable[str], now: float | None = None) -> None:
        """Move the hysteresis on: which of the running world's ``members`` are stragglers now
        (compared among themselves; devices that do not compute keep their state)."""
        now = time.time() if now is None else now
        rates = self.rates(members)
        if not rates:
            return
        reference = statistics.median(rates.values())
        for m, rate in rates.items():
            d = self.devices[m]
            speed = reference / rate if rate > 0 else 1.0
            full = len(d.rates) >= self.window
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
