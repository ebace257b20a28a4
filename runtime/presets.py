"""Named model specs: tiny models for tests and demos, and published architectures.

``PUBLISHED_PARAMETERS`` holds the totals each model's authors publish; tests check the counts
computed from these specs against them. ``COUNTED_ONLY``: architectures liveshard counts
(parameters, FLOPs) but cannot lay out, so cannot train or reshard yet; no job or command takes
them as a preset.
"""

from __future__ import annotations

from liveshard.runtime.spec import ModelSpec

# Llama 3.1 (its Hugging Face config.json reads back as these presets: tests/unit/test_hf_config.py)
_LLAMA3 = dict(
    gated_linear_unit=True, normalization="RMSNorm", add_bias_linear=False,
    position_embedding_type="rope", share_embeddings_and_output_weights=False,
    vocab_size=128256, max_sequence_length=8192, rotary_base=500000.0, rope_scaling=True,
    rope_scaling_factor=8.0, layernorm_epsilon=1e-5,
)
_QWEN3_MOE = dict(
    gated_linear_unit=True, normalization="RMSNorm", add_bias_linear=False, qk_layernorm=True,
    position_embedding_type="rope", share_embeddings_and_output_weights=False,
    vocab_size=151936, max_sequence_length=40960, kv_channels=128, num_moe_experts=128,
    moe_router_topk=8, rotary_base=1000000.0, layernorm_epsilon=1e-6,
)
# Small models for CPU tests; each exercises a different set of megatron quirks.
_TINY_LLAMA = dict(
    num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
    gated_linear_unit=True, normalization="RMSNorm", add_bias_linear=False,
    position_embedding_type="rope", share_embeddings_and_output_weights=False,
    vocab_size=250, max_sequence_length=64, params_dtype="fp32",
)

PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # GPT-2 style: LayerNorm with bias, learned positions, tied embeddings, plain GeLU MLP.
        ModelSpec(name="tiny-gpt", num_layers=4, hidden_size=64, num_attention_heads=4,
                  ffn_hidden_size=256, vocab_size=250, max_sequence_length=64,
                  add_bias_linear=True, share_embeddings_and_output_weights=True,
                  position_embedding_type="learned_absolute", params_dtype="fp32"),
        # Llama style: RMSNorm, SwiGLU, GQA, rope, untied, no biases.
        ModelSpec(name="tiny-llama", **_TINY_LLAMA),
        ModelSpec(name="tiny-moe", **{**_TINY_LLAMA, "num_moe_experts": 4,
                                      "moe_ffn_hidden_size": 32, "moe_router_topk": 2}),
        # Qwen3-MoE style: qk layernorm and a shared expert.
        ModelSpec(name="tiny-qwen-moe", **{**_TINY_LLAMA, "num_moe_experts": 8,
                                           "moe_ffn_hidden_size": 16, "moe_router_topk": 2,
                                           "qk_layernorm": True,
                                           "moe_shared_expert_intermediate_size": 32}),
        # About 124M parameters: the size the CPU benchmarks use.
        ModelSpec(name="gpt-125m", num_layers=12, hidden_size=768, num_attention_heads=12,
                  ffn_hidden_size=3072, vocab_size=50257, max_sequence_length=1024,
                  share_embeddings_and_output_weights=True, params_dtype="fp32"),
        ModelSpec(name="llama3-8b", num_layers=32, hidden_size=4096, num_attention_heads=32,
                  num_query_groups=8, ffn_hidden_size=14336, **_LLAMA3),
        ModelSpec(name="llama3-70b", num_layers=80, hidden_size=8192, num_attention_heads=64,
                  num_query_groups=8, ffn_hidden_size=28672, **_LLAMA3),
        ModelSpec(name="qwen3-30b-a3b", num_layers=48, hidden_size=2048, num_attention_heads=32,
                  num_query_groups=4, ffn_hidden_size=6144, moe_ffn_hidden_size=768, **_QWEN3_MOE),
        ModelSpec(name="qwen3-235b-a22b", num_layers=94, hidden_size=4096, num_attention_heads=64,
                  num_query_groups=4, ffn_hidden_size=12288, moe_ffn_hidden_size=1536,
                  **_QWEN3_MOE),
    )
}

COUNTED_ONLY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # multi-latent attention and a first dense layer before the MoE ones (require_supported)
        ModelSpec(name="deepseek-v2-lite", num_layers=27, hidden_size=2048, num_attention_heads=16,
                  ffn_hidden_size=10944, gated_linear_unit=True, normalization="RMSNorm",
                  add_bias_linear=False, position_embedding_type="rope",
                  share_embeddings_and_output_weights=False, vocab_size=102400,
                  max_sequence_length=163840, num_moe_experts=64, moe_ffn_hidden_size=1408,
                  moe_shared_expert_intermediate_size=2816, moe_router_topk=6,
                  moe_first_dense_layers=1, multi_latent_attention=True, q_lora_rank=None,
                  kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128),
    )
}

# (total, active) parameters as published by each model's authors.
PUBLISHED_PARAMETERS: dict[str, tuple[float, float]] = {
    "llama3-8b": (8.03e9, 8.03e9),
    "llama3-70b": (70.55e9, 70.55e9),
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "qwen3-235b-a22b": (235e9, 22e9),
    "deepseek-v2-lite": (15.7e9, 2.4e9),
    "gpt-125m": (124e6, 124e6),
}
