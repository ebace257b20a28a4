"""Per-rank health for straggler-aware planning: step times, and GPU health through NVML.

``gpu_health()`` reads the worker's GPU with nvidia-ml-py (clocks, throttle reasons, temperature,
ECC errors, power); without a GPU or NVML it returns ``None`` — not an error. ``summarize``
turns the heartbeats the coordinator collects into what the job's status shows: per-member
median step time, relative speed, and which members are stragglers.
"""

from __future__ import annotations

import contextlib
import os
import statistics
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
        return out
    except Exception as e:
        return {"error": str(e)[:120]}


def summarize(heartbeats: dict[str, dict], history: dict[str, list[float]],
              straggler_ratio: float = 1.2) -> dict:
    """Per-member step time and relative speed from heartbeats (``history``: recent step times).

    A member is a straggler when its median step time exceeds the job's median by
    ``straggler_ratio`` or its GPU reports hardware throttling.
    """
    for member, hb in heartbeats.items():
        t = hb.get("step_seconds")
        if t:
            h = history.setdefault(member, [])
            if not h or h[-1] != t:
                h.append(t)
                del h[:-20]
    medians = {m: statistics.median(h) for m, h in history.items() if h}
    if not medians:
        return {"members": {}, "stragglers": []}
    job = statistics.median(medians.values())
    members = {}
    stragglers = []
    for m, med in sorted(medians.items()):
        health = heartbeats.get(m, {}).get("health") or {}
        throttled = bool(set(health.get("throttle", ())) & {"hw_slowdown", "hw_thermal_slowdown",
                                                            "sw_thermal_slowdown", "hw_power_brake_slowdown"})
        speed = job / med if med > 0 else 1.0
        members[m] = {"step_seconds": round(med, 4), "speed": round(speed, 3), "throttled": throttled}
        if med > straggler_ratio * job or throttled:
            stragglers.append(m)
    return {"members": members, "stragglers": stragglers, "job_step_seconds": round(job, 4)}
