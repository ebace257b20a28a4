"""Edits are honoured or refused: a field an edit could not reach in the running job
(spec.training: its pods train with the spec they started with; the model; gpusPerWorker; network)
is refused by the CRD's transition rule and by the webhook in the same words, and everything else
may change (status.observedGeneration names the spec in force). Also the schema's bound on lr and
times written with their microseconds."""

from __future__ import annotations

import copy
from datetime import UTC, datetime

import pytest
from test_operator_crd import CRD, CRD_PATH, GOOD

from liveshard.dev.localcluster.crd_validation import CRDValidator, InvalidObject
from liveshard.operator.admission import FIXED_FIELDS, TRAINING_FIXED, edit_problem, review
from liveshard.operator.policy import JobPolicy
from liveshard.runtime.contract.status import PlanAck
from liveshard.runtime.contract.times import parse_time


@pytest.fixture(scope="module")
def validator():
    return CRDValidator(CRD)


def transition_rules(node, path=()):
    """``{field path: message}`` of every ``self == oldSelf`` rule in the schema."""
    out = {}
    for rule in node.get("x-kubernetes-validations") or ():
        if "oldSelf" in rule["rule"]:
            out[path] = rule["message"]
    for key, child in (node.get("properties") or {}).items():
        out.update(transition_rules(child, (*path, key)))
    return out


def test_the_webhook_refuses_the_edits_the_crds_transition_rules_refuse_in_the_same_words():
    schema = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = transition_rules(schema)
    # the spec-level rule on network is written on spec (fieldPath .network)
    assert {path or ("network",): message for path, message in rules.items()} == FIXED_FIELDS
    assert TRAINING_FIXED in CRD_PATH.read_text()


def review_update(old: dict, new: dict) -> dict:
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u1", "operation": "UPDATE", "object": new, "oldObject": old}}
    return review(body, JobPolicy())["response"]


def test_a_patched_train_iters_is_refused_by_both_with_why_and_a_scale_is_allowed(validator):
    old = validator.validate(GOOD)
    longer = copy.deepcopy(old)
    longer["spec"]["training"]["trainIters"] = 3000
    with pytest.raises(InvalidObject) as e:
        validator.validate(longer, old)
    assert any(TRAINING_FIXED in err for err in e.value.errors), e.value.errors
    answer = review_update(old, longer)
    assert not answer["allowed"] and answer["status"]["message"] == f"spec.training: {TRAINING_FIXED}"
    assert "training.resume.path" in answer["status"]["message"]
    gpus = copy.deepcopy(old)
    gpus["spec"]["workers"]["gpusPerWorker"] = 4
    assert review_update(old, gpus)["status"]["message"] == "spec.workers.gpusPerWorker: workers.gpusPerWorker is immutable"
    scaled = copy.deepcopy(old)
    scaled["spec"]["workers"]["replicas"] = 4
    scaled["spec"]["elasticity"]["scaleUpCooldownSeconds"] = 60
    validator.validate(scaled, old)
    assert review_update(old, scaled)["allowed"]


def test_edit_problem_treats_a_field_added_or_removed_as_a_change():
    spec = copy.deepcopy(GOOD["spec"])
    assert edit_problem(spec, copy.deepcopy(spec)) is None
    assert edit_problem(spec, {**spec, "network": {"extraEgress": []}}).startswith("spec.network: ")
    assert edit_problem(spec, {k: v for k, v in spec.items() if k != "training"}).startswith("spec.training: ")


@pytest.mark.parametrize("lr,ok", [(-0.001, False), (0, False), (1.5, False), (1, True), (3e-4, True)])
def test_lr_is_bounded_by_the_schema(validator, lr, ok):
    job = copy.deepcopy(GOOD)
    job["spec"]["training"]["optimizer"] = {"lr": lr}
    if ok:
        validator.validate(job)
        return
    with pytest.raises(InvalidObject) as e:
        validator.validate(job)
    assert any("spec.training.optimizer.lr" in err for err in e.value.errors), e.value.errors
    assert not any("minLr" in err for err in e.value.errors)


def test_every_field_explains_itself():
    missing = []

    def walk(node, path):
        for key, child in (node.get("properties") or {}).items():
            if not child.get("description"):
                missing.append(f"{path}{key}")
            walk(child, f"{path}{key}.")
        if isinstance(node.get("items"), dict):
            walk(node["items"], path)
    walk(CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"], "")
    assert missing == []


def test_times_keep_their_microseconds():
    at = datetime(2026, 11, 29, 9, 0, 1, 250000, tzinfo=UTC)
    assert parse_time(at.timestamp()) == at
    assert PlanAck(3, parse_time(at.timestamp())).to_status()["appliedAt"] == "2026-11-29T09:00:01.250000Z"
