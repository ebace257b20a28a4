"""The live elastic runtime end to end: real coordinator and worker processes on CPU (gloo).

One event list with a spot notice (leave), a join, a TP/PP change and back, run live and the
way restart-based systems do it (checkpoint mode): both must train through every change,
consume exactly the same samples, and end with bit-identical state. A kill -9 of a worker must
be detected and survived without a restart.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from liveshard.dev.localrun.driver import RunSpec, run_local
from liveshard.dev.localrun.events import parse_events

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
GLOBAL_BATCH = 4
EVENTS = "3:leave=1 5:join=1 7:parallel=tp=1,pp=2,dp=1"
STEPS = 9


def _run(tmp_path, mode: str, events: str, steps: int = STEPS, workers: int = 2, parallel: str = "tp=2,pp=1,dp=1",
         **kw) -> dict:
    report = run_local(RunSpec.mock(MODEL, workers=workers, parallel=parallel, steps=steps,
                                    global_batch=GLOBAL_BATCH, events=parse_events(events), mode=mode,
                                    workdir=str(tmp_path / mode), **kw))
    (tmp_path / f"{mode}.json").write_text(json.dumps(report))
    return report


def _check_training(report: dict, steps: int) -> None:
    got = [s["step"] for s in report["steps"]]
    assert got == list(range(1, steps + 1)), got
    # the data cursor: a fixed global batch per step, no sample repeated or skipped
    assert [s["consumed_samples"] for s in report["steps"]] == [GLOBAL_BATCH * k for k in range(1, steps + 1)]
    losses = [s["loss"] for s in report["steps"]]
    assert all(x is not None and 0 < x < 10 for x in losses), losses
    assert losses[-1] < losses[0]  # it keeps learning across the changes


@pytest.fixture(scope="module")
def live_and_checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    return _run(tmp, "live", EVENTS, verify=True), _run(tmp, "checkpoint", EVENTS)


LEAVE_STEPS = 5


@pytest.fixture(scope="module")
def leave_through_checkpoint(tmp_path_factory):
    """One member of two leaving after step 2, through a checkpoint (the restart-based way)."""
    return _run(tmp_path_factory.mktemp("ref"), "checkpoint", "2:leave=1", steps=LEAVE_STEPS,
                parallel="tp=1,pp=1,dp=2")


def test_live_run_goes_through_every_change(live_and_checkpoint):
    live, _ = live_and_checkpoint
    _check_training(live, STEPS)
    assert [e["outcome"] for e in live["events"]] == ["committed"] * 3
    by_step = {s["step"]: s for s in live["steps"]}
    assert by_step[3]["world_size"] == 2 and by_step[4]["world_size"] == 1  # rank 1 left after step 3
    assert by_step[6]["world_size"] == 2  # the joiner trains from step 6
    assert by_step[8]["config"].startswith("tp=1,pp=2")
    for e in live["events"]:
        assert e["phases"]["transfer"] > 0 and e["downtime"] is not None


def _switches(report: dict) -> dict[int, list[dict]]:
    """Every worker's record of each switch it committed, by generation."""
    switches: dict[int, list[dict]] = {}
    for path in sorted(Path(report["workdir"]).glob("w*.json")):
        for event in json.loads(path.read_text()).get("events", []):
            if event.get("kind") == "switch":
                switches.setdefault(event["generation"], []).append(event)
    return switches


def test_a_leave_shrinks_the_running_world_and_no_other_change_connects_in_its_pause(live_and_checkpoint):
    """What each change connected and created, as every worker recorded it: the leave's transfer
    ran over the running world (no transition group) and its survivor shrank that world (no
    world made from scratch, nothing connected ahead; megatron's groups split from the shrunk
    world); the join and the reshape connected theirs while training went on, and their pause
    connected nothing (the next world was built ahead)."""
    live, _ = live_and_checkpoint
    switches = _switches(live)
    leave, join, reshape = (switches[e["generation"]] for e in live["events"])
    assert leave and all(s["change"] == "shrink" and s["fallback"] is None for s in leave), leave
    assert all(s["connected"]["prepare"] == {} and s["created"]["prepare"] == {} for s in leave), leave
    assert all(set(s["created"]["pause"]) == {"shrink", "split"} and s["created"]["pause"]["shrink"] == 1
               for s in leave), leave
    assert join and all(s["connected"]["prepare"].get("transition") == 1 for s in join), join
    assert reshape and all(s["connected"]["prepare"].get("transition") == 1 for s in reshape), reshape
    assert all(s["change"] == "live" and s["connected"]["pause"] == {} and s["created"]["pause"] == {}
               for s in (*join, *reshape))


