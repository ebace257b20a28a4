"""Hugging Face ``config.json`` <-> ``ModelSpec`` for the Llama, Mistral, Qwen2, Qwen3 and
Qwen3-MoE families.

A config is accepted only when every setting the forward pass depends on has a ModelSpec
field: anything megatron-core's GPT model would compute differently (sliding-window attention,
a rope type other than default/llama3, partial rotary, an activation other than SiLU, ...) is
refused with the field named. Reads both the transformers 4 keys (``rope_theta``,
``rope_scaling``, ``num_experts``) and the transformers 5 ones (``rope_parameters``,
``num_local_experts``). Pure: no torch, no I/O.
"""

from __future__ import annotations

import math
from typing import Any

from liveshard.runtime.errors import ConfigError, UnsupportedModelError
from liveshard.runtime.spec import ModelSpec

# architectures[0] -> family
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# megatron's llama3 rope scaling fixes these three (only the factor is a GPTModel argument)
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _field(source: str, name: str) -> str:
    return f"{source}: {name}"


def family_of(config: dict[str, Any], source: str = "config.json") -> str:
    archs = config.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            _field(source, "architectures"), f"{arch!r} cannot be imported",
            f"supported: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[arch]


def spec_from_hf_config(config: dict[str, Any], *, name: str | None = None, params_dtype: str = "bf16",
                        source: str = "config.json") -> ModelSpec:
    """The ``ModelSpec`` of a Hugging Face causal LM config (``ModelSpec.from_hf_config``)."""
    try:
        return _spec_from_hf_config(config, name=name, params_dtype=params_dtype, source=source)
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, ZeroDivisionError) as e:
        # a value of the wrong type or size (a string for a count, a list for a number, inf)
        raise ConfigError(source, f"holds a value of the wrong type or size ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:160]})",
                          "use the model's original config.json") from None


