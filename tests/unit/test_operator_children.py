"""Children the API server refuses are reported in the job's status, not retried blindly."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import pytest
from kubernetes.client.rest import ApiException

from liveshard.operator.handlers import jobs
from liveshard.operator.reconcile import Decision


class Refusing:
    def __init__(self, status: int) -> None:
        self.status = status

    async def create(self, obj):
        e = ApiException(status=self.status, reason="Unprocessable Entity")
        e.body = json.dumps({"message": f'Service "{obj["metadata"]["name"]}" is invalid: metadata.name'})
        raise e


class Ctx:
    def __init__(self, kube) -> None:
        self.kube = kube


POD = {"kind": "Service", "metadata": {"name": "9lives"}}


def test_a_refused_child_becomes_a_condition_an_event_and_a_message():
    refused: list[str] = []
    assert asyncio.run(jobs._create(Ctx(Refusing(422)), POD, refused)) is False
    assert refused == ['Service 9lives: 422 Service "9lives" is invalid: metadata.name']
    d = Decision()
    jobs._report_refused(d, refused, datetime(2026, 1, 1, tzinfo=UTC), 4)
    [cond] = [c for c in d.status["conditions"] if c["type"] == "ChildrenCreated"]
    assert cond["status"] == "False" and cond["reason"] == "Refused" and "9lives" in cond["message"]
    assert cond["observedGeneration"] == 4
    assert "refused" in d.status["message"] and d.events[0][1] == "CreateRefused"
    assert d.requeue_after == jobs.REFUSED_RETRY_SECONDS


def test_a_server_error_is_raised_for_kopf_to_retry():
    with pytest.raises(ApiException):
        asyncio.run(jobs._create(Ctx(Refusing(503)), POD, []))


def test_a_job_whose_spec_is_refused_has_its_children_not_created():
    """The operator refused the spec (nothing was tried): ChildrenCreated is False with why; a
    job whose objects were created before an edit it refuses keeps the True condition (they exist)."""
    now = datetime(2026, 1, 1, tzinfo=UTC)
    d = Decision(status={"message": "spec.model.preset: unknown preset 'x'", "conditions": []})
    jobs._report_refused(d, [], now, 2)
    [cond] = [c for c in d.status["conditions"] if c["type"] == "ChildrenCreated"]
    assert cond["status"] == "False" and cond["reason"] == "SpecRefused" and "unknown preset" in cond["message"]
    created = Decision(status={"message": "bad edit", "conditions": [
        {"type": "ChildrenCreated", "status": "True", "reason": "Created", "message": "",
         "lastTransitionTime": "2025-12-31T00:00:00Z"}]})
    jobs._report_refused(created, [], now, 3)
    [cond] = [c for c in created.status["conditions"] if c["type"] == "ChildrenCreated"]
    assert cond["status"] == "True" and cond["reason"] == "Created"
