"""A stretch of steps trained by one worker alone, which is SIGKILLed later: real processes.

After a leave one worker trains on its own; a joiner comes; then the first worker is killed
without notice. It writes no result file, so before the step log the steps it trained alone had
no record and the goodput bench counted their time as lost. Every step must have a record.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from liveshard.dev.localrun.driver import RunSpec, run_local
from liveshard.dev.localrun.events import parse_events
from liveshard.runtime.agent.step_log import read_step_log

pytestmark = pytest.mark.slow

_BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_goodput.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_goodput", _BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_goodput", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.long  # 30 s; the records' rules are unit-tested (test_goodput_records.py)
def test_the_steps_of_a_worker_killed_later_are_all_recorded(tmp_path):
    steps = 10
    report = run_local(RunSpec.mock("tiny-llama", workers=2, parallel="tp=1,pp=1,dp=2", steps=steps, global_batch=4,
                                    events=parse_events("3:leave=1 5:join=1 8:kill=0"), heartbeat_timeout=2.0,
                                    collective_timeout=10.0, workdir=str(tmp_path)))
    assert [e["outcome"] for e in report["events"]] == ["committed"] * 3
    # w0 trained 4-5 alone and was killed at 8: no result file, only its step log
    assert not (tmp_path / "w0.json").exists()
    alone = [r for r in read_step_log(tmp_path / "w0.steps.jsonl") if r["world_size"] == 1]
    assert [r["step"] for r in alone] == [4, 5]
    bench = _bench()
    execs = bench.executions_of_localrun(tmp_path)
    bench.check_complete(execs, steps)
    assert sorted(e.step for e in execs if e.counted) == list(range(1, steps + 1))
    assert bench.goodput(execs, 4 * 32)["redone_steps"] == 0
