"""The local driver retries a join whose generation aborted (``LocalRun._join``), and fails the
run with every try's outcome when none commits.

The coordinator is scripted here (what each generation ended, the status it reports); the
requests go through a real in-process store and are read back with the coordinator's own plan
source. A real run whose join aborts is in ``tests/integration/test_run_local.py``.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from liveshard.dev.localrun import driver
from liveshard.dev.localrun.driver import LocalRun, RunSpec
from liveshard.dev.localrun.events import parse_events
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.control.store import JobStore
from liveshard.runtime.coordinator import PlanRequest, StorePlanSource


class Proc:
    def __init__(self, code: int | None = None) -> None:
        self.code = code

    def poll(self) -> int | None:
        return self.code


class Scripted:
    """The coordinator's answers: each generation's outcome in turn, and its status."""

    def __init__(self, job: LocalRun, store: JobStore, outcomes: list[str], dead_polls: int = 0) -> None:
        self.job, self.store, self.outcomes = job, store, list(outcomes)
        self.dead_polls = dead_polls  # status polls during which the joiner is still dead
        self.decided: list[int] = []

    def status(self, store) -> dict:
        dead = ["w2"] if self.dead_polls > 0 else []
        self.dead_polls -= 1
        return {"generation": 0, "members": ["w0", "w1"], "standbys": [], "pending": None, "dead": dead,
                "telemetry": {"w0": {"state": "training"}, "w1": {"state": "training"}}, "history": [],
                "progress": {"step": 7}}

    def wait_generation(self, store, gen: int, timeout: float = 600.0, while_waiting=None) -> dict:
        outcome = self.outcomes.pop(0)
        self.decided.append(gen)
        self.job.history[gen] = {"generation": gen, "outcome": outcome}
        self.store.set(Keys.LATEST, str(gen))
        return {"generation": gen, "members": ["w0", "w1"], "standbys": [], "pending": None,
                "last_outcome": outcome}


@pytest.fixture()
def job(tmp_path, monkeypatch, request):
    events = getattr(request, "param", "5:join=1")
    run = RunSpec.mock("tiny-gpt", workers=2, parallel="tp=1,pp=1,dp=2", steps=20, global_batch=4,
                       events=parse_events(events), workdir=str(tmp_path), join_attempts=3, join_backoff=0.5)
    job = LocalRun(run)
    job.procs.workers = {"w0": Proc(), "w1": Proc(), "w2": Proc()}
    monkeypatch.setattr(job, "_wait_published", lambda store, gen, timeout=60.0: None)
    monkeypatch.setattr(job, "_check_alive", lambda status=None: None)
    monkeypatch.setattr(job, "_wait_registered", lambda store, wids, timeout=600.0: None)
    sleeps: list[float] = []
    monkeypatch.setattr(driver.time, "sleep", sleeps.append)
    job.sleeps = sleeps
    return job


def _script(job: LocalRun, monkeypatch, outcomes: list[str], dead_polls: int = 0) -> tuple[JobStore, Scripted]:
    store = JobStore(dist.HashStore(), secret=b"test-secret")
    coordinator = Scripted(job, store, outcomes, dead_polls)
    monkeypatch.setattr(job, "_wait_generation", coordinator.wait_generation)
    monkeypatch.setattr(job, "_status", coordinator.status)
    return store, coordinator


def _requests(store: JobStore) -> list[PlanRequest]:
    source, out = StorePlanSource(store), []
    while (request := source.poll()) is not None:
        out.append(request)
    return out


def _join(job: LocalRun, store: JobStore) -> dict:
    request = PlanRequest(members=("w0", "w1", "w2"), reason="1 worker(s) joined", switch_at_step=5)
    return job._join(store, request, 1, job.run.events[0], ("w2",))


@pytest.mark.parametrize(("job", "switch"), [("5:join=1", 8), ("5:join=1 7:slow=0@1", 7)], indirect=["job"])
def test_an_aborted_join_is_requested_again_once_the_joiner_is_back(job, switch, monkeypatch):
    store, coordinator = _script(job, monkeypatch, ["aborted: member w2 died during the transition", "committed"],
                                 dead_polls=3)
    status = _join(job, store)
    assert status["last_outcome"] == "committed"
    first, second = _requests(store)
    # the step after the one the world reached (7), at the latest the next event's step
    assert first.switch_at_step == 5 and second.switch_at_step == switch
    assert set(second.members) == {"w0", "w1", "w2"}
    assert coordinator.decided == [1, 2]  # the retry is the next generation
    assert coordinator.dead_polls < 0  # it waited until the joiner was no longer dead
    assert job.sleeps[0] == 0.5  # back-off before the retry
    assert store.get(Keys.release(5)) == "1"
    assert job.join_retries == {5: [{"generation": 1, "outcome": "aborted: member w2 died during the transition"}]}
    assert job._retried_generations == {1}  # the event report skips it


def test_a_join_that_never_commits_fails_the_run_with_every_tries_outcome(job, monkeypatch):
    store, _ = _script(job, monkeypatch, ["aborted: a", "aborted: b", "aborted: c", "committed"])
    with pytest.raises(RuntimeError, match=r"did not commit in 3 tries: generation 1 aborted: a; "
                                           r"generation 2 aborted: b; generation 3 aborted: c"):
        _join(job, store)
    assert len(_requests(store)) == 3
    assert [s for s in job.sleeps if s >= 0.5] == [0.5, 1.0]  # doubling back-off


def test_a_joiner_that_exited_after_the_abort_fails_the_run_at_once(job, monkeypatch):
    store, _ = _script(job, monkeypatch, ["aborted: x", "committed"])
    job.procs.workers["w2"] = Proc(code=1)
    with pytest.raises(RuntimeError, match="w2 exited with exit code 1 after the join aborted"):
        _join(job, store)
    assert len(_requests(store)) == 1
