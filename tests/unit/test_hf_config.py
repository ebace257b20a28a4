"""Hugging Face config.json <-> ModelSpec, and the name map between the two layouts (pure)."""

from __future__ import annotations

import dataclasses

import pytest

from liveshard.runtime.contract.training import read_training
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.hf.config import hf_config_from_spec, spec_from_hf_config
from liveshard.runtime.hf.names import hf_tensors, logical_units, reads_for_box, segments_by_unit

LLAMA31 = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
           "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
           "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}}
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
             "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
             "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
             "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
             "num_local_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "tie_word_embeddings": False, "use_sliding_window": False}


def test_llama31_reads_every_forward_setting() -> None:
    spec = spec_from_hf_config(LLAMA31, name="llama3.1-8b")
    assert (spec.num_layers, spec.num_query_groups, spec.kv_channels, spec.ffn_hidden_size) == (32, 8, 128, 14336)
    assert spec.rotary_base == 500000.0 and spec.rope_scaling and spec.rope_scaling_factor == 8.0
    assert spec.layernorm_epsilon == 1e-5 and not spec.share_embeddings_and_output_weights
    assert spec.padded_vocab_size == spec.vocab_size == 128256
    assert spec.num_parameters() == pytest.approx(8.03e9, rel=0.01)


@pytest.mark.parametrize("config,preset", [(LLAMA31, "llama3-8b"), (QWEN3_MOE, "qwen3-30b-a3b")])
def test_presets_are_the_published_models(config: dict, preset: str) -> None:
    from liveshard.runtime.presets import PRESETS

    spec = spec_from_hf_config(config)
    ours = PRESETS[preset]
    assert dataclasses.replace(spec, name=ours.name, max_sequence_length=ours.max_sequence_length,
                               params_dtype=ours.params_dtype,
                               make_vocab_size_divisible_by=ours.make_vocab_size_divisible_by) == ours


def test_qwen3_moe_reads_router_settings_from_either_transformers_generation() -> None:
    spec = spec_from_hf_config(QWEN3_MOE)
    assert (spec.num_moe_experts, spec.moe_router_topk, spec.moe_ffn_hidden_size) == (128, 8, 768)
    assert spec.qk_layernorm and not spec.moe_router_pre_softmax and spec.rotary_base == 1e6
    older = {**QWEN3_MOE, "num_experts": 128, "rope_theta": 1e6, "norm_topk_prob": False}
    del older["num_local_experts"], older["rope_parameters"]
    assert spec_from_hf_config(older).moe_router_pre_softmax
    assert spec.num_parameters() == pytest.approx(30.5e9, rel=0.01)


@pytest.mark.parametrize("change,field", [
    ({"architectures": ["DeepseekV3ForCausalLM"]}, "architectures"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
    ({"rope_scaling": {**LLAMA31["rope_scaling"], "low_freq_factor": 2.0}}, "rope_scaling.low_freq_factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"attention_bias": True}, "attention_bias"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, "sliding_window"),
])
def test_what_megatron_would_compute_differently_is_refused_by_name(change: dict, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        spec_from_hf_config({**LLAMA31, **change})
    assert e.value.field == f"config.json: {field}"


def test_moe_layer_stacks_liveshard_cannot_lay_out_are_refused() -> None:
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        spec_from_hf_config({**QWEN3_MOE, "mlp_only_layers": [0]})


@pytest.mark.parametrize("config", [LLAMA31, QWEN3_MOE,
                                    {**LLAMA31, "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True},
                                    {**QWEN3_MOE, "architectures": ["Qwen3ForCausalLM"]}])
def test_export_config_reads_back_as_the_same_model(config: dict) -> None:
    spec = spec_from_hf_config(config)
    again = spec_from_hf_config(hf_config_from_spec(spec))
    assert dataclasses.replace(again, name=spec.name) == spec


def test_export_refuses_models_without_a_hugging_face_family() -> None:
    spec = spec_from_hf_config(LLAMA31)
    with pytest.raises(ConfigError, match=r"model\.normalization"):
        hf_config_from_spec(dataclasses.replace(spec, normalization="LayerNorm"))


@pytest.mark.parametrize("config", [LLAMA31, QWEN3_MOE])
def test_the_name_map_covers_every_row_of_both_layouts_once(config: dict) -> None:
    small = {**config, "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2}
    spec = spec_from_hf_config(small)
    spec = dataclasses.replace(spec, make_vocab_size_divisible_by=1000)  # padding rows: no counterpart
    hf_rows: dict[str, list[int]] = {}
    for t in hf_tensors(spec):
        hf_rows[t.name] = [0] * t.shape[0]
    for (key, index), segs in segments_by_unit(spec).items():
        unit = logical_units(spec)[(key, index)]
        covered = [0] * unit.shape[0]
        for seg, hf_row, box_row, count in reads_for_box(segs, 0, unit.shape[0]):
            for i in range(count):
                covered[box_row + i] += 1
                hf_rows[seg.hf_name][hf_row + i] += 1
        padding = spec.padded_vocab_size - spec.vocab_size if key in ("embedding.word_embeddings.weight",
                                                                       "output_layer.weight") else 0
        assert covered == [1] * (unit.shape[0] - padding) + [0] * padding, key
    assert all(rows == [1] * len(rows) for rows in hf_rows.values())


def test_initial_weights_and_resume_are_read_and_exclusive() -> None:
    base = {"data": {"mock": True}, "trainIters": 2, "globalBatch": 2}
    t = read_training({**base, "initialWeights": {"path": "/w"}})
    assert (t.initial_weights.format, t.initial_weights.path) == ("huggingface", "/w")
    assert read_training(t.to_section()) == t
    assert read_training({**base, "resume": {"path": "/c"}}).resume == "/c"
    with pytest.raises(ConfigError, match=r"spec\.training\.resume"):
        read_training({**base, "initialWeights": {"path": "/w"}, "resume": {"path": "/c"}})
    with pytest.raises(ConfigError, match=r"initialWeights\.format"):
        read_training({**base, "initialWeights": {"path": "/w", "format": "gguf"}})
