"""The spot availability trace of ``bench/bench_goodput.py``: seeded, valid, built from its rates."""

from __future__ import annotations

import importlib.util
import itertools
import math
import sys
from pathlib import Path

import pytest

from liveshard.dev.localrun.events import parse_events

_PATH = Path(__file__).resolve().parents[2] / "bench" / "bench_goodput.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_goodput", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_goodput", mod)
    spec.loader.exec_module(mod)
    return mod


def test_same_seed_same_trace_other_seed_other_trace(bench):
    a, b = bench.make_trace(80, 1), bench.make_trace(80, 1)
    assert a == b
    assert bench.make_trace(80, 2)["localrun"] != a["localrun"]


@pytest.mark.parametrize("seed", range(12))
def test_events_valid_within_the_run_and_of_every_kind(bench, seed):
    steps, nodes, gap = 80, 2, 3
    t = bench.make_trace(steps, seed, nodes=nodes, min_gap=gap)
    events = parse_events(t["localrun"])  # a valid run-local event list
    assert [e.step for e in events] == [e["step"] for e in t["events"]]
    assert all(gap <= e.step <= steps - gap for e in events)
    assert all(b.step - a.step >= gap for a, b in itertools.pairwise(events))
    world = nodes
    for e in t["events"]:
        if e["action"] == "join":
            world += 1
        else:
            assert 0 <= e["rank"] < world
            world -= 1
        assert 1 <= world <= nodes
        assert e["world_after"] == world
    causes = {(e["action"], e["cause"]) for e in t["events"]}
    assert ("leave", "rebalance") in causes
    assert ("kill", "loss") in causes
    assert ("join", "capacity") in causes
    assert any(e["cause"] == "notice" for e in t["events"])


def test_counts_follow_the_published_rates(bench):
    r = bench.rates_per_node_day(">20%")
    assert r["spot"] == pytest.approx(-math.log(0.75) / 30)
    assert r["unexpected"] == pytest.approx(8 * 419 / (54 * 16384))
    t = bench.make_trace(200, 3, interruptions=7)
    # interruptions split between spot and unexpected in the ratio of their rates
    assert t["counts"]["spot"] + t["counts"]["unexpected"] == 7
    assert t["counts"]["spot"] == round(7 * r["spot"] / (r["spot"] + r["unexpected"]))
    # the run stands for the pool time in which that many interruptions are expected
    assert t["represents_days"] * 2 * (r["spot"] + r["unexpected"]) == pytest.approx(7)
    interruptions = [e for e in t["events"] if e["action"] != "join"]
    assert len(interruptions) == 7


def test_notice_windows_scale_with_the_reference_step(bench):
    aws = bench.make_trace(80, 1, ref_step_seconds=10.0)
    assert aws["notice_steps"] == 12.0
    gcp = bench.make_trace(80, 1, cloud="gcp", ref_step_seconds=10.0)
    assert gcp["notice_steps"] == 3.0
    assert gcp["counts"]["rebalance"] == 0  # no rebalance recommendations on GCP
    # a notice window shorter than a step has no step boundary inside it for most arrival
    # times: those notices become losses without notice
    short = [bench.make_trace(200, s, cloud="gcp", ref_step_seconds=60.0, interruptions=6, min_gap=1)
             for s in range(6)]
    notices = [e for t in short for e in t["events"] if e["cause"] == "notice"]
    assert notices and all((e["action"] == "leave") == (math.floor(e["at"]) + 1 < e["at"] + e["window"])
                           for e in notices)
    assert any(e["action"] == "kill" for e in notices)
