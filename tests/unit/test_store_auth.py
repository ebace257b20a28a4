"""The job's store accepts only values made with the job's secret (no processes)."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from liveshard.runtime.contract.keys import SECRET_ENV, Keys
from liveshard.runtime.control.protocol import WorldPlan
from liveshard.runtime.control.store import JobStore, job_secret
from liveshard.runtime.coordinator import PlanRequest, StorePlanSource
from liveshard.runtime.errors import ConfigError


def test_values_without_the_jobs_secret_read_as_absent():
    raw = dist.HashStore()
    job = JobStore(raw, "j", b"s3cret")
    job.publish_plan(WorldPlan(generation=0, config="tp=1,pp=1,dp=2", members=("a", "b")))
    assert job.plan(0).members == ("a", "b") and job.latest_generation() == 0
    attacker = JobStore(raw, "j")  # a bare client on the same port, no secret
    attacker.set(Keys.STOP, "1")
    attacker.set(Keys.plan(1), WorldPlan(generation=1, config="tp=1,pp=1,dp=3", members=("a", "b", "evil")).to_json())
    attacker.set(Keys.LATEST, "1")
    assert not job.has(Keys.STOP) and job.plan(1) is None and job.latest_generation() == -1
    wrong = JobStore(raw, "j", b"guess")
    wrong.set_json(Keys.member("evil"), {"host": "x"})
    assert job.get_json(Keys.member("evil")) is None


def test_a_value_cannot_be_replayed_under_another_key_or_altered():
    raw = dist.HashStore()
    job = JobStore(raw, "j", b"s3cret")
    job.set(Keys.switch(3), "17")
    sealed = job.store.get(Keys.switch(3)).decode()  # job.store: the raw (prefixed) c10d store
    job.store.set(Keys.switch(4), sealed)  # the same bytes under another key
    assert job.get(Keys.switch(4)) is None and job.get(Keys.switch(3)) == "17"
    mac, _, _ = sealed.partition(".")
    job.store.set(Keys.switch(3), f"{mac}.18")
    assert job.get(Keys.switch(3)) is None


def test_a_forged_plan_request_is_never_seen_by_the_coordinator():
    raw = dist.HashStore()
    job = JobStore(raw, "j", b"s3cret")
    forged = JobStore(raw, "j")
    StorePlanSource.post(forged, PlanRequest(members=("evil",), config="tp=1,pp=1,dp=1"))
    StorePlanSource.post(job, PlanRequest(members=("a",), config="tp=1,pp=1,dp=1"))
    source = StorePlanSource(job)
    seen = [source.poll() for _ in range(3)]
    assert [r.members for r in seen if r is not None] == [("a",)]
    assert json.loads(job.store.get(Keys.request(1)).decode().partition(".")[2])["members"] == ["a"]


def test_a_pod_the_operator_built_refuses_to_run_without_its_secret(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.setenv("LIVESHARD_ROLE", "worker")
    with pytest.raises(ConfigError, match=SECRET_ENV):
        job_secret()
    monkeypatch.setenv(SECRET_ENV, "abc")
    assert job_secret() == b"abc"
    monkeypatch.delenv("LIVESHARD_ROLE")
    monkeypatch.delenv(SECRET_ENV)
    assert job_secret() is None  # a local tool without one: unauthenticated, as its own choice
