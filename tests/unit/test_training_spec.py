"""spec.training: one reader for the API server's schema, the operator, the coordinator and the workers."""

from __future__ import annotations

import copy

import pytest

from liveshard.runtime.contract.jobspec import read_spec
from liveshard.runtime.contract.training import TrainingSpec, read_training
from liveshard.runtime.errors import ConfigError

REAL = {"data": {"blend": [{"prefix": "/data/web_text_document", "weight": 0.7},
                           {"prefix": "/data/code_text_document", "weight": 0.3}]},
        "tokenizer": {"type": "huggingface", "path": "/data/tokenizer"},
        "trainIters": 1000, "globalBatch": 64}


def test_defaults_are_megatrons_and_spelled_out_in_the_section():
    t = read_training(REAL, default_seq_length=4096)
    assert t.seq_length == 4096 and t.micro_batch == 1 and t.precision == "bf16"
    assert t.data.split == "969,30,1" and t.data.split_weights == (969.0, 30.0, 1.0)
    assert t.schedule.decay_style == "cosine" and t.decay_iters == 1000
    assert (t.optimizer.adam_beta1, t.optimizer.adam_beta2, t.optimizer.weight_decay) == (0.9, 0.95, 0.01)
    assert t.eval.interval == 0 and t.eval_samples() == 0 and t.train_samples == 64_000
    # the section the operator hands to the pods reads back to the same spec
    assert read_training(t.to_section()) == t
    assert TrainingSpec.from_json(t.to_json()) == t


def test_train_samples_and_warmup_fraction():
    t = read_training({**REAL, "trainIters": None, "trainSamples": 640,
                       "schedule": {"warmupFraction": 0.25, "decayStyle": "WSD", "wsdDecayIters": 2}})
    assert t.train_iters == 10 and t.schedule.warmup_iters == 2 and t.schedule.wsd_decay_iters == 2


@pytest.mark.parametrize("change,field,words", [
    ({"data": None}, "spec.training.data", "prepare-data"),
    ({"data": {}}, "spec.training.data", "mock: true"),
    ({"data": {"mock": True, "blend": [{"prefix": "/x"}]}}, "spec.training.data.mock", "not both"),
    ({"data": {"blend": [{"prefix": "/x.bin"}]}}, "spec.training.data.blend[0].prefix", "drop the extension"),
    ({"data": {"blend": [{"prefix": "/x", "weight": 0}]}}, "spec.training.data.blend[0].weight", "> 0"),
    ({"data": {"blend": [{"prefix": "/x"}], "split": "90;10"}}, "spec.training.data.split", "969,30,1"),
    ({"data": {"blend": [{"prefix": "/x"}], "split": "0,10,0"}}, "spec.training.data.split", "nothing to train"),
    ({"tokenizer": None}, "spec.training.tokenizer", "tokenizer.json"),
    ({"tokenizer": {"type": "tiktoken", "path": "/t"}}, "spec.training.tokenizer.type", "huggingface"),
    ({"globalBatch": None}, "spec.training.globalBatch", "required"),
    ({"globalBatch": 10, "microBatch": 4}, "spec.training.globalBatch", "multiple of microBatch"),
    ({"trainIters": None}, "spec.training.trainIters", "trainSamples"),
    ({"trainSamples": 100}, "spec.training.trainSamples", "set one of them"),
    ({"optimizer": {"lr": 1e-4, "minLr": 1e-3}}, "spec.training.optimizer.minLr", "minLr <= lr"),
    ({"optimizer": {"lr": 0}}, "spec.training.optimizer.lr", "> 0"),
    ({"optimizer": {"adamBeta2": 1.5}}, "spec.training.optimizer.adamBeta2", "< 1"),
    ({"schedule": {"warmupIters": 1000}}, "spec.training.schedule.warmupIters", "no decay"),
    ({"schedule": {"decayStyle": "WSD"}}, "spec.training.schedule.wsdDecayIters", "WSD"),
    ({"schedule": {"decayStyle": "step"}}, "spec.training.schedule.decayStyle", "cosine"),
    ({"precision": "fp8"}, "spec.training.precision", "bf16"),
    ({"eval": {"interval": 10}, "data": {"blend": [{"prefix": "/x"}], "split": "1,0,0"}},
     "spec.training.eval.interval", "validation"),
])
def test_bad_values_name_the_field_and_the_fix(change, field, words):
    section = copy.deepcopy(REAL)
    for key, value in change.items():
        if value is None:
            section.pop(key, None)
        else:
            section[key] = value
    with pytest.raises(ConfigError) as e:
        read_training(section)
    assert e.value.field == field
    assert words in str(e.value)


