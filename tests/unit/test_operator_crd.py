"""The ElasticTrainingJob CRD: schema, defaults, CEL rules, and what only the operator can check."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import yaml

from liveshard.dev.localcluster.crd_validation import CRDValidator, InvalidObject
from liveshard.runtime.contract.causes import NODE_KINDS
from liveshard.runtime.contract.env import Defaults
from liveshard.runtime.contract.jobspec import read_spec, validate_spec
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.presets import PRESETS
from liveshard.runtime.spec import CRD_NAMES, ModelSpec

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "elastictrainingjob.yaml"
CRD = yaml.safe_load(CRD_PATH.read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]

GOOD = {
    "apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob",
    "metadata": {"name": "llama-pretrain", "namespace": "ml"},
    "spec": {
        "model": {"preset": "llama3-8b"},
        "image": "ghcr.io/example/liveshard-train:0.1",
        "workers": {"min": 2, "max": 16, "gpusPerWorker": 8},
        "template": {"nodeSelector": {"karpenter.sh/capacity-type": "spot"},
                     "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        "parallelism": {"tp": [1, 2, 4, 8], "pp": [1, 2, 4]},
        "training": {"data": {"blend": [{"prefix": "/data/web_text_document"}]},
                     "tokenizer": {"path": "/data/tokenizer"}, "trainIters": 1000, "globalBatch": 512},
        "elasticity": {"actOn": ["spot-interruption", "disruption", "scale-in"], "scaleUpCooldownSeconds": 120},
        "checkpoint": {"path": "/ckpt", "volume": {"persistentVolumeClaim": {"claimName": "ckpt"}}},
        "coordinator": {"nodeSelector": {"node-pool": "system"}},
    },
}


@pytest.fixture(scope="module")
def validator(crd_validator) -> CRDValidator:
    return crd_validator


def with_spec(**changes):
    obj = copy.deepcopy(GOOD)
    for path, value in changes.items():
        target = obj["spec"]
        keys = path.split("__")
        for key in keys[:-1]:
            target = target.setdefault(key, {})
        if value is _DELETE:
            target.pop(keys[-1], None)
        else:
            target[keys[-1]] = value
    return obj


_DELETE = object()


# ---- the CRD's shape --------------------------------------------------------------------------
def test_crd_identity_subresources_and_columns():
    spec = CRD["spec"]
    assert spec["group"] == "liveshard.io" and VERSION["name"] == "v1alpha1"
    assert spec["names"]["kind"] == "ElasticTrainingJob" and "etj" in spec["names"]["shortNames"]
    scale = VERSION["subresources"]["scale"]
    assert scale == {"specReplicasPath": ".spec.workers.replicas", "statusReplicasPath": ".status.replicas",
                     "labelSelectorPath": ".status.selector"}
    assert "status" in VERSION["subresources"]
    columns = {c["name"]: c["jsonPath"] for c in VERSION["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.phase" and columns["World"] == ".status.world.worldSize"
    # World and Plan show what the runtime committed and runs (status.world), never a plan acked but not run
    assert columns["Plan"] == ".status.world.config" and columns["Generation"] == ".status.plan.generation"
    assert columns["Age"] == ".metadata.creationTimestamp"


def test_schema_is_structural():
    """Every node has a type (or preserves unknown fields), as apiextensions/v1 requires."""
    def walk(node, path):
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
        for key, child in (node.get("properties") or {}).items():
            walk(child, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{path}{{}}")
    walk(SCHEMA, "")


def test_model_fields_follow_modelspec_and_presets():
    model = SCHEMA["properties"]["spec"]["properties"]["model"]["properties"]
    names = {f.name for f in dataclasses.fields(ModelSpec)}
    # the CRD's camelCase names, and megatron's (deprecated) beside them with the same schema
    assert set(model) - {"preset"} == {CRD_NAMES[n] for n in names} | names
    for name in names:
        camel = model[CRD_NAMES[name]]
        assert {k: v for k, v in model[name].items() if k != "description"} == \
            {k: v for k, v in camel.items() if k != "description"}, name
        if CRD_NAMES[name] != name:
            assert model[name]["description"].startswith(f"deprecated: write {CRD_NAMES[name]} "), name
    assert sorted(model["preset"]["enum"]) == sorted(PRESETS)


def test_act_on_enum_matches_the_signal_kinds():
    act_on = SCHEMA["properties"]["spec"]["properties"]["elasticity"]["properties"]["actOn"]
    assert act_on["items"]["enum"] == list(NODE_KINDS)
    assert act_on["default"] == list(NODE_KINDS)


def test_status_has_the_runtime_contract_fields():
    status = SCHEMA["properties"]["status"]["properties"]
    for key in ("phase", "conditions", "plan", "appliedGeneration", "history", "observedGeneration",
                "replicas", "selector", "worldSize"):
        assert key in status
    plan = status["plan"]["properties"]
    for key in ("generation", "config", "members", "worldSize", "reason", "deadline", "createdAt"):
        assert key in plan


# ---- accepted manifests -----------------------------------------------------------------------
def test_a_good_manifest_passes_and_gets_defaults(validator):
    out = validator.validate(GOOD)
    assert out["spec"]["workers"]["gpusPerWorker"] == 8
    assert out["spec"]["training"]["microBatch"] == 1
    assert out["spec"]["parallelism"]["distributedOptimizer"] is True
    assert out["spec"]["elasticity"]["reconfigurationTimeoutSeconds"] == 300
    assert "intervalSeconds" not in out["spec"]["checkpoint"]  # no schema default: intervalMinutes may stand
    assert read_spec(out["spec"]).checkpoint.interval_seconds == Defaults.CHECKPOINT_INTERVAL
    assert out["spec"]["coordinator"]["port"] == 29400
    assert out["spec"]["command"] == ["liveshard", "worker"]
    assert read_spec(out["spec"]).workers.replicas == 16


def test_an_inline_model_and_a_preset_with_overrides_pass(validator):
    inline = with_spec(model={"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 250,
                              "max_sequence_length": 64, "params_dtype": "fp32"})
    validator.validate(inline)
    assert read_spec(validator.default(inline)["spec"]).model.num_layers == 4
    override = with_spec(model={"preset": "llama3-8b", "max_sequence_length": 4096})
    validator.validate(override)
    assert read_spec(override["spec"]).model.max_sequence_length == 4096


# ---- rejected manifests: schema ---------------------------------------------------------------
@pytest.mark.parametrize("changes,expected", [
    ({"workers__max": _DELETE}, "spec.workers.max: Required value"),
    ({"image": _DELETE}, "spec.image: Required value"),
    ({"workers__gpusPerWorker": 0}, "spec.workers.gpusPerWorker: Invalid value: 0: must be >= 1"),
    ({"workers__max": "16"}, "spec.workers.max: Invalid value: '16': must be of type integer"),
    ({"model": {"preset": "llama-9000"}}, 'spec.model.preset: Unsupported value: \'llama-9000\''),
    ({"workers__gpusperworker": 8}, 'spec.workers.gpusperworker: unknown field "gpusperworker"'),
    ({"elasticity__actOn": ["spot"]}, 'spec.elasticity.actOn[0]: Unsupported value: \'spot\''),
    ({"checkpoint__path": "ckpt"}, "spec.checkpoint.path: Invalid value"),
    ({"workers__gpuMemory": "80 gigs"}, "spec.workers.gpuMemory: Invalid value"),
    ({"model": {"preset": "tiny-gpt", "normalization": "BatchNorm"}}, "spec.model.normalization: Unsupported value"),
])
def test_schema_rejects_with_a_readable_message(validator, changes, expected):
    with pytest.raises(InvalidObject) as e:
        validator.validate(with_spec(**changes))
    assert any(err.startswith(expected) for err in e.value.errors), e.value.errors
    assert str(e.value).startswith('ElasticTrainingJob.liveshard.io "llama-pretrain" is invalid: ')


# ---- rejected manifests: CEL rules ------------------------------------------------------------
@pytest.mark.parametrize("changes,expected", [
    ({"workers": {"min": 8, "max": 4}}, 'spec.workers: Invalid value: "object": workers.min must be <= workers.max'),
    ({"workers": {"min": 2, "max": 4, "replicas": 6}}, "workers.replicas must lie within workers.min..workers.max"),
    ({"workers": {"min": 2, "max": 4, "replicas": 1}}, "workers.replicas must lie within"),
    ({"training__globalBatch": 100, "training__microBatch": 3}, "globalBatch must be a multiple of microBatch"),
    ({"model": {"hidden_size": 64}}, "model: give a preset, or numLayers"),
    ({"model": {"hiddenSize": 64}}, "model: give a preset, or numLayers"),
    ({"model": {"preset": "tiny-gpt", "numAttentionHeads": 4, "numQueryGroups": 3}},
     "model.numQueryGroups must divide numAttentionHeads"),
    ({"checkpoint": {"intervalSeconds": 60, "intervalMinutes": 1}}, "checkpoint: give intervalSeconds only"),
    ({"model": {"preset": "tiny-gpt", "num_attention_heads": 4, "num_query_groups": 3}},
     "model.num_query_groups must divide num_attention_heads"),
    ({"workers": {"min": 1, "max": 1, "gpusPerWorker": 1}, "parallelism__tp": [2, 4]},
     "parallelism.tp: every allowed tp degree exceeds"),
])
def test_cel_rules_reject_cross_field_mistakes(validator, changes, expected):
    with pytest.raises(InvalidObject) as e:
        validator.validate(with_spec(**changes))
    assert any(expected in err for err in e.value.errors), e.value.errors


def test_transition_rules_keep_model_and_gpus_per_worker_fixed(validator):
    old = validator.validate(GOOD)
    scaled = copy.deepcopy(old)
    scaled["spec"]["workers"]["replicas"] = 4
    validator.validate(scaled, old)  # scaling is an allowed edit
    changed = copy.deepcopy(old)
    changed["spec"]["workers"]["gpusPerWorker"] = 4
    with pytest.raises(InvalidObject, match="gpusPerWorker is immutable"):
        validator.validate(changed, old)
    changed = copy.deepcopy(old)
    changed["spec"]["model"] = {"preset": "llama3-70b"}
    with pytest.raises(InvalidObject, match="model is immutable"):
        validator.validate(changed, old)


# ---- what only the operator can check ---------------------------------------------------------
@pytest.mark.parametrize("changes,field", [
    ({"model": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 250,
                "max_sequence_length": 64, "num_moe_experts": 4, "moe_router_topk": 8}}, "spec.model.moe_router_topk"),
    ({"parallelism__ep": [2]}, "spec.parallelism.ep"),
    ({"parallelism__tp": [3, 5]}, "spec.parallelism.tp"),
    ({"parallelism__seqLength": 100000}, "spec.parallelism.seqLength"),
    ({"model": {"preset": "tiny-gpt", "position_embedding_type": "alibi"}}, "spec.model.position_embedding_type"),
])
def test_operator_side_validation_names_the_field(validator, changes, field):
    obj = with_spec(**changes)
    problem = validate_spec(obj["spec"])
    assert problem is not None and problem.startswith(field), problem
    with pytest.raises(ConfigError) as e:
        read_spec(obj["spec"])
    assert e.value.field == field
    assert "\n" not in str(e.value)


def test_gpu_memory_quantities():
    spec = with_spec(workers__gpuMemory="40960Mi")["spec"]
    assert read_spec(spec).workers.gpu_memory_bytes == 40 * 2**30
    assert read_spec(with_spec(workers__gpuMemory="141G")["spec"]).workers.gpu_memory_bytes == 141 * 10**9


@pytest.mark.parametrize("name,ok", [("llama-pretrain", True), ("a" * 48, True), ("9lives", False),
                                     ("dotted.name", False), ("Upper", False), ("a" * 49, False),
                                     ("trailing-", False)])
def test_job_names_must_make_valid_child_names(validator, name, ok):
    """The Service is named after the job (a DNS-1035 label) and the pods' host names append
    ``-coordinator`` or ``-worker-<i>`` to it (at most 63 characters): a real API server would
    refuse those children, so the job itself is refused."""
    job = copy.deepcopy(GOOD)
    job["metadata"]["name"] = name
    job["metadata"].update(labels={"team": "ml"}, annotations={"note": "x"}, uid="u", resourceVersion="1")
    if ok:
        validator.validate(job)  # the rest of ObjectMeta is the server's, not the schema's
        assert validator.errors(job) == [] and validator.prune(job)[1] == []
    else:
        # the error names the field (the rule's fieldPath), not the object's root
        with pytest.raises(InvalidObject, match=r'"\S+" is invalid: metadata\.name: Invalid value: "object": '
                                                "metadata.name must be a DNS-1035 label of at most 48 characters"):
            validator.validate(job)


def test_a_number_written_as_an_integer_is_a_double_to_cel(validator):
    """kubectl sends a YAML ``weight: 1.0`` as ``1``: the schema says number, so the CEL rule
    ``self.weight > 0.0`` compares two doubles (cel-python alone would refuse int > double)."""
    job = copy.deepcopy(GOOD)
    job["spec"]["training"]["data"]["blend"] = [{"prefix": "/data/a", "weight": 1}, {"prefix": "/data/b", "weight": 3}]
    assert validator.errors(job) == []
    job["spec"]["training"]["data"]["blend"][0]["weight"] = 0
    assert any("weight" in e and "failed to evaluate" not in e for e in validator.errors(job)), validator.errors(job)


def test_no_schema_default_inside_a_list_item():
    """A default inside a list item is stored on the live object: `kubectl apply` of an
    unchanged file then finds the list changed (merge patches replace lists) and says
    `configured` every time. Defaults of list items are the runtime's (read_spec)."""
    crd = yaml.safe_load(CRD_PATH.read_text())
    found = []

    def walk(node, path, in_list):
        if not isinstance(node, dict):
            return
        if "default" in node and in_list:
            found.append(path)
        for key, child in (node.get("properties") or {}).items():
            walk(child, f"{path}.{key}", in_list)
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]", True)
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{path}{{}}", in_list)

    walk(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"], "", False)
    assert found == []
