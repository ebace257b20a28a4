"""The coordinator's Kubernetes plan source without a server: what it writes, and when again."""

from __future__ import annotations

import pytest

from liveshard.runtime.coordinator import kube_source
from liveshard.runtime.coordinator.kube_source import KubePlanSource


class FlakyStatus:
    """Stands in for the CustomObjectsApi: refuses the first ``failures`` status patches."""

    def __init__(self, failures: int, status: dict | None = None) -> None:
        self.failures = failures
        self.patches: list[dict] = []
        self.status = status or {}

    def patch_namespaced_custom_object_status(self, *args) -> None:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("503 the server is restarting")
        self.patches.append(args[-1]["status"])

    def get_namespaced_custom_object(self, *args) -> dict:
        return {"spec": {"model": {"preset": "tiny-gpt"}, "image": "x", "workers": {"max": 2},
                         "training": {"data": {"mock": True}, "trainIters": 1000, "globalBatch": 8}},
                "status": self.status}


@pytest.fixture
def source(monkeypatch):
    import kubernetes.client

    monkeypatch.setattr(kube_source.time, "sleep", lambda s: None)
    src = KubePlanSource(None, "j", "default", api=kubernetes.client.ApiClient())
    return src


def test_an_ack_the_api_refuses_is_written_at_the_next_report(source):
    source.custom = FlakyStatus(failures=5)
    source._ack(3, 1700000000.0)
    assert 3 not in source.answered and source.custom.patches == []
    source.report({"history": [], "telemetry": {}})
    assert 3 in source.answered
    assert source.custom.patches[0]["appliedGeneration"] == 3
    assert source.custom.patches[0]["appliedAt"].startswith("2023-11-14T22:13:20")


def test_a_malformed_status_is_reported_not_raised(source):
    source.custom = FlakyStatus(0, {"plan": {"generation": "seven", "members": ["a"], "config": "tp=1"}})
    assert source.poll() is None  # and the coordinator's loop goes on


def test_stragglers_come_from_the_coordinators_speed_summary(source):
    source.custom = FlakyStatus(0)
    health = {"members": {"p-0/0": {"speed": 1.0, "seconds_per_unit": 0.01, "samples": 8},
                          "p-1/0": {"speed": 0.5, "seconds_per_unit": 0.02, "samples": 8, "slow_since": 1700000000.0},
                          "p-1/1": {"speed": 1.1, "seconds_per_unit": 0.009, "samples": 8}},
              "stragglers": ["p-1/0"], "reference_seconds_per_unit": 0.01,
              "adaptive": {"enabled": True, "switches": 1, "decisions": [
                  {"switch": True, "kind": "layers", "config": "tp=1,pp=2,dp=1,ep=1,layers=1+3", "step": 12,
                   "time": 1700000100.0, "predictedStepSeconds": 0.2, "predictedStepSecondsAfter": 0.15,
                   "measuredStepSeconds": 0.21, "switchCostSeconds": 0.3, "horizonSteps": 200,
                   "stragglers": ["p-1/0"], "reason": "layers: predicted 0.2 -> 0.15 s/step"}]}}
    source.report({"history": [], "telemetry": {}, "health": health})
    written = next(p for p in source.custom.patches if "speeds" in p)
    assert written["speeds"] == {"p-0": 1.0, "p-1": 0.5}  # a pod is as fast as its slowest device, capped at 1
    [slow] = written["stragglers"]
    assert slow["pod"] == "p-1" and slow["device"] == "p-1/0" and slow["relativeSpeed"] == 0.5
    assert slow["since"].startswith("2023-11-14T22:13:20") and "20.00 ms per layer unit" in slow["evidence"]
    adaptive = next(p for p in source.custom.patches if "adaptive" in p)["adaptive"]
    assert adaptive["switches"] == 1 and adaptive["lastDecision"]["config"].endswith("layers=1+3")
    assert adaptive["lastDecision"]["predictedStepSecondsAfter"] == 0.15
    # a new straggler set is written at once, not at the next 30 s report
    count = len([p for p in source.custom.patches if "speeds" in p])
    health["stragglers"] = []
    source.report({"history": [], "telemetry": {}, "health": health})
    speeds = [p for p in source.custom.patches if "speeds" in p]
    assert len(speeds) == count + 1 and speeds[-1]["stragglers"] == []