def test_a_leave_whose_shrink_fails_rebuilds_the_world_and_trains_on_bit_exact(tmp_path, monkeypatch,
                                                                              leave_through_checkpoint):
    """Every survivor's shrink made to fail (``comms.world.SHRINK_FAULT_ENV``): they agree on it,
    make the world again from scratch, and the run ends exactly where the same leave through a
    checkpoint ends."""
    from liveshard.runtime.comms.world import SHRINK_FAULT_ENV

    monkeypatch.setenv(SHRINK_FAULT_ENV, "fail")  # the workers inherit it
    live = _run(tmp_path, "live", "2:leave=1", steps=LEAVE_STEPS, parallel="tp=1,pp=1,dp=2")
    ref = leave_through_checkpoint
    _check_training(live, LEAVE_STEPS)
    assert [e["outcome"] for e in live["events"]] == ["committed"]
    (survivor,) = _switches(live)[live["events"][0]["generation"]]
    assert survivor["change"] == "shrink" and survivor["fallback"].startswith("shrink: "), survivor
    assert survivor["created"]["pause"].get("recreate") == 1 and "shrink" not in survivor["created"]["pause"]
    assert [s["loss"] for s in live["steps"]] == [s["loss"] for s in ref["steps"]]
    assert live["checksums"] and live["checksums"] == ref["checksums"]


def test_live_equals_checkpoint_bit_for_bit(live_and_checkpoint):
    live, ckpt = live_and_checkpoint
    _check_training(ckpt, STEPS)
    assert [s["loss"] for s in live["steps"]] == [s["loss"] for s in ckpt["steps"]]
    assert live["checksums"] and live["checksums"] == ckpt["checksums"]


@pytest.mark.long
def test_coordinator_restart_and_kill_without_notice_are_survived(tmp_path):
    """The coordinator is killed and restarted (training must not notice; the new one adopts the
    running world), then a worker is SIGKILLed: survivors detect it, the standby takes its place
    with state from the surviving replica, and training goes on from the same step."""
    report = _run(tmp_path, "live", "2:coordinator=restart 4:kill=1", steps=8, workers=3,
                  parallel="tp=1,pp=1,dp=2", heartbeat_timeout=2.0, collective_timeout=10.0)
    _check_training(report, 8)
    restart, kill = report["events"]
    assert restart["outcome"] == "restarted"
    assert kill["kind"] == "kill" and kill["outcome"] == "committed"
    assert kill["downtime"] < 30  # detected and resumed within seconds, not NCCL-timeout minutes
    assert {s["world_size"] for s in report["steps"] if s["step"] > 5} == {2}  # the standby replaced it


@pytest.mark.long
def test_stop_and_resume_through_a_checkpoint_changes_nothing(tmp_path):
    """A stop (what the operator plans when too few workers remain) saves a checkpoint and leaves
    every worker waiting; resuming loads it. The run ends bit-identical to an uninterrupted one."""
    steps = 5
    stopped = _run(tmp_path, "live", "2:stop=resume", steps=steps, parallel="tp=1,pp=1,dp=2")
    plain = _run(tmp_path / "plain", "live", "", steps=steps, parallel="tp=1,pp=1,dp=2")
    _check_training(stopped, steps)
    stop = stopped["events"][0]
    assert stop["kind"] == "stop" and stop["outcome"] == "committed" and stop["phases"]["save"] > 0
    assert [s["loss"] for s in stopped["steps"]] == [s["loss"] for s in plain["steps"]]
    assert stopped["checksums"] and stopped["checksums"] == plain["checksums"]


@pytest.mark.long
def test_loss_with_no_surviving_copy_rolls_back_to_the_last_checkpoint(tmp_path):
    """tp=2 on two workers: a kill -9 takes the only copy of half of every weight. The survivors
    restore the last safety checkpoint (step 2) under the config that fits them and recompute
    from there: the same state as switching live to that config at step 2."""
    steps = 5
    rolled = _run(tmp_path, "live", "3:kill=1", steps=steps, parallel="tp=2,pp=1,dp=1", checkpoint_every=2,
                  heartbeat_timeout=2.0, collective_timeout=10.0)
    switched = _run(tmp_path / "ref", "live", "2:parallel=tp=1,pp=1,dp=1", steps=steps, parallel="tp=2,pp=1,dp=1")
    _check_training(rolled, steps)
    kill = rolled["events"][0]
    assert kill["outcome"] == "committed"
    by_step = {s["step"]: s for s in rolled["steps"]}
    assert by_step[3]["world_size"] == 1  # step 3 recomputed by the survivor after the rollback
    assert rolled["checksums"] and rolled["checksums"] == switched["checksums"]
    assert [s["loss"] for s in rolled["steps"]][2:] == [s["loss"] for s in switched["steps"]][2:]


@pytest.mark.long
def test_kill_in_checkpoint_mode_restarts_from_the_periodic_checkpoint(tmp_path, leave_through_checkpoint):
    """The restart-based path's answer to a kill -9: stop everything, restart the survivors from
    the last periodic checkpoint. It must end where a planned leave at that checkpoint ends."""
    steps = 5
    killed = _run(tmp_path, "checkpoint", "3:kill=1", steps=steps, parallel="tp=1,pp=1,dp=2", checkpoint_every=2)
    left = leave_through_checkpoint
    _check_training(killed, steps)
    assert killed["checksums"] and killed["checksums"] == left["checksums"]