def _spec_from_hf_config(config: dict[str, Any], *, name: str | None, params_dtype: str,
                         source: str) -> ModelSpec:
    if not isinstance(config, dict):
        raise ConfigError(source, "is not a JSON object")
    family = family_of(config, source)

    def get(key: str, default: Any = ...) -> Any:
        if key in config and config[key] is not None:
            return config[key]
        if default is ...:
            raise ConfigError(_field(source, key), "is required")
        return default

    def refuse(key: str, why: str, fix: str = "") -> None:
        raise UnsupportedModelError(_field(source, key), why, fix or "use a model without it")

    act = get("hidden_act", "silu")
    if act != "silu":
        refuse("hidden_act", f"{act!r} is not SwiGLU's silu")
    rope = _rope(config, source)
    if config.get("use_sliding_window") or (family == "mistral" and config.get("sliding_window")):
        refuse("sliding_window", "sliding-window attention is not supported")
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        refuse("partial_rotary_factor", "partial rotary embeddings are not supported")

    heads = int(get("num_attention_heads"))
    hidden = int(get("hidden_size"))
    attention_bias = bool(config.get("attention_bias", False))
    mlp_bias = bool(config.get("mlp_bias", False))
    if family == "qwen2":
        add_qkv_bias, add_bias_linear = True, False  # Qwen2: q/k/v biases, none elsewhere
    else:
        if attention_bias != mlp_bias:
            refuse("attention_bias", "biases on attention but not on the MLP (or the reverse) have no "
                   "megatron equivalent (add_bias_linear covers both)")
        add_qkv_bias, add_bias_linear = False, attention_bias
    fields: dict[str, Any] = dict(
        name=name or str(config.get("_name_or_path") or family).rsplit("/", 1)[-1] or family,
        num_layers=int(get("num_hidden_layers")),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(get("num_key_value_heads", heads)),
        kv_channels=int(get("head_dim", hidden // heads)),
        ffn_hidden_size=int(get("intermediate_size")),
        vocab_size=int(get("vocab_size")),
        max_sequence_length=int(get("max_position_embeddings")),
        gated_linear_unit=True,
        normalization="RMSNorm",
        layernorm_epsilon=float(get("rms_norm_eps", 1e-6)),
        add_bias_linear=add_bias_linear,
        add_qkv_bias=add_qkv_bias,
        qk_layernorm=family in ("qwen3", "qwen3_moe"),
        position_embedding_type="rope",
        rotary_base=float(rope["rope_theta"]),
        rope_scaling=rope["scaling"] is not None,
        rope_scaling_factor=float(rope["scaling"] or 8.0),
        share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings", False)),
        params_dtype=params_dtype,
        # No padding rows where the vocabulary allows (Llama 3's and Qwen3's are multiples of
        # 128): a padded row's logit would join the softmax and move the loss off the model's.
        make_vocab_size_divisible_by=math.gcd(int(get("vocab_size")), 128),
    )
    if family == "qwen3_moe":
        if int(config.get("decoder_sparse_step", 1)) != 1:
            refuse("decoder_sparse_step", "only every layer being MoE is supported", "use decoder_sparse_step: 1")
        if config.get("mlp_only_layers"):
            refuse("mlp_only_layers", "mixed dense/MoE layer stacks are not supported")
        experts = config.get("num_local_experts", config.get("num_experts"))
        if experts is None:
            raise ConfigError(_field(source, "num_experts"), "is required for a MoE model")
        fields.update(
            num_moe_experts=int(experts),
            moe_ffn_hidden_size=int(get("moe_intermediate_size")),
            moe_router_topk=int(get("num_experts_per_tok")),
            moe_router_score_function="softmax",
            # norm_topk_prob: the top-k weights are renormalised, i.e. softmax over the top-k logits
            moe_router_pre_softmax=not bool(config.get("norm_topk_prob", False)),
        )
    return ModelSpec(**fields)


def _rope(config: dict[str, Any], source: str) -> dict[str, Any]:
    """``{rope_theta, scaling}`` from either generation of transformers' rope keys."""
    params = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    theta = config.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", "default") != "default":
            scaling = params
    rope_type = None
    if isinstance(scaling, dict):
        rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default"):
        return {"rope_theta": theta if theta is not None else 10000.0, "scaling": None}
    if rope_type != "llama3":
        raise UnsupportedModelError(_field(source, "rope_scaling.rope_type"), f"{rope_type!r} is not supported",
                                    "supported: default and llama3")
    for key, expected in _LLAMA3_FIXED.items():
        if float(scaling.get(key, expected)) != float(expected):
            raise UnsupportedModelError(_field(source, f"rope_scaling.{key}"),
                                        f"{scaling.get(key)} differs from megatron's fixed {expected}",
                                        "only Llama 3.1's llama3 scaling is supported")
    return {"rope_theta": theta if theta is not None else 500000.0, "scaling": float(scaling.get("factor", 8.0))}


def hf_config_from_spec(spec: ModelSpec, dtype: str = "bfloat16") -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face model equal to ``spec`` (the export direction)."""
    def refuse(field: str, why: str) -> None:
        raise UnsupportedModelError(f"model.{field}", why, "export supports Llama/Qwen-style models "
                                    "(RMSNorm, rope, SwiGLU)")

    if spec.normalization != "RMSNorm":
        refuse("normalization", f"{spec.normalization} has no Llama/Qwen equivalent")
    if spec.position_embedding_type != "rope":
        refuse("position_embedding_type", f"{spec.position_embedding_type} has no Llama/Qwen equivalent")
    if not spec.gated_linear_unit:
        refuse("gated_linear_unit", "a non-gated MLP has no Llama/Qwen equivalent")
    if spec.moe_shared_expert_intermediate_size:
        refuse("moe_shared_expert_intermediate_size", "shared experts are not exported")
    if spec.moe_router_score_function != "softmax" or spec.moe_router_topk_scaling_factor:
        refuse("moe_router_score_function", "only plain softmax routing is exported")
    spec.require_supported()
    if spec.is_moe:
        arch, model_type = "Qwen3MoeForCausalLM", "qwen3_moe"
        if not spec.qk_layernorm:
            refuse("qk_layernorm", "a MoE model without qk-norm has no Qwen3-MoE equivalent")
    elif spec.qk_layernorm:
        arch, model_type = "Qwen3ForCausalLM", "qwen3"
    elif spec.add_qkv_bias and not spec.add_bias_linear:
        arch, model_type = "Qwen2ForCausalLM", "qwen2"
    else:
        arch, model_type = "LlamaForCausalLM", "llama"
    if model_type in ("qwen3", "qwen3_moe") and (spec.add_qkv_bias or spec.add_bias_linear):
        refuse("add_bias_linear", "Qwen3 has no linear biases")
    if model_type == "llama" and spec.add_qkv_bias and not spec.add_bias_linear:
        refuse("add_qkv_bias", "q/k/v-only biases with qk-norm have no equivalent")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": spec.rotary_base}
    if spec.rope_scaling:
        rope = {"rope_type": "llama3", "rope_theta": spec.rotary_base, "factor": spec.rope_scaling_factor,
                **_LLAMA3_FIXED}
    config: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_query_groups,
        "head_dim": spec.kv_channels,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_sequence_length,
        "hidden_act": "silu",
        "rms_norm_eps": spec.layernorm_epsilon,
        # both generations of transformers' rope keys: 4.x reads rope_theta/rope_scaling
        "rope_theta": spec.rotary_base,
        "rope_scaling": rope if spec.rope_scaling else None,
        "rope_parameters": rope,
        "tie_word_embeddings": spec.share_embeddings_and_output_weights,
        "attention_dropout": 0.0,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if model_type == "llama":
        config.update(attention_bias=spec.add_bias_linear, mlp_bias=spec.add_bias_linear)
    elif model_type in ("qwen3", "qwen3_moe"):
        config.update(attention_bias=False, use_sliding_window=False, sliding_window=None)
    else:
        config.update(use_sliding_window=False, sliding_window=None)
    if spec.is_moe:
        config.update(num_experts=spec.num_moe_experts, num_local_experts=spec.num_moe_experts,
                      num_experts_per_tok=spec.moe_router_topk, moe_intermediate_size=spec.moe_ffn_hidden_size,
                      norm_topk_prob=not spec.moe_router_pre_softmax, decoder_sparse_step=1,
                      mlp_only_layers=[], router_aux_loss_coef=0.0)
    return config


__all__ = ["ARCHITECTURES", "family_of", "hf_config_from_spec", "spec_from_hf_config"]
