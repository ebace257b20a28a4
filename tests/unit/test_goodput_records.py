"""Step records that survive their process: the worker's step log and the goodput bench's merge.

The bench (``bench/bench_goodput.py``) takes every step of a run from the workers' step logs
(appended and flushed as each step is made) and their result files (written when a worker ends),
each record once, and fails loudly on a step it has no record of instead of counting its time as
lost. The trace that broke it before: a leave leaves one worker training a stretch of steps
alone, and that worker is SIGKILLed later (``--cloud gcp --seeds 7``: steps 19-32).
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from liveshard.runtime.agent.step_log import StepLog, read_step_log
from liveshard.runtime.agent.trainer import StepStats
from liveshard.runtime.agent.training import train_one
from liveshard.runtime.agent.worker import WorkerState

_BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_goodput.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_goodput", _BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_goodput", mod)
    spec.loader.exec_module(mod)
    return mod


# ---- the worker's step log ---------------------------------------------------------------------

class _Trainer:
    def __init__(self) -> None:
        self.step_count = 0
        self.consumed_samples = 0
        self.last_step_seconds = 0.5
        self.last_stats = StepStats(lr=1e-3, tokens=64, samples=[0, 1])

    def step(self) -> float:
        self.step_count += 1
        self.consumed_samples += 2
        return 2.5


def test_every_recorded_step_is_in_the_log_at_once(tmp_path):
    state = WorkerState(generation=2)
    state.step_log = StepLog(tmp_path / "w0.steps.jsonl", "w0")
    trainer = _Trainer()
    for n in range(1, 4):
        train_one(state, trainer, world_size=2, after_step=lambda: None)
        lines = read_step_log(tmp_path / "w0.steps.jsonl")  # read while the writer is open
        assert [r["step"] for r in lines] == list(range(1, n + 1))
    assert lines[-1]["id"] == "w0" and lines[-1]["generation"] == 2 and lines[-1]["world_size"] == 2
    assert "samples" not in lines[-1]  # the batch's sample indices stay out of the log
    assert [r.step for r in state.records] == [1, 2, 3]


def test_a_log_that_fails_never_stops_training(tmp_path):
    state = WorkerState(generation=0)
    state.step_log = StepLog(tmp_path / "w.steps.jsonl", "w")
    state.step_log.close()  # writing now raises ValueError (a closed file), like a full disk raises OSError
    train_one(state, _Trainer(), world_size=1, after_step=lambda: None)
    assert [r.step for r in state.records] == [1] and state.step_log is None


def test_the_steps_of_a_sigkilled_process_are_on_disk(tmp_path):
    path = tmp_path / "w1.steps.jsonl"
    code = textwrap.dedent(f"""
        import os, signal
        from liveshard.runtime.agent.step_log import StepLog
        log = StepLog({str(path)!r}, "w1")
        for step in range(1, 6):
            log.append({{"step": step, "generation": 3, "world_size": 1, "seconds": 0.1, "time": step}})
        log._file.write('{{"step": 6, "gener')  # a line torn by the kill: buffered, never flushed
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=False)
    assert p.returncode == -signal.SIGKILL
    assert [r["step"] for r in read_step_log(path)] == [1, 2, 3, 4, 5]
    with open(path, "a") as f:  # a torn last line (a kill in the middle of a write) is skipped
        f.write('{"step": 6, "gen')
    assert [r["step"] for r in read_step_log(path)] == [1, 2, 3, 4, 5]


# ---- the bench's merge -------------------------------------------------------------------------

def _rec(wid: str, step: int, gen: int, world: int) -> dict:
    return {"id": wid, "step": step, "generation": gen, "world_size": world, "seconds": 1.0,
            "time": 1000.0 + 1.1 * step + 0.001 * int(wid[-1]), "loss": 2.0, "consumed_samples": 2 * step}


