"""The adaptive policy's last decision as the job's status shows it (``contract.status.AdaptiveReport``)."""

from __future__ import annotations

from liveshard.runtime.contract.status import AdaptiveReport


def _last(time: object) -> dict:
    report = AdaptiveReport.from_coordinator({"decisions": [{"switch": True, "kind": "k", "time": time}]})
    return report.to_status()["adaptive"]["lastDecision"]


def test_a_decision_time_is_shown_in_rfc3339():
    assert _last(1_700_000_000)["time"] == "2023-11-14T22:13:20.000000Z"


def test_a_garbled_decision_time_is_shown_as_unknown_not_raised():
    assert _last("not a time")["time"] is None
    assert _last(None)["time"] is None
