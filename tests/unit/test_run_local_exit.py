"""``run-local`` tells the truth about how a run ended: a refusal by the coordinator is reported at
once with its reason, a job the coordinator failed says what to do, and a run that did not train
every step or left no final checkpoint is a failure naming the worker that died (no process is
started here: the driver reads a fake store)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from liveshard.dev.commands.run_local import unfinished
from liveshard.dev.localrun.driver import LocalRun, RunSpec
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.coordinator import PlanRequest
from liveshard.runtime.errors import RunFailed


class FakeStore:
    """What the driver reads of the coordinator's store: its status, and the posted requests."""

    def __init__(self) -> None:
        self.status: dict = {"history": []}
        self.posted: list[str] = []

    def get(self, key: str) -> str | None:
        return json.dumps(self.status) if key == Keys.COORDINATOR_STATUS else None

    def append(self, key: str, value: str) -> int:
        self.posted.append(value)
        return len(self.posted) - 1


@pytest.fixture
def job(tmp_path) -> LocalRun:
    return LocalRun(RunSpec.mock("tiny-gpt", workers=2, parallel="tp=1,pp=1,dp=2", steps=6, global_batch=4,
                                 events=[], workdir=str(tmp_path / "run")))


def _rejected(reason: str, why: str) -> dict:
    return {"generation": None, "outcome": f"rejected: {why}", "reason": reason}


def test_a_refused_request_ends_the_run_at_once_with_the_coordinators_reason(job):
    store = FakeStore()
    store.status["history"] = [_rejected("config change to tp=2", "an older refusal")]  # before the post
    job._post(store, PlanRequest(members=("w0", "w1"), config="tp=3,pp=1,dp=1", reason="config change to tp=3"))
    assert store.posted  # the request went out
    job._check_alive(job._status(store))  # nothing new: goes on
    store.status["history"].append(_rejected("a first world again", "someone else's refusal"))
    job._check_alive(job._status(store))  # another request's refusal is not ours
    store.status["history"].append(_rejected("config change to tp=3", "tp: 4 attention heads do not split over tp=3"))
    with pytest.raises(RunFailed, match=r"refused 'config change to tp=3': tp: 4 attention heads"):
        job._check_alive(job._status(store))


def test_wait_published_reports_the_refusal_instead_of_waiting(job, monkeypatch):
    store = FakeStore()
    store.latest_generation = lambda: 0  # the coordinator publishes nothing
    job._post(store, PlanRequest(members=("w0",), config="tp=3", reason="config change to tp=3"))
    store.status["history"].append(_rejected("config change to tp=3", "no"))
    with pytest.raises(RunFailed, match="refused"):
        job._wait_published(store, 1, timeout=30.0)


@pytest.mark.parametrize("every,hint", [(0, True), (2, False)])
def test_no_surviving_copy_says_how_to_have_one(tmp_path, every, hint):
    job = LocalRun(RunSpec.mock("tiny-gpt", workers=2, parallel="tp=2,pp=1,dp=1", steps=6, global_batch=4,
                                events=[], workdir=str(tmp_path / "run"), checkpoint_every=every))
    status = {"failure": {"reason": "NoSurvivingCopy", "message": "the world was lost and no checkpoint is left"}}
    with pytest.raises(RunFailed, match=r"the job failed \(NoSurvivingCopy\)") as e:
        job._check_alive(status)
    assert ("--checkpoint-every" in str(e.value)) is hint
    assert "\n" not in str(e.value)


def _report(tmp_path: Path, steps: int, final: str | None, exit_codes: dict) -> dict:
    return {"steps": [{"step": s} for s in range(1, steps + 1)], "final_checkpoint": final,
            "exit_codes": exit_codes, "workdir": str(tmp_path)}


def test_finished_means_every_step_and_the_final_checkpoint(tmp_path):
    assert unfinished(_report(tmp_path, 6, "/ckpt/step-6", {"w0": 0, "w1": -9}), 6) is None
    why = unfinished(_report(tmp_path, 6, None, {"w0": 0}), 6)
    assert why is not None and "no final checkpoint" in why


def test_a_dead_job_names_the_worker_and_its_last_words(tmp_path):
    (tmp_path / "w1.log").write_text("step 1\nTraceback (most recent call last):\n  ...\n"
                                     "OSError: [Errno 28] No space left on device\n\n")
    why = unfinished(_report(tmp_path, 3, None, {"w0": 0, "w1": 1, "w2": -9}), 6)
    assert why is not None
    assert "trained 3 of 6 steps" in why and "w1 exited with exit code 1" in why and "No space left on device" in why
    assert str(tmp_path) in why and "\n" not in why
    assert "trained 0 of 6 steps" in (unfinished(_report(tmp_path, 0, None, {}), 6) or "")


