"""What a change connects, counted in real worker processes (gloo): a leave reuses the running
world for its transfer and connects nothing in its pause; a join connects its transition group
and the next world while training goes on, nothing in its pause either."""

from __future__ import annotations

import json

import pytest

from liveshard.dev.localrun.driver import RunSpec, run_local
from liveshard.dev.localrun.events import parse_events

pytestmark = pytest.mark.slow


def _switches(workdir) -> dict[int, list[dict]]:
    """Every worker's switch records, by generation."""
    out: dict[int, list[dict]] = {}
    for path in sorted(workdir.glob("w*.json")):
        for event in json.loads(path.read_text()).get("events", []):
            if event.get("kind") == "switch":
                out.setdefault(event["generation"], []).append(event)
    return out


def test_a_leave_connects_nothing_new_for_its_transfer_and_nothing_in_any_pause(tmp_path):
    steps = 7
    report = run_local(RunSpec.mock("tiny-llama", workers=3, parallel="tp=1,pp=1,dp=3", steps=steps, global_batch=6,
                                    events=parse_events("3:leave=1 5:join=1"), workdir=str(tmp_path)))
    assert [s["step"] for s in report["steps"]] == list(range(1, steps + 1))
    events = report["events"]
    assert [(e["kind"], e["outcome"]) for e in events] == [("leave", "committed"), ("join", "committed")], events
    switches = _switches(tmp_path)
    leave, join = (switches[e["generation"]] for e in events)
    assert len(leave) == 2 and len(join) == 3, switches  # the survivors, then every member of the join
    for record in leave:
        connected = record["connected"]
        assert "transition" not in connected["prepare"], record  # the running world carries the transfer
        assert connected["pause"] == {}, record
    # the survivors connected the next world ahead, while the old one trained
    assert all(r["connected"]["prepare"].get("ahead", 0) >= 1 for r in leave), leave
    for record in join:
        connected = record["connected"]
        assert connected["prepare"].get("transition") == 1 and connected["prepare"].get("ahead", 0) >= 1, record
        assert connected["pause"] == {}, record
