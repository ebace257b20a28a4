"""Model specs: presets against published parameter counts, YAML loading, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from liveshard.runtime.errors import ConfigError, UnsupportedModelError
from liveshard.runtime.presets import COUNTED_ONLY, PRESETS, PUBLISHED_PARAMETERS
from liveshard.runtime.spec import ModelSpec, load_model


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_preset_total_parameters_match_published(name):
    total, _ = PUBLISHED_PARAMETERS[name]
    assert {**PRESETS, **COUNTED_ONLY}[name].num_parameters() == pytest.approx(total, rel=0.005)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_moe_active_parameters_match_published(name):
    _, active = PUBLISHED_PARAMETERS[name]
    assert PRESETS[name].num_parameters(active_only=True) == pytest.approx(active, rel=0.02)


def test_llama3_8b_breakdown():
    s = PRESETS["llama3-8b"]
    # q (4096x4096) + k,v (1024x4096 each) + o (4096x4096) + 3 SwiGLU mats + 2 RMSNorms
    per_layer = 4096 * 4096 * 2 + 2 * 1024 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    assert s.layer_params(0) == per_layer
    assert s.num_parameters() == 32 * per_layer + 2 * 128256 * 4096 + 4096
    assert s.qkv_rows == 4096 + 2 * 1024


def test_padded_vocab_is_independent_of_parallelism():
    s = PRESETS["llama3-8b"]
    assert s.padded_vocab_size == 128256  # already a multiple of 128
    assert PRESETS["gpt-125m"].padded_vocab_size == 50304


def test_defaults_follow_megatron():
    s = ModelSpec(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, max_sequence_length=16)
    assert s.ffn_hidden_size == 128 and s.num_query_groups == 4 and s.kv_channels == 8


@pytest.mark.parametrize(("fields", "field"), [
    ({"num_query_groups": 3}, "num_query_groups"),
    ({"normalization": "BatchNorm"}, "normalization"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"num_moe_experts": 4, "moe_router_topk": 5}, "moe_router_topk"),
    ({"moe_shared_expert_intermediate_size": 8}, "moe_shared_expert_intermediate_size"),
])
def test_bad_spec_names_the_field(fields, field):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, max_sequence_length=16)
    with pytest.raises(ConfigError) as e:
        ModelSpec(**{**base, **fields})
    assert e.value.field == field
    assert "\n" not in str(e.value)


def test_load_yaml_and_preset_override(tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("model:\n  preset: tiny-llama\n  num_layers: 6\n")
    s = load_model(str(f))
    assert s.num_layers == 6 and s.hidden_size == PRESETS["tiny-llama"].hidden_size
    f.write_text("num_layers: 2\nhidden_size: 32\nnum_attention_heads: 4\nvocab_size: 64\n"
                 "max_sequence_length: 16\n")
    assert load_model(str(f)).num_layers == 2


@pytest.mark.parametrize(("text", "field"), [
    ("num_layers: 2\nhidden_size: 32\nnum_attention_heads: 4\nvocab_size: 64\nmax_sequence_length: 16\n"
     "hiden: 3\n", ".hiden"),
    ("num_layers: 2\n", ".hidden_size"),
    ("num_layers: [2\n", "model"),
])
def test_bad_model_file_gives_one_line(tmp_path, text, field):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_model(str(f))
    assert e.value.field.endswith(field)
    assert "\n" not in str(e.value)


def test_unknown_model_lists_presets():
    with pytest.raises(ConfigError, match="llama3-70b"):
        load_model("no-such-model")


def test_mla_is_declared_unsupported():
    with pytest.raises(UnsupportedModelError, match="multi-latent"):
        COUNTED_ONLY["deepseek-v2-lite"].require_supported()


def test_a_model_liveshard_cannot_lay_out_is_no_preset():
    """Every preset is one ``plan`` and ``layout`` take; the others are counted only."""
    assert not set(COUNTED_ONLY) & set(PRESETS)
    for spec in PRESETS.values():
        spec.require_supported()
    with pytest.raises(ConfigError, match="neither a preset nor a file"):
        load_model("deepseek-v2-lite")
    import yaml

    crd = yaml.safe_load((Path(__file__).resolve().parents[2] / "crds" / "elastictrainingjob.yaml").read_text())
    model = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["model"]
    assert model["properties"]["preset"]["enum"] == sorted(PRESETS)  # what kubectl apply takes