class _Exited:
    def __init__(self, code: int | None) -> None:
        self.returncode = code

    def poll(self) -> int | None:
        return self.returncode


def test_a_run_whose_workers_all_exited_fails_at_once_naming_the_first_failure(job):
    (job.dir / "w1.log").write_text("Traceback (most recent call last):\nRuntimeError: rendezvous failed\n")
    job.procs.workers = {"w0": _Exited(-9), "w1": _Exited(1), "w2": _Exited(None)}
    job._check_alive({})  # w2 still runs
    job.procs.workers["w2"] = _Exited(0)
    with pytest.raises(RunFailed, match=r"every worker exited; w1 exited with exit code 1: RuntimeError: rendezvous failed"):
        job._check_alive({})


class _NoMembers:
    def members(self) -> list[str]:
        return []

    def get(self, key: str) -> str | None:
        return None


@pytest.mark.parametrize("code,words", [
    (-9, ("w0 exited with signal SIGKILL before registering",)),
    (-15, ("w0 exited with signal SIGTERM before registering",)),
    (-11, ("w0 exited with signal SIGSEGV",)),
    (3, ("w0 exited with exit code 3 before registering: boom: the last words",)),
    (137, ("w0 exited with exit code 137 (SIGKILL)",)),
])
def test_a_crash_line_names_the_exit_code_or_the_signal(job, code, words):
    (job.dir / "w0.log").write_text("INFO starting\nboom: the last words\n")
    job.procs.workers = {"w0": _Exited(code), "w1": _Exited(None)}
    with pytest.raises(RunFailed) as e:
        job._wait_registered(_NoMembers(), ["w0", "w1"], timeout=5)
    for w in words:
        assert w in str(e.value), str(e.value)
    if code < 0:  # a signal: nothing the process printed explains it
        assert "the last words" not in str(e.value)


def test_a_worker_that_refused_its_input_is_a_job_failure_with_its_line(job):
    """A worker that finds its input bad (a lying dataset index) exits 2 with one line: the run
    fails with that line, not with "exited before registering"."""
    line = ("liveshard worker: error: spec.training.data.blend[0].prefix: /d/x.idx: sequence 3 has a negative "
            "length (-5 tokens) (fix: write PREFIX.bin and PREFIX.idx again with liveshard prepare-data)")
    (job.dir / "w1.log").write_text("INFO loading\n" + line + "\n")
    job.procs.workers = {"w0": _Exited(None), "w1": _Exited(2)}
    with pytest.raises(RunFailed) as e:
        job._wait_registered(_NoMembers(), ["w0", "w1"], timeout=5)
    text = str(e.value)
    assert text.startswith("w1 refused the job (exit code 2, before registering): spec.training.data.blend[0]"), text
    assert "negative length" in text and "\n" not in text


def test_a_port_taken_before_the_coordinator_binds_it_is_retried_and_a_dead_coordinator_named(job, monkeypatch):
    """``serve`` starts the coordinator on a free port; a port taken meanwhile (the ephemeral range
    is shared) makes it exit "address already in use": another port is tried. A coordinator that
    exits for another reason ends the run at once with its log's last line, not a 30 s timeout."""
    import subprocess
    import sys

    from liveshard.dev.localrun import driver
    from liveshard.runtime.control.store import serve_store

    ports = iter([101, 102])
    monkeypatch.setattr(driver, "free_port", lambda: next(ports))
    servers = []

    def start(port: int) -> None:
        log = job.dir / "coordinator.log"
        if port == 101:  # exits as a coordinator that lost the race for its port
            log.write_text("RuntimeError: ... EADDRINUSE: address already in use\n")
            job.procs.coordinator = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
            job.procs.coordinator.wait()
        else:  # serves the store (in this process) while "its process" lives
            servers.append(serve_store("127.0.0.1", 0))
            job.procs.coordinator = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])

    monkeypatch.setattr(job, "start_coordinator", start)
    monkeypatch.setattr(job, "connect", lambda port, **kw: driver.LocalRun.connect(
        job, servers[0].port if port == 102 else port, **kw))
    port, store = job.serve()
    assert port == 102 and store is not None
    job.procs.coordinator.kill()

    def dies(port: int) -> None:
        (job.dir / "coordinator.log").write_text("Traceback ...\nConfigError: --checkpoint-dir: not writable\n")
        job.procs.coordinator = subprocess.Popen([sys.executable, "-c", "raise SystemExit(2)"])
        job.procs.coordinator.wait()

    monkeypatch.setattr(driver, "free_port", lambda: 103)
    monkeypatch.setattr(job, "start_coordinator", dies)
    with pytest.raises(RunFailed, match=r"exited with exit code 2 before serving .*: ConfigError: --checkpoint-dir"):
        job.serve()
