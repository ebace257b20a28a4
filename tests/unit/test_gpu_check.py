"""The GPU check's own logic, run on the CPU: every part gives a verdict, a part that cannot run
here is SKIP (not PASS), and the exit code follows the verdicts."""

from __future__ import annotations

import json

import pytest

from liveshard.dev import gpu_check


def test_cpu_dry_run_packs_and_unpacks_a_real_plan_bit_for_bit(tmp_path):
    out = tmp_path / "check.json"
    assert gpu_check.main(["--cpu", "--parts", "pack", "--out", str(out)]) == 0
    parts = {p["part"]: p for p in json.loads(out.read_text())["parts"]}
    assert {n: p["verdict"] for n, p in parts.items()} == {"pack": "PASS"}
    assert parts["pack"]["figures"]["mismatched_regions"] == 0 and parts["pack"]["figures"]["bytes"] > 0


@pytest.mark.long
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is here")
def test_without_a_gpu_the_device_parts_are_skipped_and_require_gpu_fails(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert gpu_check.main(["--parts", "env,health", "--out", str(out), "--require-gpu"]) == 1
    verdicts = {p["part"]: p["verdict"] for p in json.loads(out.read_text())["parts"]}
    assert verdicts == {"env": "PASS", "health": "SKIP"}  # a skip is no failure: the exit says no GPU
    assert "SKIP health" in capsys.readouterr().out


def test_an_unknown_part_is_refused_in_one_line(tmp_path, capsys):
    assert gpu_check.main(["--parts", "env,warp", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "warp" in err[0]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is here")
def test_without_a_gpu_the_nccl_shrink_part_is_skipped_cleanly(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert gpu_check.main(["--parts", "nccl_shrink", "--out", str(out)]) == 0
    part = json.loads(out.read_text())["parts"][0]
    assert part["part"] == "nccl_shrink" and part["verdict"] == "SKIP" and "no CUDA device" in part["reason"]
    assert "SKIP nccl_shrink" in capsys.readouterr().out


@pytest.mark.long
def test_the_nccl_shrink_part_reports_its_figures_on_a_cpu_dry_run(tmp_path):
    """The part's report shape, through the same code on gloo: the API and version figures, the
    eager world (gloo cannot split: the error is reported), the world object's lifecycle through
    a shrink made to fail and the world made again, every step timed."""
    out = tmp_path / "check.json"
    assert gpu_check.main(["--cpu", "--parts", "nccl_shrink", "--out", str(out)]) == 0
    part = json.loads(out.read_text())["parts"][0]
    assert part["verdict"] == "PASS", part
    f = part["figures"]
    assert f["api"]["shrink_group"] and f["api"]["split_group"] and isinstance(f["api"]["grow"], list)
    assert f["nccl_version"] is None and not any(f["nccl_carries"].values())  # no NCCL on the CPU
    assert f["world_collective_ok"] and "split_error" in f  # gloo refuses split_group
    assert f["recreated_collective_ok"]
    assert set(f["seconds"]) >= {"eager_world", "world_scratch", "world_recreate"}
    assert all(isinstance(v, float) and v >= 0 for v in f["seconds"].values())
    if f["lifecycle"] == "comms.world.World":
        assert f["shrink_failed_as_made"] and not f["errored_after_failed_shrink"] and f["errored_at_end"]


def test_the_check_skips_the_parts_its_budget_has_no_room_for(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert gpu_check.main(["--parts", "env,nccl_shrink", "--budget", "5", "--out", str(out)]) == 0
    parts = json.loads(out.read_text())["parts"]
    assert [p["verdict"] for p in parts] == ["SKIP", "SKIP"] and all("budget" in p["reason"] for p in parts)
