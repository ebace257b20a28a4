"""A worker SIGKILLed while the first world starts: the survivor leaves the world's creation
within the bound the docs state, not after its rendezvous' timeouts.

Real coordinator and worker processes on CPU (gloo; ``dev.localrun.end_faults``): the victim is
held at ``start`` (after the members met, before its rendezvous) and SIGKILLed there, while the
survivor waits in the world's rendezvous for its address. The collective timeout (60 s) is far
above the bound checked: the survivor must be released by the coordinator's decision (the
victim declared dead ``T`` after its last beat, the generation aborted), read by its control
thread, which aborts the creation (``comms.world.Start``). The job then goes on: a first world
of the survivor, trained to the end, its exit code 0.
"""

from __future__ import annotations

import json

import pytest

from liveshard.dev.localrun.driver import RunSpec
from liveshard.dev.localrun.end_faults import run_end

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT = 2.0
COLLECTIVE_TIMEOUT = 60.0  # what the survivor would wait in the rendezvous without the abort
BOUND = 25.0  # from the SIGKILL to the survivor out of the world's creation (T, a poll, a loaded machine)


def test_a_worker_killed_while_the_first_world_starts_releases_the_survivor_within_the_bound(tmp_path):
    run = RunSpec.mock("tiny-llama", workers=2, parallel="tp=1,pp=1,dp=2", steps=1, global_batch=4, events=[],
                       workdir=str(tmp_path / "run"), heartbeat_timeout=HEARTBEAT_TIMEOUT,
                       collective_timeout=COLLECTIVE_TIMEOUT)
    result = run_end(run, kill=(1, "start"), timeout=120.0)
    (tmp_path / "end.json").write_text(json.dumps(result, default=str))
    assert result["killed"]["at"] == "start:0"
    events = result["results"]["w0"]["events"]
    (failed,) = [e for e in events if e["kind"] == "start-failed"]
    assert failed["generation"] == 0
    left = failed["time"] - result["killed"]["time"]
    assert left <= BOUND, (left, failed)  # not the rendezvous' 60 s
    assert "aborted: generation 0 was decided: aborted: member w1 died" in failed["error"], failed
    # the job went on without the victim, to the end, and says so
    history = [h for h in result["status"]["history"] if h.get("generation") is not None]
    assert history[0]["generation"] == 0 and history[0]["outcome"].startswith("aborted: member w1 died"), history
    assert history[-1]["outcome"] == "committed" and history[-1]["world_size"] == 1, history
    assert result["status"]["failure"] is None, result["status"]
    assert result["status"]["finished"]["step"] == 1, result["status"]
    assert [s["step"] for s in result["report"]["steps"]] == [1]
    assert result["exit_codes"]["w0"] == 0 and result["exit_codes"]["w1"] == -9, result["exit_codes"]
    assert result["verify"] is None, result["verify"]
