"""A slow device on the local cluster: found from compute times (not step times, which every
rank of a synchronous job shares), and planned around live by the straggler policy. Real
coordinator and worker processes on CPU (gloo); ``slow=R@F`` events make a device sleep in
proportion to what it computes.
"""

from __future__ import annotations

import json
import os
import random

import pytest

from liveshard.dev.localrun.driver import RunSpec, run_local
from liveshard.dev.localrun.events import parse_events
from liveshard.runtime.contract.jobspec import AdaptivePolicy

pytestmark = pytest.mark.slow

GLOBAL_BATCH = 8


def _run(path, events: str, steps: int, adaptive: AdaptivePolicy) -> dict:
    # Each device emulated 3x slower than the CPU (``--stretch``): on a quiet machine tiny-llama
    # steps take ~0.07 s, and what a switch saves over the steps left would then never pay for
    # its cost (2 s until one is measured), whatever the straggler.
    report = run_local(RunSpec.mock("tiny-llama", workers=4, parallel="tp=1,pp=2,dp=2", steps=steps,
                                    global_batch=GLOBAL_BATCH, events=parse_events(events), workdir=str(path),
                                    adaptive=adaptive, stretch=3.0))
    (path / "run.json").write_text(json.dumps(report))
    return report


def _exact(report: dict, steps: int) -> None:
    assert [s["step"] for s in report["steps"]] == list(range(1, steps + 1))
    assert [s["consumed_samples"] for s in report["steps"]] == [GLOBAL_BATCH * k for k in range(1, steps + 1)]
    assert [s["samples"] for s in report["steps"]] == [list(range(GLOBAL_BATCH * (k - 1), GLOBAL_BATCH * k))
                                                       for k in range(1, steps + 1)]


# The slowdown the first test applies: its step and factor come from a seed (``LIVESHARD_STRAGGLER_SEED``
# picks another), so the policy is not tuned to one step or one factor.
SEED = int(os.environ.get("LIVESHARD_STRAGGLER_SEED", "34"))
# The first switch follows at most this many steps after the slowdown: 3 slow steps find it
# (``telemetry.SHARP_CONFIRM_STEPS``), the decision is taken on the tick that reads the third, and the
# switch is bound to the next step after the one the decision saw (``StragglerLoop.switch_lead``).
SWITCH_WITHIN = 5


def _slowdown(seed: int) -> tuple[int, float]:
    rng = random.Random(seed)
    return rng.randint(10, 18), round(rng.uniform(0.25, 0.45), 2)


@pytest.mark.long
def test_a_slowed_device_is_found_and_planned_around_and_a_healthy_one_never(tmp_path):
    """Healthy for 10-18 steps (no straggler, no switch), then device 1 at 0.25-0.45 of its speed
    (step and factor from ``SEED``): switched around within ``SWITCH_WITHIN`` steps, live, every
    sample trained once and in order."""
    steps, window = 56, 4
    slow_at, factor = _slowdown(SEED)
    report = _run(tmp_path, f"{slow_at}:slow=1@{factor:g}", steps, AdaptivePolicy(enabled=True, window=window))
    _exact(report, steps)
    assert all(d["step"] > slow_at for d in report["stragglers"]["adaptive"]["decisions"]), \
        (slow_at, factor, report["stragglers"]["adaptive"]["decisions"])
    assert {s["config"] for s in report["steps"][:slow_at]} == {"tp=1,pp=2,dp=2,ep=1"}
    health = report["stragglers"]
    assert "w1" in health["stragglers"], health["members"]  # the slowed device
    assert health["members"]["w1"]["speed"] < 0.7
    # and no healthy one, as planned: on a loaded 2-core CI host a healthy rank's burst late in
    # the run can hold it just under the way back (threshold + margin, 0.8) when the report is
    # taken, but never below the threshold, and no decision ever names it
    assert all(m["speed"] > 0.7 for w, m in health["members"].items() if w != "w1"), health["members"]
    switches = [a for a in report["adaptive"] if a["outcome"] == "committed"]
    assert switches, report["adaptive"]
    first = switches[0]
    d = first["decision"]
    assert d["switch"] and d["predictedStepSecondsAfter"] < d["predictedStepSeconds"] and d["switchCostSeconds"] > 0
    assert all(a["decision"]["stragglers"] == ["w1"] for a in switches), switches
    # found from its first slow steps and switched within SWITCH_WITHIN steps of the slowdown
    # (step ``slow_at`` is the last healthy one), on any load of this machine
    assert "w1" in d["stragglers"] and first["switch_step"] <= slow_at + SWITCH_WITHIN, \
        (slow_at, factor, d["step"], first["switch_step"])
    # the device's load is lighter after the switch: fewer layers on its stage, or fewer micro-batches
    assert "layers=" in first["config"] or "dp_split=" in first["config"]
    assert [s["config"] for s in report["steps"]][-1] == switches[-1]["config"]


@pytest.mark.long
def test_a_healthy_run_under_load_makes_no_switch(tmp_path):
    """Four healthy devices on this shared machine with the policy on: no straggler, no switch."""
    steps = 24
    report = _run(tmp_path, "", steps, AdaptivePolicy(enabled=True, window=4))
    _exact(report, steps)
    assert report["adaptive"] == [], report["adaptive"]
    assert not any(d.get("switch") for d in report["stragglers"]["adaptive"]["decisions"]), \
        report["stragglers"]["adaptive"]["decisions"]
    assert {s["config"] for s in report["steps"]} == {"tp=1,pp=2,dp=2,ep=1"}
