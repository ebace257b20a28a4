"""What model is being trained: a GPT spec whose fields follow megatron-core's names.

Field names match ``TransformerConfig`` / ``GPTModel`` arguments so a spec converts to a live
megatron model one to one (``liveshard.runtime.megatron.build``). Pure: no torch, no I/O
beyond reading a YAML file on request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from liveshard.runtime.contract.env import Env
from liveshard.runtime.dtypes import DTYPES, itemsize
from liveshard.runtime.errors import ConfigError, UnsupportedModelError, clip, short

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
ROUTER_SCORE_FUNCTIONS = ("softmax", "sigmoid")
# megatron-core's layer implementations (TransformerConfig.transformer_impl); "auto": the worker
# takes TransformerEngine's on a GPU where it is installed, else the local one.
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")

@dataclass(frozen=True)
class ModelSpec:
    """A megatron-core GPT model, described by its ``TransformerConfig``/``GPTModel`` fields."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    max_sequence_length: int
    ffn_hidden_size: int | None = None  # default 4 * hidden_size (megatron's default)
    num_query_groups: int | None = None  # None: multi-head attention (groups == heads)
    kv_channels: int | None = None  # None: hidden_size // num_attention_heads
    gated_linear_unit: bool = False
    normalization: str = "LayerNorm"
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000.0  # RoPE theta (HF rope_theta)
    # Llama 3.1 frequency scaling (megatron's only rope scaling: low/high frequency factors 1 and 4
    # over an original context of 8192 positions)
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    layernorm_epsilon: float = 1e-5
    share_embeddings_and_output_weights: bool = True
    num_moe_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"
    # False: softmax over the top-k logits (top-k weights sum to 1, HF norm_topk_prob=True);
    # True: softmax over all experts, then top-k (HF norm_topk_prob=False)
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    # Multi-latent attention (DeepSeek). Counted, but not laid out yet.
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    moe_first_dense_layers: int = 0  # leading layers with a dense MLP (DeepSeek's first_k_dense)
    # The vocabulary is padded once per job, independent of TP, so the embedding's logical shape
    # never changes across reconfigurations (megatron-LM pads per TP degree instead).
    make_vocab_size_divisible_by: int = 128
    params_dtype: str = "bf16"
    # Which megatron layer spec builds the model. The logical tensors (sharded_state_dict keys)
    # are the same for both; parameter names and their order in the gradient buffers are not:
    # TransformerEngine fuses each layernorm into the linear layer after it.
    transformer_impl: str = "auto"
    name: str = "custom"

    def __post_init__(self) -> None:
        # Fill derived defaults the way megatron's TransformerConfig does.
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.kv_channels is None and self.num_attention_heads > 0:
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)
        if self.num_moe_experts and self.moe_ffn_hidden_size is None:
            object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
        self.validate()

    # ---- validation -------------------------------------------------------------------------
    def validate(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                     "max_sequence_length", "ffn_hidden_size", "kv_channels", "num_query_groups",
                     "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(name, f"must be a positive integer, got {short(value)}")
        if self.normalization not in NORMALIZATIONS:
            raise ConfigError("normalization", f"unknown {short(self.normalization)}",
                              f"use one of {', '.join(NORMALIZATIONS)}")
        if self.position_embedding_type not in POSITION_EMBEDDINGS:
            raise ConfigError("position_embedding_type", f"unknown {short(self.position_embedding_type)}",
                              f"use one of {', '.join(POSITION_EMBEDDINGS)}")
        for name in ("rotary_base", "layernorm_epsilon", "rope_scaling_factor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(name, f"must be a positive number, got {short(value)}")
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ConfigError("transformer_impl", f"unknown {short(self.transformer_impl)}",
                              f"use one of {', '.join(TRANSFORMER_IMPLS)}")
        if self.moe_router_score_function not in ROUTER_SCORE_FUNCTIONS:
            raise ConfigError("moe_router_score_function", f"unknown {short(self.moe_router_score_function)}",
                              f"use one of {', '.join(ROUTER_SCORE_FUNCTIONS)}")
        if self.params_dtype not in DTYPES:
            raise ConfigError("params_dtype", f"unknown {short(self.params_dtype)}",
                              f"use one of {', '.join(DTYPES)}")
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError("num_query_groups",
                              f"{self.num_attention_heads} attention heads do not split into "
                              f"{self.num_query_groups} query groups",
                              "num_query_groups must divide num_attention_heads")
        if self.num_moe_experts is not None:
            if self.num_moe_experts <= 0:
                raise ConfigError("num_moe_experts", "must be positive or omitted for a dense model")
            if not 1 <= self.moe_router_topk <= self.num_moe_experts:
                raise ConfigError("moe_router_topk",
                                  f"{self.moe_router_topk} is not within 1..{self.num_moe_experts}")
            if self.moe_ffn_hidden_size is None or self.moe_ffn_hidden_size <= 0:
                raise ConfigError("moe_ffn_hidden_size", "must be a positive integer")
            if not 0 <= self.moe_first_dense_layers < self.num_layers:
                raise ConfigError("moe_first_dense_layers", "must be within 0..num_layers-1")
        elif self.moe_shared_expert_intermediate_size:
            raise ConfigError("moe_shared_expert_intermediate_size",
                              "set on a dense model", "set num_moe_experts or drop this field")

    # ---- derived facts ----------------------------------------------------------------------
    @property
    def fused_layernorms(self) -> bool:
        """TransformerEngine's layout: each layernorm a parameter of the linear layer after it."""
        return self.transformer_impl == "transformer_engine"

    @property
    def is_moe(self) -> bool:
        return bool(self.num_moe_experts)

    @property
    def padded_vocab_size(self) -> int:
        d = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // d) * d

    @property
    def query_projection_size(self) -> int:
        return self.kv_channels * self.num_attention_heads

    @property
    def qkv_rows(self) -> int:
        """Rows of ``linear_qkv.weight``: all query heads plus one key and one value per group."""
        return self.kv_channels * (self.num_attention_heads + 2 * self.num_query_groups)

    @property
    def bytes_per_param(self) -> int:
        return itemsize(self.params_dtype)

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.moe_first_dense_layers

    def require_supported(self) -> None:
        """Raise if liveshard cannot lay this model out (its parameters can still be counted)."""
        if self.multi_latent_attention:
            raise UnsupportedModelError(
                "multi_latent_attention",
                f"model {short(self.name)} uses multi-latent attention, which liveshard cannot reshard yet",
                "use a model with standard (grouped-query) attention",
            )
        if self.moe_first_dense_layers:
            raise UnsupportedModelError(
                "moe_first_dense_layers",
                "mixed dense/MoE layer stacks are not laid out yet",
                "use moe_first_dense_layers: 0",
            )

    # ---- parameter counts -------------------------------------------------------------------
    def _norm_params(self, width: int) -> int:
        return width * (2 if self.normalization == "LayerNorm" else 1)

    def _mlp_params(self, ffn: int) -> int:
        fc1_rows = ffn * (2 if self.gated_linear_unit else 1)
        n = fc1_rows * self.hidden_size + self.hidden_size * ffn
        if self.add_bias_linear:
            n += fc1_rows + self.hidden_size
        return n

    def _attention_params(self) -> int:
        h = self.hidden_size
        if self.multi_latent_attention:
            heads = self.num_attention_heads
            q_head = self.qk_head_dim + self.qk_pos_emb_head_dim
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * q_head
            else:
                q = h * heads * q_head
            kv = (h * (self.kv_lora_rank + self.qk_pos_emb_head_dim) + self.kv_lora_rank
                  + self.kv_lora_rank * heads * (self.qk_head_dim + self.v_head_dim))
            return q + kv + heads * self.v_head_dim * h
        n = self.qkv_rows * h + h * self.query_projection_size
        if self.add_qkv_bias or self.add_bias_linear:
            n += self.qkv_rows
        if self.add_bias_linear:
            n += h
        if self.qk_layernorm:
            n += 2 * self._norm_params(self.kv_channels)
        return n

    def layer_params(self, layer: int, active_only: bool = False) -> int:
        n = self._norm_params(self.hidden_size) * 2 + self._attention_params()
        if not self.is_moe_layer(layer):
            return n + self._mlp_params(self.ffn_hidden_size)
        experts = self.moe_router_topk if active_only else self.num_moe_experts
        n += self.num_moe_experts * self.hidden_size  # router
        n += experts * self._mlp_params(self.moe_ffn_hidden_size)
        if self.moe_shared_expert_intermediate_size:
            n += self._mlp_params(self.moe_shared_expert_intermediate_size)
        return n

    def num_parameters(self, active_only: bool = False, padded_vocab: bool = False) -> int:
        """Total parameters (``active_only``: those one token uses, i.e. top-k experts)."""
        vocab = self.padded_vocab_size if padded_vocab else self.vocab_size
        n = vocab * self.hidden_size
        if not self.share_embeddings_and_output_weights:
            n += vocab * self.hidden_size
        if self.position_embedding_type == "learned_absolute":
            n += self.max_sequence_length * self.hidden_size
        n += self._norm_params(self.hidden_size)  # final norm
        n += sum(self.layer_params(i, active_only) for i in range(self.num_layers))
        return n

    # ---- (de)serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """megatron's names: the form processes exchange (``LIVESHARD_MODEL``, checkpoints)."""
        return dataclasses.asdict(self)

    def to_crd(self) -> dict[str, Any]:
        """The CRD's names (camelCase), fields that are set and mean something for this model:
        a job's ``spec.model``. A dense model leaves out the expert fields, a model without rope
        the rope fields, one without multi-latent attention its fields (each reads back as its
        default, which such a model does not use)."""
        unused: set[str] = set()
        if not self.is_moe:
            unused |= {f.name for f in fields(self) if f.name.startswith("moe_")}
        if self.position_embedding_type != "rope":
            unused |= {"rotary_base", "rope_scaling", "rope_scaling_factor"}
        elif not self.rope_scaling:
            unused.add("rope_scaling_factor")
        if not self.multi_latent_attention:
            unused |= {"q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"}
        return {CRD_NAMES[k]: v for k, v in dataclasses.asdict(self).items() if v is not None and k not in unused}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "model", base: ModelSpec | None = None) -> ModelSpec:
        """Fields under the CRD's names (``numLayers``) or megatron's (``num_layers``), not both;
        over ``base`` (a preset) when given."""
        if not isinstance(data, dict):
            raise ConfigError(source, "must be a mapping of ModelSpec fields")
        named = {**(base.to_dict() if base is not None else {}), **model_fields(data, source)}
        required = [f.name for f in fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        # a field is named back as the input names its fields: megatron's way, or the CRD's
        megatron_style = bool(megatron_named(data))
        spelled = {megatron_name(str(k)): str(k) for k in data}

        def name_of(field: str) -> str:
            return spelled.get(field, field if megatron_style else CRD_NAMES[field])

        missing = [name for name in required if name not in named]
        if missing:
            raise ConfigError(f"{source}.{name_of(missing[0])}", "is required")
        try:
            return cls(**named)
        except ConfigError as e:
            if e.field in CRD_NAMES:  # validate() names megatron's field
                raise ConfigError(f"{source}.{name_of(e.field)}", e.problem, e.fix) from None
            raise
        except (TypeError, ValueError, OverflowError, ZeroDivisionError, AttributeError, KeyError) as e:
            # a wrong type or size that __post_init__ arithmetic tripped over
            raise ConfigError(source, f"a field has the wrong type or size ({' '.join(str(e).split())[:160]})",
                              "give each field the type the ModelSpec reference shows") from None


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


# megatron-core's field name -> the CRD's (``num_layers`` -> ``numLayers``); both are read,
# megatron's with a deprecation warning where a user wrote them (``megatron_named``).
CRD_NAMES: dict[str, str] = {f.name: _camel(f.name) for f in fields(ModelSpec)}
MEGATRON_NAMES: dict[str, str] = {crd: name for name, crd in CRD_NAMES.items()}


def megatron_name(key: str) -> str:
    """The ModelSpec field ``key`` names (either spelling); ``key`` itself if it names none."""
    return MEGATRON_NAMES.get(key, key)


def megatron_named(data: Any) -> list[str]:
    """The keys of ``data`` spelled megatron's way where the CRD's differs (``num_layers``)."""
    if not isinstance(data, dict):
        return []
    return [k for k in data if isinstance(k, str) and k in CRD_NAMES and CRD_NAMES[k] != k]


def model_fields(data: dict[str, Any], source: str = "model") -> dict[str, Any]:
    """``data`` keyed by megatron's names; a ConfigError for an unknown field or one given twice."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = megatron_name(str(key))
        if name not in CRD_NAMES:
            raise ConfigError(f"{source}.{clip(str(key), 80)}", "unknown field",
                              f"valid fields: {', '.join(sorted(MEGATRON_NAMES))} (or megatron's names, "
                              "e.g. num_layers)")
        if name in out:
            raise ConfigError(f"{source}.{CRD_NAMES[name]}", f"given twice, as {CRD_NAMES[name]} and {name}",
                              f"keep {CRD_NAMES[name]}")
        out[name] = value
    return out


def load_model(ref: str) -> ModelSpec:
    """A preset name or a YAML file of ModelSpec fields (optionally under a ``model:`` key)."""
    from liveshard.runtime.presets import PRESETS

    if ref in PRESETS:
        return PRESETS[ref]
    path = Path(ref)
    if not path.exists():
        raise ConfigError("model", f"{short(ref)} is neither a preset nor a file",
                          f"use a YAML file or one of: {', '.join(sorted(PRESETS))}")
    from liveshard.runtime.inputs import load_yaml

    data = load_yaml(path, "model", what="model file (YAML)")
    if isinstance(data, dict) and "model" in data and isinstance(data["model"], dict):
        data = data["model"]
    if isinstance(data, dict) and "preset" in data:
        base = data.pop("preset")
        if not isinstance(base, str) or base not in PRESETS:
            raise ConfigError("model.preset", f"unknown preset {short(base)}",
                              f"use one of: {', '.join(sorted(PRESETS))}")
        return ModelSpec.from_dict(data, source=str(path), base=PRESETS[base])
    return ModelSpec.from_dict(data, source=str(path))


def model_from_ref_or_env(ref: str | None) -> ModelSpec:
    """``--model`` if given, else ``$LIVESHARD_MODEL`` (the resolved ModelSpec as JSON, set by the operator)."""
    if ref:
        return load_model(ref)
    import json
    import os

    text = os.environ.get(Env.MODEL)
    if not text:
        raise ConfigError("--model", "no model given", "pass --model PRESET|FILE or set LIVESHARD_MODEL")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return load_model(text)  # a preset name or a file
    except (RecursionError, ValueError):
        raise ConfigError(Env.MODEL, "is not a usable ModelSpec (JSON nested too deeply or a number too long)",
                          "the operator writes it; do not edit it") from None
    return ModelSpec.from_dict(data, source=Env.MODEL)


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


__all__ = ["ModelSpec", "human_count", "load_model"]
