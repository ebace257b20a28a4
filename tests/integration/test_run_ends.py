"""The two ends of a run, with real processes (CPU, gloo; ``dev.localrun.end_faults``).

* The final checkpoint on a **full disk**: a real tmpfs, mounted in a user and mount namespace of
  its own (``unshare --user --map-root-user --mount``: no privilege needed) under the job's
  checkpoint directory, so the workers' writes fail with ``ENOSPC``. The save goes to the
  fallback directory; or waits until space comes back (the tmpfs is grown while the workers
  wait); or, with nowhere to go, the job fails with ``FinalCheckpointFailed`` and every worker
  exits 1 with that one line. ``CheckpointFailing`` is reported meanwhile.
* A worker **SIGKILLed during the final save**: the survivors' world is cut off, the coordinator
  recovers it (live from the survivors' replicas, or by a restore of the newest complete
  checkpoint when the state has no other copy) and the final checkpoint is saved in the new world.
* A worker **SIGKILLed while the first world starts** (after the members met, before the world's
  rendezvous): the survivors' rendezvous fails, they report it, and the coordinator makes the
  first world again without the dead worker.

Each ends with the job finished and a final checkpoint that verifies, or failed with one line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from liveshard.dev.localrun.driver import RunSpec
from liveshard.dev.localrun.end_faults import run_end

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
STEPS = 3
GLOBAL_BATCH = 6


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    return probe.returncode == 0


needs_namespaces = pytest.mark.skipif(not _namespaces_work(),
                                      reason="unprivileged user and mount namespaces are not available here")


def _on_full_tmpfs(tmp_path: Path, size: str, *args: str) -> dict:
    """Two workers (dp=2) training STEPS steps with the checkpoint directory on a tmpfs of ``size``
    (the checkpoint is about 2.4 MB); the result of ``end_faults``."""
    workdir = tmp_path / "run"
    (workdir / "checkpoints" / "periodic").mkdir(parents=True)
    out = tmp_path / "end.json"
    command = (f"mount -t tmpfs -o size={size} tmpfs {workdir}/checkpoints/periodic && exec {sys.executable} -m "
               f"liveshard.dev.localrun.end_faults --workdir {workdir} --out {out} --model {MODEL} --workers 2 "
               f"--parallel tp=1,pp=1,dp=2 --steps {STEPS} --global-batch {GLOBAL_BATCH} " + " ".join(args))
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", command],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def _events(result: dict, kind: str) -> dict[str, list[dict]]:
    return {w: [e for e in r["events"] if e["kind"] == kind] for w, r in result["results"].items()}


def _finished_and_verified(result: dict, survivors: list[str]) -> str:
    finished = result["status"]["finished"]
    assert result["status"]["failure"] is None, result["status"]["failure"]
    assert finished is not None and finished["step"] == STEPS, result["status"]
    assert result["verify"] is None, result["verify"]  # every file of the final checkpoint as saved
    assert finished["checkpoint"] == result["report"]["final_checkpoint"]
    assert {w: result["exit_codes"][w] for w in survivors} == dict.fromkeys(survivors, 0)
    steps = result["report"]["steps"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert [s["consumed_samples"] for s in steps] == [GLOBAL_BATCH * k for k in range(1, STEPS + 1)]
    return finished["checkpoint"]


@pytest.mark.long  # the fallback decision is unit-tested; the full-disk runs are bench_faults' rows
@needs_namespaces
def test_a_final_checkpoint_on_a_full_disk_goes_to_the_fallback_directory(tmp_path):
    fallback = tmp_path / "fallback"
    result = _on_full_tmpfs(tmp_path, "2m", "--fallback", str(fallback), "--patience", "60")
    path = _finished_and_verified(result, ["w0", "w1"])
    assert Path(path).parent == fallback  # outside the tmpfs, so it outlived it and verified here too
    failed = result["status"]["checkpoints"]["failed"]
    assert "No space left on device" in failed["error"] and failed["count"] == 1
    assert failed["resolved"] == STEPS  # CheckpointFailing cleared once the fallback held it
    assert result["status"]["checkpoints"]["latest"]["path"] == path


@pytest.mark.long
@needs_namespaces
def test_a_final_checkpoint_waits_for_space_and_is_saved_where_it_belongs(tmp_path):
    """The disk is full before the save (the free-space check finds it); once a save has failed
    the tmpfs is grown, as an operator freeing space would, and the next attempt succeeds."""
    result = _on_full_tmpfs(tmp_path, "512k", "--patience", "120", "--grow-tmpfs", "64m")
    assert result["grown"] is not None
    path = _finished_and_verified(result, ["w0", "w1"])  # verified inside the namespace
    assert Path(path).parent == tmp_path / "run" / "checkpoints" / "periodic"
    failed = result["grown"]["failed"]  # reported while the workers waited
    assert "No space left" in failed["error"] or "[Errno 28]" in failed["error"], failed
    assert "in 5 s" in failed["error"]  # says when the next attempt comes
    # and the console said so as it happened, in one line (run-local prints the run's notices)
    notices = [json.loads(line)["text"] for line in (tmp_path / "run" / "notices.jsonl").read_text().splitlines()]
    assert f"final checkpoint: no space left in {tmp_path / 'run' / 'checkpoints' / 'periodic'}; next attempt in 5 s" \
        in notices, notices


@pytest.mark.long
@needs_namespaces
def test_a_final_checkpoint_with_nowhere_to_go_fails_the_job_with_one_line(tmp_path):
    result = _on_full_tmpfs(tmp_path, "2m", "--patience", "3")
    failure = result["status"]["failure"]
    assert failure["reason"] == "FinalCheckpointFailed", result["status"]
    assert "could not be saved" in failure["message"] and "No space left on device" in failure["message"]
    assert result["status"]["finished"] is None and result["report"]["final_checkpoint"] is None
    assert result["exit_codes"] == {"w0": 1, "w1": 1}
    for w in ("w0", "w1"):
        assert result["results"][w]["phase"] == "failed"
        tries = _events(result, "checkpoint_failed")[w]  # the first try, and one after 3 s
        assert [t["error"].rsplit("; ", 1)[-1] for t in tries] == ["next in " + f"{tmp_path}/run/checkpoints/periodic in 3 s",
                                                                  "giving up"], tries
        last = (tmp_path / "run" / f"{w}.log").read_text().strip().splitlines()[-1]
        assert last == f"liveshard worker: failed: {failure['message']}"


@pytest.mark.parametrize(("parallel", "checkpoint_every"), [
    ("tp=1,pp=1,dp=3", 0),  # the survivors hold replicas of everything: recovered live
    # the victim's stage has no other copy: restored from the newest complete checkpoint (step 1;
    # step 2's was still being written), steps 2 and 3 trained again, then the final save
    pytest.param("tp=1,pp=3,dp=1,layers=2+1+1", 1, marks=pytest.mark.long),
])
def test_a_worker_killed_during_the_final_save_is_recovered_and_the_checkpoint_saved_again(
        tmp_path, parallel, checkpoint_every):
    run = RunSpec.mock(MODEL, workers=3, parallel=parallel, steps=STEPS, global_batch=GLOBAL_BATCH, events=[],
                       workdir=str(tmp_path / "run"), heartbeat_timeout=2.0, collective_timeout=300.0,
                       checkpoint_every=checkpoint_every)
    result = run_end(run, kill=(2, "final-save"))
    (tmp_path / "end.json").write_text(json.dumps(result, default=str))
    assert result["killed"]["at"] == "final-save:0"
    _finished_and_verified(result, ["w0", "w1"])
    assert result["status"]["finished"]["generation"] >= 1  # saved by the world without the victim
    # released by the cut-off, not by the collective timeout (300 s)
    assert result["status"]["finished"]["time"] - result["killed"]["time"] < 120
    for w in ("w0", "w1"):  # each survivor: its world broke in the final save (a collective timeout
        # of 300 s never came into it: the cut-off released it), then it finished
        broken = _events(result, "broken")[w]
        assert [b.get("where") for b in broken] == ["during the final checkpoint"], result["results"][w]["events"]
        assert result["results"][w]["phase"] == "finished"
    if checkpoint_every:
        assert any(e["kind"] == "restore" for w in ("w0", "w1") for e in result["results"][w]["events"])


@pytest.mark.long
def test_a_worker_killed_while_the_first_world_starts_leaves_a_first_world_of_the_survivors(tmp_path):
    run = RunSpec.mock(MODEL, workers=3, parallel="tp=1,pp=1,dp=3", steps=STEPS, global_batch=GLOBAL_BATCH,
                       events=[], workdir=str(tmp_path / "run"), heartbeat_timeout=2.0, collective_timeout=10.0)
    result = run_end(run, kill=(2, "start"))
    (tmp_path / "end.json").write_text(json.dumps(result, default=str))
    assert result["killed"]["at"] == "start:0"
    _finished_and_verified(result, ["w0", "w1"])
    history = [h for h in result["status"]["history"] if h.get("generation") is not None]
    assert history[0]["generation"] == 0 and history[0]["outcome"].startswith("aborted: member w2 died")
    assert history[-1]["outcome"] == "committed" and history[-1]["world_size"] == 2
    for w in ("w0", "w1"):  # the survivors' rendezvous failed; they reported it and started again
        assert len(_events(result, "start-failed")[w]) == 1, result["results"][w]["events"]
    assert {s["world_size"] for s in result["report"]["steps"]} == {2}
