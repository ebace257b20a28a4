"""The CRD follows Kubernetes' API conventions: camelCase fields (``spec.model`` included),
durations in ``*Seconds``, conditions shaped like ``metav1.Condition``. The old spellings are
still read, each with a warning naming the new one, and never both at once."""

from __future__ import annotations

import copy
import re
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from liveshard.dev.localcluster.crd_validation import CRDValidator
from liveshard.operator.admission import review
from liveshard.operator.conditions import REASON, reason_of, set_condition
from liveshard.operator.policy import JobPolicy
from liveshard.operator.reconcile import reconcile
from liveshard.runtime.commands import training_args
from liveshard.runtime.contract.env import Defaults
from liveshard.runtime.contract.jobspec import deprecated_fields, read_checkpointing, read_spec
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.presets import PRESETS
from liveshard.runtime.spec import CRD_NAMES, ModelSpec, load_model

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "elastictrainingjob.yaml").read_text())
SNAKE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128,
         "max_sequence_length": 32, "num_query_groups": 2, "position_embedding_type": "rope"}
CAMEL = {"numLayers": 2, "hiddenSize": 64, "numAttentionHeads": 4, "vocabSize": 128,
         "maxSequenceLength": 32, "numQueryGroups": 2, "positionEmbeddingType": "rope"}


def _job(model: dict, **spec: object) -> dict:
    return {"apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob",
            "metadata": {"name": "conv", "namespace": "ml", "uid": "u1", "generation": 3,
                         "creationTimestamp": "2026-03-01T11:00:00Z", "resourceVersion": "7"},
            "spec": {"model": model, "image": "img", "workers": {"max": 2, "gpusPerWorker": 1},
                     "training": {"data": {"mock": True}, "trainIters": 10, "globalBatch": 4}, **spec}}


# ---- spec.model ---------------------------------------------------------------------------------
def test_camel_case_and_megatron_names_read_the_same_model():
    assert ModelSpec.from_dict(CAMEL) == ModelSpec.from_dict(SNAKE)
    assert ModelSpec.from_dict({**CAMEL, "name": "x"}).name == "x"  # one-word fields: one spelling


def test_a_field_in_both_spellings_is_refused_naming_the_new_one():
    with pytest.raises(ConfigError) as e:
        ModelSpec.from_dict({**CAMEL, "num_layers": 2}, source="spec.model")
    assert e.value.field == "spec.model.numLayers" and "num_layers" in e.value.problem


@pytest.mark.parametrize(("model", "field"), [
    ({k: v for k, v in CAMEL.items() if k != "vocabSize"}, "spec.model.vocabSize"),
    ({k: v for k, v in SNAKE.items() if k != "vocab_size"}, "spec.model.vocab_size"),
    ({**CAMEL, "numQueryGroups": 3}, "spec.model.numQueryGroups"),
    ({**SNAKE, "num_query_groups": 3}, "spec.model.num_query_groups"),
    ({"preset": "tiny-gpt", "numQueryGroups": 5}, "spec.model.numQueryGroups"),
    ({**CAMEL, "numLayer": 3}, "spec.model.numLayer"),
])
def test_errors_name_the_field_as_the_job_spells_it(model, field):
    with pytest.raises(ConfigError) as e:
        read_spec(_job(model)["spec"])
    assert e.value.field == field, str(e.value)


def test_to_crd_round_trips_and_uses_only_the_crds_names():
    props = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    model_props = props["model"]["properties"]
    for spec in PRESETS.values():
        crd = spec.to_crd()
        assert ModelSpec.from_dict(crd) == spec
        assert not deprecated_fields({"model": crd}), spec.name
        for key in crd:
            assert key in model_props and not model_props[key].get("description", "").startswith("deprecated")


def test_to_crd_leaves_out_what_the_model_does_not_use():
    """--print-model: no expert fields for a dense model, no rope fields without rope, no
    multi-latent attention fields without it (the round trip above still holds)."""
    gpt, llama, moe = PRESETS["gpt-125m"].to_crd(), PRESETS["llama3-8b"].to_crd(), PRESETS["qwen3-30b-a3b"].to_crd()
    for dense in (gpt, llama):
        assert not [k for k in dense if k.startswith("moe") or k == "numMoeExperts"], dense
        assert not {"qLoraRank", "kvLoraRank", "vHeadDim"} & set(dense)
    assert not {"rotaryBase", "ropeScaling", "ropeScalingFactor"} & set(gpt)
    assert {"rotaryBase", "ropeScaling", "ropeScalingFactor"} <= set(llama)  # Llama 3.1's scaling
    assert moe["numMoeExperts"] == 128 and "moeRouterTopk" in moe and "ropeScalingFactor" not in moe


def test_a_preset_with_camel_case_overrides(tmp_path):
    job = read_spec(_job({"preset": "tiny-llama", "vocabSize": 1024})["spec"])
    assert job.model.vocab_size == 1024 and job.model.num_layers == PRESETS["tiny-llama"].num_layers
    f = tmp_path / "m.yaml"
    f.write_text("model:\n  preset: tiny-llama\n  vocabSize: 1000\n")
    assert load_model(str(f)).vocab_size == 1000


