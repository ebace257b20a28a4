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
