"""A job's checkpoints are its own: each records the job's identity (namespace, name, uid,
incarnation); a job continues only its own run, or the one spec.training.resume names, and a
checkpoint directory holding another job's run is refused at start with one line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from liveshard.runtime.agent.checkpoint import MARKER, newest_complete
from liveshard.runtime.agent.checkpoint_schedule import prune
from liveshard.runtime.contract.checkpoint import JobIdentity, foreign_run
from liveshard.runtime.contract.env import Env
from liveshard.runtime.errors import ConfigError

OLD = JobIdentity("default", "tiny-cpu", "uid-old", "uid-old")  # the job deleted, then applied again
NEW = JobIdentity("default", "tiny-cpu", "uid-new", "uid-new")


def env_of(identity: JobIdentity) -> dict[str, str]:
    return {Env.NAMESPACE: identity.namespace, Env.JOB: identity.name, Env.JOB_UID: identity.uid,
            Env.JOB_INCARNATION: identity.incarnation}


def save(root: Path, step: int, identity: JobIdentity | None) -> Path:
    d = root / f"step{step:08d}"
    d.mkdir(parents=True)
    meta = {"step": step, "config": "tp=1,pp=1,dp=1,ep=1", "files": {}}
    if identity is not None:
        meta["job"] = identity.to_dict()
    (d / MARKER).write_text(json.dumps(meta))
    return d


def test_the_identity_comes_from_the_pods_environment_and_matches_only_its_own_incarnation():
    assert JobIdentity.from_env(env_of(NEW)) == NEW
    assert JobIdentity.from_env({Env.JOB: "x"}) is None  # nothing names an incarnation: no checks
    own = {"job": NEW.to_dict()}
    assert NEW.owns(own) and not OLD.owns(own)  # same namespace and name, another incarnation
    assert not NEW.owns({"job": {**NEW.to_dict(), "namespace": "other"}})
    assert not NEW.owns({"step": 3})  # a checkpoint that records no identity is nobody's own
    local = JobIdentity.from_env({Env.JOB_INCARNATION: "9f3a"})
    assert str(local) == "run-local run 9f3a" and str(NEW) == "job default/tiny-cpu (uid uid-new)"


def test_a_new_job_never_continues_the_old_jobs_checkpoints(tmp_path):
    save(tmp_path, 2000, OLD)
    save(tmp_path, 40, NEW)
    assert newest_complete(tmp_path)["step"] == 2000  # without an identity: every checkpoint
    assert newest_complete(tmp_path, NEW)["step"] == 40
    assert newest_complete(tmp_path, JobIdentity("default", "tiny-cpu", "u3", "u3")) is None


def test_a_directory_with_another_jobs_run_is_refused_in_one_line_naming_whose_and_how_to_resume(tmp_path):
    assert foreign_run(tmp_path, NEW) is None  # empty
    save(tmp_path, 10, NEW)
    assert foreign_run(tmp_path, NEW) is None  # its own
    assert foreign_run(tmp_path, None) is None  # no identity: nothing to compare
    newest = save(tmp_path, 2000, OLD)
    save(tmp_path, 1000, OLD)
    refused = foreign_run(tmp_path, NEW)
    assert isinstance(refused, ConfigError) and "\n" not in str(refused)
    assert refused.field == "spec.checkpoint.path"
    assert "the run of job default/tiny-cpu (uid uid-old)" in str(refused)
    assert "not of this job default/tiny-cpu (uid uid-new)" in str(refused)
    assert f"spec.training.resume.path: {newest}" in refused.fix and "step 2000" in str(refused)
    save(tmp_path, 3000, None)  # an older liveshard's save, or an import: not this job's either
    assert "recorded no identity" in str(foreign_run(tmp_path, NEW))


def test_the_coordinator_refuses_to_start_and_fails_the_job_unless_resume_names_the_run(tmp_path, monkeypatch):
    from liveshard.runtime.commands.coordinator import _refuse_foreign_checkpoints
    from liveshard.runtime.contract.training import read_training

    for key, value in env_of(NEW).items():
        monkeypatch.setenv(key, value)
    newest = save(tmp_path, 2000, OLD)
    written = []

    class Source:
        def patch_status(self, status):
            written.append(status)

    args = argparse.Namespace(source="kubernetes", checkpoint_dir=str(tmp_path))
    training = read_training({"data": {"mock": True}, "trainIters": 3000, "globalBatch": 8})
    with pytest.raises(ConfigError, match="holds the run of job default/tiny-cpu"):
        _refuse_foreign_checkpoints(args, training, Source())
    (failure,) = written
    assert failure["runtimeFailure"]["reason"] == "ForeignCheckpoints"
    assert "spec.training.resume.path" in failure["runtimeFailure"]["message"]
    on_purpose = read_training({"data": {"mock": True}, "trainIters": 3000, "globalBatch": 8,
                                "resume": {"path": str(newest)}})
    _refuse_foreign_checkpoints(args, on_purpose, Source())  # named on purpose: it starts
    assert len(written) == 1


def test_retention_never_removes_another_jobs_checkpoints(tmp_path, monkeypatch):
    for key, value in env_of(NEW).items():
        monkeypatch.setenv(key, value)
    theirs = save(tmp_path, 2000, OLD)  # the run this job resumed from (spec.training.resume)
    mine = [save(tmp_path, step, NEW) for step in (2100, 2200, 2300)]
    (tmp_path / "step00002400").mkdir()  # this job's save in progress
    removed = prune(str(tmp_path), keep=2)
    assert removed == [str(mine[0])]
    assert theirs.exists() and (tmp_path / "step00002400").exists()


def test_a_run_local_run_refuses_a_workdir_with_an_earlier_runs_checkpoints(tmp_path):
    from liveshard.dev.localrun.driver import LocalRun, RunSpec

    run = RunSpec.mock("tiny-gpt", workers=1, parallel="tp=1,pp=1,dp=1", steps=4, global_batch=2, events=[],
                       workdir=str(tmp_path))
    first = LocalRun(run)
    first.refuse_foreign_checkpoints()  # empty: it starts
    save(first.checkpoint_dir, 4, JobIdentity("", "job", "", first.run_id))
    with pytest.raises(ConfigError, match=r"--workdir: .* holds the run of run-local run .*another --workdir"):
        LocalRun(run).refuse_foreign_checkpoints()
