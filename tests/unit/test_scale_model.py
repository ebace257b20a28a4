"""The scale model's JSON (``bench/bench_scale_model.py --json``) from the committed results: the
path the code takes, part by part, every figure with its source, and figures that add up."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "bench"
FIGURES = ("plan_seconds", "communicator_seconds", "transfer_seconds", "build_seconds", "pause_seconds",
           "end_to_end_seconds")
MODELS = ("llama3-70b", "qwen3-235b-a22b")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(_BENCH))  # it imports its sibling bench_transition_planning
    try:
        spec = importlib.util.spec_from_file_location("bench_scale_model", _BENCH / "bench_scale_model.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(_BENCH))


@pytest.fixture(scope="module")
def rows(bench):
    return bench.summary(json.loads((_BENCH / "results" / "scale_model.json").read_text()))


def test_every_model_and_scale_has_a_leave_and_a_join(rows):
    have = {(r["model"], r["gpus"], r["scenario"]) for r in rows}
    for model in MODELS:
        for n in (256, 512, 1024, 2048, 4096):
            assert {(model, n, "node leaves"), (model, n, "node joins")} <= have, (model, n)


@pytest.mark.parametrize("gpus", [1024, 4096])
def test_the_rows_at_scale_have_every_figure_with_its_source_and_they_add_up(rows, gpus):
    at = [r for r in rows if r["gpus"] == gpus and r["model"] in MODELS]
    assert len(at) >= 4
    for r in at:
        for k in FIGURES:
            assert isinstance(r[k], int | float) and r[k] >= 0, (r["model"], r["scenario"], k)
            source = r["sources"][k]
            assert isinstance(source, str) and len(source) > 20
        assert any(word in " ".join(r["sources"].values()) for word in ("measured", "published"))
        assert r["end_to_end_seconds"] >= r["pause_seconds"] > 0
        parts = r["parts"]
        # the pause is its parts; end to end is what runs while training goes on, then the pause
        assert r["pause_seconds"] == pytest.approx(sum(parts[k] for k in r["on_pause"]), abs=0.01)
        assert r["end_to_end_seconds"] == pytest.approx(
            sum(parts[k] for k in r["during_training"]) + r["pause_seconds"], abs=0.01)
        assert set(r["during_training"]).isdisjoint(r["on_pause"]) and "plan" in r["during_training"]
        assert r["transfer_seconds"] == parts["transfer"] and r["build_seconds"] == parts["build"]


@pytest.mark.parametrize("gpus", [1024, 4096])
def test_a_leave_with_notice_is_the_shrink_path(rows, gpus):
    for r in (r for r in rows if r["gpus"] == gpus and r["scenario"] == "node leaves"):
        p = r["parts"]
        assert r["strategy"] == "shrink" and r["during_training"] == ["plan"]
        assert r["on_pause"] == ["transfer", "shrink", "megatron_groups", "build"]  # in the code's order
        assert p["shrink"] == pytest.approx(2.02 if gpus == 1024 else 2.03)  # PR #3186, flat beyond 1024
        assert r["communicator_seconds"] == pytest.approx(p["shrink"] + p["megatron_groups"], abs=0.01)
        assert "PR #3186" in r["sources"]["communicator_seconds"] and "github.com" in r["sources"]["communicator_seconds"]
        assert r["megatron_group_calls"] > r["megatron_member_groups"] > 0
        assert r["targets"] == {"end_to_end_seconds": 10.0 if gpus == 1024 else 15.0, "pause_seconds": 1.5}
        # the code's path: one split per kind of group (members only), far fewer than megatron's calls
        assert 0 < r["megatron_split_kinds"] < r["megatron_member_groups"] and r["megatron_stock_calls"] == 0
        assert "members only" in r["sources"]["communicator_seconds"]
        # megatron's own calls (every group on every rank), kept for comparison, cost more
        stock = r["with_megatrons_own_group_calls"]
        assert stock["megatron_groups"] > p["megatron_groups"] and stock["pause_seconds"] > r["pause_seconds"]
        assert stock["end_to_end_seconds"] >= stock["pause_seconds"]


def test_a_join_builds_its_world_ahead_while_training_goes_on(rows):
    for r in (r for r in rows if r["gpus"] == 1024 and r["scenario"] == "node joins"):
        assert r["strategy"] == "live rebuild, world built ahead"
        assert r["on_pause"] == ["transfer", "build"]
        assert {"transition_group", "world_ahead"} <= set(r["during_training"])
        assert r["targets"]["end_to_end_seconds"] == 30.0


def test_the_shrink_figure_is_the_published_one_between_and_beyond_its_points(bench):
    for n, t in bench.SHRINK_MEASURED:
        assert bench.shrink_s(n) == t
    assert bench.shrink_s(8) == 1.53 and bench.shrink_s(4096) == 2.03
    assert 1.53 < bench.shrink_s(128) < 1.67
    # megatron's groups: its own are splits, every other call costs the parent's ring allgather
    assert bench.megatron_groups_s(20, 20, 1000) == pytest.approx(20 * bench.SPLIT_MEMBER_S)
    assert bench.megatron_groups_s(120, 20, 1001) == pytest.approx(20 * bench.SPLIT_MEMBER_S + 100 * 1000 * bench.NOCOLOR_HOP_S)