def _killed_stretch_run(workdir: Path) -> None:
    """A run of 50 steps: w0 and w1 train 1-18; w1 leaves; w0 trains 19-32 alone; w2 joins and
    trains 33-44 with w0; w0 is SIGKILLed there (step log only); w2 trains 45-50 alone."""
    runs = {"w0": [], "w1": [], "w2": []}
    for s in range(1, 19):
        runs["w0"].append(_rec("w0", s, 0, 2))
        runs["w1"].append(_rec("w1", s, 0, 2))
    runs["w0"] += [_rec("w0", s, 1, 1) for s in range(19, 33)]
    for s in range(33, 45):
        runs["w0"].append(_rec("w0", s, 2, 2))
        runs["w2"].append(_rec("w2", s, 2, 2))
    runs["w2"] += [_rec("w2", s, 3, 1) for s in range(45, 51)]
    for wid, recs in runs.items():
        (workdir / f"{wid}.steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        if wid != "w0":  # the killed worker wrote no result file
            (workdir / f"{wid}.json").write_text(json.dumps({"id": wid, "steps": recs}))


def test_the_steps_of_a_worker_killed_later_are_all_counted(bench, tmp_path):
    _killed_stretch_run(tmp_path)
    execs = bench.executions_of_localrun(tmp_path)
    bench.check_complete(execs, 50)
    counted = [e for e in execs if e.counted]
    assert sorted(e.step for e in counted) == list(range(1, 51))  # each step exactly once
    assert len(execs) == 50  # a record in both the step log and the result file is one record
    assert {e.world for e in counted if 19 <= e.step <= 32} == {1}
    g = bench.goodput(execs, 64)
    assert g["counted_steps"] == 50 and g["redone_steps"] == 0


def test_without_the_step_log_the_missing_steps_are_named(bench, tmp_path):
    _killed_stretch_run(tmp_path)
    (tmp_path / "w0.steps.jsonl").unlink()  # what the bench had before: result files only
    execs = bench.executions_of_localrun(tmp_path)
    with pytest.raises(bench.MissingRecords) as e:
        bench.check_complete(execs, 50, "live")
    assert e.value.missing == list(range(19, 33))
    assert "19-32" in str(e.value) and "live" in str(e.value)


def test_a_step_redone_after_a_restart_counts_in_its_last_execution(bench, tmp_path):
    first = [_rec("s0w0", s, 0, 1) for s in range(1, 8)]  # killed at 7, restored from the checkpoint at 5
    second = [dict(_rec("s1w0", s, 0, 1), time=2000.0 + s) for s in range(6, 11)]
    (tmp_path / "s0w0.steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first))
    (tmp_path / "s1w0.json").write_text(json.dumps({"id": "s1w0", "steps": second}))
    execs = bench.executions_of_localrun(tmp_path)
    bench.check_complete(execs, 10)
    assert len(execs) == 12 and sum(e.counted for e in execs) == 10
    assert {e.step for e in execs if not e.counted} == {6, 7}


def test_pauses_come_from_the_records_of_every_worker(bench, tmp_path):
    _killed_stretch_run(tmp_path)
    (tmp_path / "w0.json").write_text("{}")  # nothing of w0's in a result file
    execs = bench.executions_of_localrun(tmp_path)
    events = [{"step": 18, "action": "leave"}, {"step": 32, "action": "join"}, {"step": 44, "action": "kill"}]
    pauses = bench.event_pauses(execs, events)
    assert [p["event"] for p in pauses] == ["18:leave", "32:join", "44:kill"]
    assert all(p["seconds"] == pytest.approx(0.1, abs=0.01) for p in pauses)


def test_a_restart_pause_runs_to_the_first_step_of_the_new_processes(bench, tmp_path):
    first = [_rec("s0w0", s, 0, 1) for s in range(1, 8)]
    second = [dict(_rec("s1w0", s, 0, 1), time=2000.0 + s) for s in range(6, 11)]
    (tmp_path / "s0w0.steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first))
    (tmp_path / "s1w0.steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in second))
    execs = bench.executions_of_localrun(tmp_path)
    [pause] = bench.event_pauses(execs, [{"step": 7, "action": "kill"}])
    assert pause["seconds"] == pytest.approx((2006.0 - 1.0) - (1000.0 + 1.1 * 7))  # step 6 again, after the restart


def test_step_ranges(bench):
    assert bench.step_ranges([9, 1, 2, 3, 7, 10]) == "1-3, 7, 9-10"
    assert bench.step_ranges([4]) == "4"


# ---- failures are reported, not raised ---------------------------------------------------------

def test_a_failed_run_and_a_missing_record_are_rows_of_the_table(bench, tmp_path, monkeypatch, capsys):
    args = type("Args", (), {"load": False, "load_procs": 1})()
    trace = {"cloud": "gcp", "seed": 7}

    def aborted(*a, **k):
        raise RuntimeError("event 32:join=1: the join of w3 did not commit in 3 tries")

    monkeypatch.setattr(bench, "run_liveshard", aborted)
    r = bench.run_mode(args, trace, "live", tmp_path / "a")
    assert r["failed"] == "run" and "did not commit" in r["reason"]

    def unrecorded(*a, **k):
        raise bench.MissingRecords([19, 20], 80, "live")

    monkeypatch.setattr(bench, "run_liveshard", unrecorded)
    r2 = bench.run_mode(args, trace, "live", tmp_path / "b")
    assert r2["failed"] == "records" and r2["missing_steps"] == [19, 20]
    ok = {"useful_seconds": 97.0, "wall_seconds": 100.0, "goodput": 0.97, "goodput_steady": 0.96,
          "goodput_loss": 0.03, "goodput_steady_loss": 0.04}
    s = bench.cloud_summary({"7": {"modes": {"live": r}}, "8": {"modes": {"live": ok}}})
    assert s["modes"]["live"]["failed"] == 1 and s["modes"]["live"]["goodput"] == pytest.approx(0.97)
    bench.print_cloud_table("quiet", {"gcp": {"notice_seconds": 30.0, "summary": s}})
    assert "did not commit" in capsys.readouterr().out


def test_every_cloud_has_its_notice_and_valid_traces(bench):
    from liveshard.dev.localrun.events import parse_events

    assert {c: bench.NOTICE_SECONDS[c] for c in ("aws", "gcp", "azure", "gke")} == \
        {"aws": 120.0, "gcp": 30.0, "azure": 30.0, "gke": 15.0}
    for cloud in bench.CLOUDS:
        for seed in (1, 2, 7):
            t = bench.make_trace(80, seed, cloud=cloud)
            parse_events(t["localrun"])
            assert t["notice_steps"] == bench.NOTICE_SECONDS[cloud] / 10.0
            assert (t["counts"]["rebalance"] > 0) == (cloud == "aws")
    # Azure has GCP's notice but traces of its own
    assert bench.make_trace(80, 7, cloud="azure")["localrun"] != bench.make_trace(80, 7, cloud="gcp")["localrun"]


def test_the_burner_runs_one_process_per_slot_and_stops_them(bench):
    with bench.CpuBurner(2) as b:
        procs = list(b._running)
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert all(p.poll() is not None for p in procs)