def _job(**training):
    return {"model": {"preset": "tiny-gpt"}, "image": "img", "workers": {"max": 2, "gpusPerWorker": 1},
            "training": {**REAL, **training}}


def test_a_job_without_training_is_refused_with_how_to_get_data():
    spec = _job()
    del spec["training"]
    with pytest.raises(ConfigError) as e:
        read_spec(spec)
    assert "liveshard prepare-data" in str(e.value) and "mock: true" in str(e.value)


def test_batch_fields_moved_out_of_parallelism():
    spec = _job()
    spec["parallelism"] = {"globalBatch": 64}
    with pytest.raises(ConfigError) as e:
        read_spec(spec)
    assert e.value.field == "spec.parallelism.globalBatch" and "spec.training.globalBatch" in str(e.value)


def test_precision_is_the_models_params_dtype():
    assert read_spec(_job(precision="fp16")).model.params_dtype == "fp16"
    assert read_spec(_job()).model.params_dtype == "bf16"
    old = _job()
    old["model"] = {"preset": "tiny-gpt", "params_dtype": "fp32"}  # an older job: its dtype is the precision
    assert read_spec(old).training.precision == "fp32"
    both = _job(precision="bf16")
    both["model"] = {"preset": "tiny-gpt", "params_dtype": "fp32"}
    with pytest.raises(ConfigError, match="set the precision in one place"):
        read_spec(both)


def test_sequence_longer_than_the_model_is_refused():
    with pytest.raises(ConfigError) as e:
        read_spec(_job(seqLength=4096))  # tiny-gpt: 64 positions
    assert e.value.field == "spec.training.seqLength"


@pytest.mark.parametrize("training,message", [
    ({"data": {"mock": True}, "globalBatch": 8}, "set exactly one of trainIters and trainSamples"),
    ({"data": {}, "trainIters": 10, "globalBatch": 8}, "give blend"),
    ({"data": {"blend": [{"prefix": "/x"}]}, "trainIters": 10, "globalBatch": 8}, "training.tokenizer is required"),
    ({"data": {"mock": True}, "trainIters": 10, "globalBatch": 10, "microBatch": 4}, "multiple of microBatch"),
    ({"data": {"mock": True}, "trainIters": 10, "globalBatch": 8, "optimizer": {"lr": 1e-4, "minLr": 1e-3}},
     "minLr must not exceed lr"),
])
def test_the_api_server_refuses_what_the_schema_can_say(crd_validator, training, message):
    job = {"apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob",
           "metadata": {"name": "j", "namespace": "ns"},
           "spec": {"model": {"preset": "tiny-gpt"}, "image": "img", "workers": {"max": 2}, "training": training}}
    errors = crd_validator.errors(crd_validator.default(job))
    assert any(message in e for e in errors), errors


def test_the_api_server_requires_training(crd_validator):
    job = {"apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob",
           "metadata": {"name": "j", "namespace": "ns"},
           "spec": {"model": {"preset": "tiny-gpt"}, "image": "img", "workers": {"max": 2}}}
    assert any("spec.training: Required value" in e for e in crd_validator.errors(crd_validator.default(job)))