def test_a_camel_case_params_dtype_contradicting_the_precision_is_refused():
    spec = _job({"preset": "tiny-gpt", "paramsDtype": "bf16"})["spec"]
    spec["training"]["precision"] = "fp32"
    with pytest.raises(ConfigError) as e:
        read_spec(spec)
    assert e.value.field == "spec.training.precision" and "paramsDtype" in e.value.problem


# ---- spec.checkpoint.intervalSeconds ----------------------------------------------------------------
def test_checkpoint_interval_in_seconds_minutes_read_as_the_old_spelling():
    assert read_checkpointing(None).interval_seconds == Defaults.CHECKPOINT_INTERVAL == 1800
    assert read_checkpointing({"intervalSeconds": 90}).interval_seconds == 90
    assert read_checkpointing({"intervalMinutes": 10}).interval_seconds == 600
    with pytest.raises(ConfigError) as e:
        read_checkpointing({"intervalSeconds": 60, "intervalMinutes": 1})
    assert e.value.field == "spec.checkpoint.intervalMinutes"
    with pytest.raises(ConfigError) as e:
        read_checkpointing({"intervalSeconds": 0})
    assert e.value.field == "spec.checkpoint.intervalSeconds"


def test_the_worker_pods_get_the_interval_in_seconds():
    from liveshard.operator import builders
    from liveshard.runtime.contract.env import Env

    job = _job({"preset": "tiny-gpt"}, checkpoint={"intervalMinutes": 7, "path": "/ckpt", "keep": 2})
    pod = builders.worker_pod(job, read_spec(job["spec"]), 0)
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env[Env.CHECKPOINT_INTERVAL_SECONDS] == "420" and env[Env.CHECKPOINT_DIR] == "/ckpt"
    assert env[Env.CHECKPOINT_KEEP] == "2" and Env.CHECKPOINT_INTERVAL_MINUTES not in env


def test_the_worker_reads_seconds_and_still_the_old_minutes(monkeypatch):
    import argparse

    from liveshard.runtime.commands import worker
    from liveshard.runtime.contract.env import Env

    def parsed(env: dict[str, str], argv: list[str]) -> argparse.Namespace:
        for name in (Env.CHECKPOINT_INTERVAL_SECONDS, Env.CHECKPOINT_INTERVAL_MINUTES):
            monkeypatch.delenv(name, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        p = argparse.ArgumentParser()
        worker.configure(p)
        return p.parse_args(argv)

    assert parsed({Env.CHECKPOINT_INTERVAL_SECONDS: "420"}, []).checkpoint_interval_seconds == 420
    assert parsed({Env.CHECKPOINT_INTERVAL_MINUTES: "7"}, []).checkpoint_interval_seconds == 420
    args = parsed({}, ["--checkpoint-interval-minutes", "2"])
    assert args.checkpoint_interval_minutes == 2 and args.checkpoint_interval_seconds == 0


# ---- the warnings -------------------------------------------------------------------------------
def test_deprecated_fields_name_each_old_spelling_and_its_replacement():
    lines = deprecated_fields(_job({"preset": "tiny-gpt", "vocab_size": 512, "hiddenSize": 64},
                                   checkpoint={"intervalMinutes": 10})["spec"])
    assert lines == ["spec.model.vocab_size is megatron's name: write vocabSize (read until liveshard 0.3)",
                     "spec.checkpoint.intervalMinutes is deprecated: write intervalSeconds: 600 "
                     "(read until liveshard 0.3)"]
    assert deprecated_fields(_job(CAMEL, checkpoint={"intervalSeconds": 600})["spec"]) == []
    assert deprecated_fields("garbage") == [] and deprecated_fields({"model": "tiny-gpt"}) == []


def test_the_shipped_examples_use_no_old_spelling():
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "ElasticTrainingJob":
                assert deprecated_fields(doc["spec"]) == [], path


def test_the_admission_webhook_returns_the_warnings_kubectl_prints():
    def body(spec: dict, operation: str = "CREATE", old: dict | None = None) -> dict:
        request = {"uid": "r1", "operation": operation, "object": {"spec": spec}}
        if old is not None:
            request["oldObject"] = {"spec": old}
        return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}

    old_style = _job(SNAKE)["spec"]
    answer = review(body(old_style), JobPolicy())["response"]
    assert answer["allowed"] is True
    assert any(w.startswith("spec.model.num_layers is megatron's name: write numLayers") for w in answer["warnings"])
    assert "warnings" not in review(body(_job(CAMEL)["spec"]), JobPolicy())["response"]
    # an update that leaves the spec alone (kopf's finalizer) is not warned about again
    assert "warnings" not in review(body(old_style, "UPDATE", old_style), JobPolicy())["response"]