@pytest.mark.long
def test_fp16_overflow_steps_and_the_loss_scale_survive_a_reconfiguration(tmp_path):
    """fp16 with a loss scale far too large: the first steps overflow and are skipped (no update,
    the scale backs off), then training goes on; a member leaving in the middle changes none of
    it: the scaler's state travels with the switch."""
    kw = dict(workers=2, parallel="tp=1,pp=1,dp=2", steps=8, global_batch=GLOBAL_BATCH, precision="fp16",
              initial_loss_scale=2.0**20)
    moved = run_local(RunSpec.mock(MODEL, events=parse_events("4:leave=1"), workdir=str(tmp_path / "moved"), **kw))
    still = run_local(RunSpec.mock(MODEL, events=[], workdir=str(tmp_path / "still"), **kw))
    assert [e["outcome"] for e in moved["events"]] == ["committed"]
    skipped = [s["skipped"] for s in moved["steps"]]
    assert skipped[0] and not all(skipped), skipped  # overflowed at first, then trains
    assert [s["samples"] for s in moved["steps"]] == [s["samples"] for s in still["steps"]]
    # the first step of the new world runs with the scale and the skipped-step count the old world
    # left, exactly as the uninterrupted run (DP 2 -> 1 changes only the reduction order, which may
    # later move a step across the overflow edge); a reset scaler would start again at 2**20
    for a, b in zip(moved["steps"][:5], still["steps"][:5]):
        assert (a["loss_scale"], a["skipped"]) == (b["loss_scale"], b["skipped"])
    assert moved["steps"][4]["loss_scale"] < kw["initial_loss_scale"]


@pytest.mark.long
def test_a_job_file_on_real_text_reads_the_samples_of_an_uninterrupted_run_and_finishes(tmp_path):
    """``run-local --job``: the manifest kubectl takes, on a real corpus and BPE tokenizer, through
    a leave, a join and a TP/PP change; every step reads exactly the samples the uninterrupted
    run reads, the losses track it, validation loss is the same in every layout, and the run
    ends with a complete final checkpoint."""
    import subprocess
    import sys

    import yaml

    from liveshard.runtime.agent.checkpoint import is_complete
    from liveshard.runtime.data.corpus import build_corpus

    corpus = build_corpus(str(tmp_path / "corpus"), vocab_size=512)
    job = {"apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob", "metadata": {"name": "text"},
           "spec": {"model": {"preset": MODEL, "vocab_size": 512}, "image": "local",
                    "workers": {"max": 2, "gpusPerWorker": 1}, "parallelism": {"tp": [1, 2], "pp": [1, 2]},
                    "training": {"data": {"blend": [{"prefix": corpus.data_prefix}], "split": "90,10,0"},
                                 "tokenizer": {"path": corpus.tokenizer_dir}, "trainIters": 8, "globalBatch": 4,
                                 "seqLength": 32, "precision": "fp32", "optimizer": {"lr": 3e-3},
                                 "schedule": {"warmupIters": 1}, "eval": {"interval": 2, "iters": 1}}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    runs = {}
    for name, events in (("moved", "2:leave=1 4:join=1 6:parallel=tp=1,pp=2,dp=1"), ("still", "")):
        out = tmp_path / f"{name}.json"
        subprocess.run([sys.executable, "-m", "liveshard.runtime.cli", "run-local", "--job", str(tmp_path / "job.yaml"),
                        "--procs", "2", "--parallel", "tp=2,pp=1,dp=1", "--events", events, "--quiet",
                        "--workdir", str(tmp_path / name), "--result", str(out)], check=True, timeout=600)
        runs[name] = json.loads(out.read_text())
    moved, still = runs["moved"], runs["still"]
    assert [e["outcome"] for e in moved["events"]] == ["committed"] * 3
    assert [s["step"] for s in moved["steps"]] == list(range(1, 9))
    assert [s["samples"] for s in moved["steps"]] == [list(range(4 * k, 4 * k + 4)) for k in range(8)]
    assert [s["samples"] for s in moved["steps"]] == [s["samples"] for s in still["steps"]]
    for a, b in zip(moved["steps"], still["steps"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["lr"] == pytest.approx(b["lr"])
    assert moved["steps"][-1]["loss"] < moved["steps"][0]["loss"]
    # validation: the same samples every time, so the same loss whatever the layout
    assert [e["step"] for e in moved["evals"]] == [2, 4, 6, 8]
    for a, b in zip(moved["evals"], still["evals"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    assert is_complete(moved["final_checkpoint"], 8) and is_complete(still["final_checkpoint"], 8)