def test_the_operator_records_one_event_per_old_spelling_for_a_new_spec_generation():
    job = _job(SNAKE, checkpoint={"intervalMinutes": 5})
    d = reconcile(job, [], {}, datetime(2026, 3, 1, tzinfo=UTC))
    warned = [m for kind, reason, m in d.events if reason == "DeprecatedField"]
    assert len(warned) == len(SNAKE) + 1  # each megatron-named field, and the interval
    assert all(kind == "Warning" for kind, reason, _ in d.events if reason == "DeprecatedField")
    job = copy.deepcopy(job)
    job["status"] = {**d.status}
    again = reconcile(job, [], {}, datetime(2026, 3, 1, 0, 1, tzinfo=UTC))
    assert not [e for e in again.events if e[1] == "DeprecatedField"]  # the same generation: said once


def test_run_local_job_files_warn_once_on_stderr(tmp_path, capsys):
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(_job(SNAKE)))
    training_args.read_job_file(str(f))
    training_args.read_job_file(str(f))
    err = capsys.readouterr().err.splitlines()
    assert len([x for x in err if "num_layers is megatron's name" in x]) == 1
    assert all(x.startswith(f"warning: {f}: ") for x in err)


def test_an_old_flag_spelling_warns_on_stderr():
    from liveshard.dev.cli import run_cli

    r = run_cli("prepare-data", "--workers", "2", "--input", "/nonexistent/x.jsonl", "--output-prefix",
                "/nonexistent/out", "--tokenizer", "/nonexistent/tok")
    # (what other tests' leftover log handlers print in this process is not the command's)
    err = [x for x in r.stderr.splitlines() if x.startswith("liveshard ")]
    assert r.returncode == 2
    assert err[0] == "liveshard prepare-data: warning: --workers is the old spelling of --jobs (read until liveshard 0.3)"
    assert len(err) == 2 and err[1].startswith("liveshard prepare-data: error: ")


# ---- conditions: metav1.Condition ----------------------------------------------------------------
def test_conditions_carry_the_observed_generation_and_a_valid_reason():
    now = datetime(2026, 3, 1, tzinfo=UTC)
    conds = set_condition([], "Suspended", True, "spot-interruption", "x" * 40000, now, observed_generation=3)
    [c] = conds
    assert c["observedGeneration"] == 3 and c["reason"] == "SpotInterruption" and len(c["message"]) == 32768
    assert set(c) == {"type", "status", "observedGeneration", "reason", "message", "lastTransitionTime"}
    # an old condition written with a reason the schema would refuse is repaired on the next write
    again = set_condition([{**c, "reason": "member-lost"}], "Ready", False, "", "", now, observed_generation=4)
    assert [x["reason"] for x in again] == ["Unknown", "MemberLost"]
    for text in ("TrainItersReached", "spot-interruption", "9lives", "", "a b", "x:y,z_", "Ünïcode"):
        assert REASON.match(reason_of(text)), text


def test_the_schema_takes_what_the_operator_writes():
    job = _job(CAMEL, checkpoint={"intervalSeconds": 600})
    d = reconcile(job, [], {}, datetime(2026, 3, 1, tzinfo=UTC))
    job["status"] = d.status
    CRDValidator(CRD).validate(job)  # reasons, observedGeneration and all
    item = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"][
        "conditions"]["items"]
    assert set(item["required"]) == {"type", "status", "reason", "message", "lastTransitionTime"}
    assert item["properties"]["reason"]["pattern"] == REASON.pattern
    assert all(c["observedGeneration"] == 3 for c in d.status["conditions"])
    assert all(re.match(REASON.pattern, c["reason"]) for c in d.status["conditions"])


def test_the_crd_validator_takes_both_spellings_and_the_cel_rules_read_both():
    v = CRDValidator(CRD)
    v.validate(_job(CAMEL))
    v.validate(_job(SNAKE))
    assert CRD_NAMES["num_layers"] == "numLayers"


def test_min_data_parallel_keeps_a_copy_of_the_state_when_the_gpus_allow():
    """spec.parallelism.minDataParallel: the planner keeps dp >= it (a lost node then loses no
    state); with too few GPUs it takes fewer and its explanation says so first."""
    from liveshard.runtime.planner import GPU, plan_world
    from liveshard.runtime.planner.pods import constraints_for

    job = _job({"preset": "tiny-llama"})
    job["spec"]["parallelism"] = {"tp": [1, 2], "pp": [1, 2], "distributedOptimizer": False, "minDataParallel": 2}
    spec = read_spec(job["spec"])
    assert spec.parallelism.min_dp == 2 and constraints_for(spec).min_dp == 2
    gpus = [GPU(id=f"p{i}/0", node=f"n{i}", memory_bytes=80 << 30) for i in range(4)]
    assert plan_world(spec.model, gpus, constraints_for(spec)).config.dp >= 2
    plain = read_spec({**job["spec"], "parallelism": {"tp": [1, 2], "pp": [1, 2]}})
    assert plan_world(plain.model, gpus, constraints_for(plain)).config.dp == 1  # the fastest alone
    short = plan_world(spec.model, gpus[:1], constraints_for(spec))
    assert short.config.dp == 1 and short.explanation[0].startswith("minDataParallel 2 not met")
    with pytest.raises(ConfigError) as e:
        read_spec({**job["spec"], "parallelism": {"minDataParallel": 0}})
    assert e.value.field == "spec.parallelism.minDataParallel"
