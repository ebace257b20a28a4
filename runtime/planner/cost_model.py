"""What a training step costs: the closed forms behind the parallelism planner.

``Hardware`` holds the constants (peak FLOP/s, MFU, link bandwidths, memory headroom); defaults
describe an H100 SXM node: 8 GPUs on NVLink, one 400 Gb/s NIC per GPU. ``ModelCosts`` turns a
``ModelSpec`` into per-layer quantities (parameters per rank, FLOPs and activation bytes per
token) so the planner's inner loop is a handful of multiplications per pipeline stage.

Conventions (megatron-core with Megatron-LM's usual settings):
* sequence parallelism whenever tp > 1, so activations are split over TP ranks;
* flash attention: no s x s score matrices are stored;
* gradients are accumulated and reduced in fp32 (``Hardware.grad_bytes``);
* Adam: fp32 main weights (16-bit params only) + two fp32 moments, split over DP ranks with the
  distributed optimizer;
* 1F1B pipeline schedule: stage i keeps min(pp - i, m) micro-batches of activations.

Parameter counts per rank follow ``liveshard.runtime.vps.layout.Layout`` exactly (a test checks
it); the rest are the standard estimates (Narayanan et al. 2021, Korthikanti et al. 2022).
Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from liveshard.runtime.spec import ModelSpec


@dataclass(frozen=True)
class Hardware:
    """The cost model's constants. Defaults: H100 SXM, NVLink within a node, 400 Gb/s per GPU."""

    name: str = "H100"  # the device these figures are of: every prediction says so
    peak_flops: float = 989e12  # dense bf16/fp16 tensor-core FLOP/s of a speed-1.0 GPU
    peak_flops_fp32: float = 494e12  # TF32, for fp32 models
    mfu: float = 0.45  # share of peak the matmuls reach
    nvlink_bytes_per_s: float = 360e9  # NCCL bus bandwidth inside a node
    network_bytes_per_s: float = 45e9  # per GPU between nodes
    nvlink_latency_s: float = 10e-6  # per collective
    network_latency_s: float = 30e-6
    hbm_bytes_per_s: float = 2.5e12  # effective, for the optimizer step
    grad_bytes: int = 4  # gradients accumulated and reduced in fp32
    logits_bytes: int = 6  # per logit: the 16-bit output plus the fp32 copy the loss uses
    memory_usable_fraction: float = 0.92  # the rest: CUDA context, NCCL buffers, fragmentation
    dp_overlap: float = 0.5  # share of data-parallel traffic hidden behind the backward pass
    # Arithmetic intensity (FLOP per byte moved) below which a matmul is bound by memory, not the
    # tensor cores. MoE expert matmuls can be far below it: few tokens per expert (rows) when EP
    # is small, narrow slices (columns) under expert TP. The FLOP count alone does not see that.
    # An estimate (H100: ~990 TFLOP/s over ~3.35 TB/s is ~300; the MFU above already covers part).
    gemm_ridge: float = 128.0

    def flops(self, params_dtype: str) -> float:
        return (self.peak_flops_fp32 if params_dtype == "fp32" else self.peak_flops) * self.mfu

    def expert_gemm_slowdown(self, rows: float, cols: float, inner: float) -> float:
        """Extra time of a ``rows x inner @ inner x cols`` matmul over its FLOP count at the MFU:
        ridge / intensity, with intensity = 1 / (1/rows + 1/cols + 1/inner) FLOP per byte."""
        if min(rows, cols, inner) <= 0:
            return 0.0
        return self.gemm_ridge * (1 / rows + 1 / cols + 1 / inner)

    def link(self, local: bool) -> tuple[float, float]:
        """(bytes/s, latency) of a group that stays inside one node, or one that spans nodes."""
        if local:
            return self.nvlink_bytes_per_s, self.nvlink_latency_s
        return self.network_bytes_per_s, self.network_latency_s


@dataclass(frozen=True)
class ModelCosts:
    """Per-layer costs of one model at one sequence length and micro-batch size.

    Parameter counts are split by how megatron shards them: ``*_sharded`` over TP, ``*_replicated``
    on every TP rank, experts over EP x expert-TP. Per-layer values are averages over the layers.
    """

    spec: ModelSpec
    seq_length: int
    micro_batch: int
    layer_replicated: float
    layer_sharded: float
    layer_experts: float  # number of experts in an average layer (0 for dense)
    expert_sharded: int  # per expert: split over expert-TP
    expert_replicated: int  # per expert: the fc2 bias, on every expert-TP rank
    first_sharded: int  # word embeddings
    first_replicated: int  # learned position embeddings
    last_sharded: int  # output layer (untied, or the tied copy when pp > 1)
    last_replicated: int  # final norm
    tied_output: bool
    flops_per_token_layer: float  # forward + backward, matmuls + causal attention
    flops_per_token_output: float
    act_per_token_layer: float  # bytes kept for backward, before the split over TP
    logits_per_token: float  # bytes
    hidden_bytes_per_token: int  # one activation row [h], for TP/PP/EP traffic
    topk: int
    expert_flops_per_token_layer: float = 0.0  # the routed experts' share of flops_per_token_layer

    @classmethod
    def of(cls, spec: ModelSpec, seq_length: int, micro_batch: int, hw: Hardware) -> ModelCosts:
        h, L = spec.hidden_size, spec.num_layers
        act = spec.bytes_per_param  # activations in the training dtype
        norm = spec._norm_params(h)
        row_bias = h if spec.add_bias_linear else 0
        q, kv = spec.query_projection_size, spec.kv_channels * spec.num_query_groups

        replicated = sharded = experts = 0.0
        flops = act_elems = expert_flops = 0.0
        expert_mlp = spec._mlp_params(spec.moe_ffn_hidden_size) if spec.is_moe else 0
        for layer in range(L):
            total = spec.layer_params(layer)
            rep = 2 * norm + row_bias  # two norms and linear_proj.bias
            if spec.qk_layernorm:
                rep += 2 * spec._norm_params(spec.kv_channels)
            elems = 4 * h + 2 * q + 2 * kv  # norm in/out twice, Q K V, attention output
            if spec.is_moe_layer(layer):
                rep += spec.num_moe_experts * h  # router
                experts += spec.num_moe_experts
                exp = spec.num_moe_experts * expert_mlp
                ffn = spec.moe_ffn_hidden_size
                expert_flops += 6 * spec.moe_router_topk * expert_mlp
                fc1 = ffn * (2 if spec.gated_linear_unit else 1)
                elems += spec.moe_router_topk * (h + fc1 + ffn)  # permuted input, fc1 out, fc2 in
                shared = spec.moe_shared_expert_intermediate_size
                if shared:
                    rep += row_bias
                    elems += shared * (3 if spec.gated_linear_unit else 2)
            else:
                exp = 0
                rep += row_bias  # linear_fc2.bias
                fc1 = spec.ffn_hidden_size * (2 if spec.gated_linear_unit else 1)
                elems += fc1 + spec.ffn_hidden_size
            replicated += rep
            sharded += total - rep - exp
            flops += 6 * spec.layer_params(layer, active_only=True) + 6 * seq_length * q
            act_elems += elems

        vocab = spec.padded_vocab_size
        tied = spec.share_embeddings_and_output_weights
        return cls(
            spec=spec, seq_length=seq_length, micro_batch=micro_batch,
            layer_replicated=replicated / L, layer_sharded=sharded / L, layer_experts=experts / L,
            expert_sharded=expert_mlp - row_bias if spec.is_moe else 0,
            expert_replicated=row_bias if spec.is_moe else 0,
            first_sharded=vocab * h,
            first_replicated=(spec.max_sequence_length * h
                              if spec.position_embedding_type == "learned_absolute" else 0),
            last_sharded=vocab * h, last_replicated=norm, tied_output=tied,
            flops_per_token_layer=flops / L, flops_per_token_output=6 * vocab * h,
            act_per_token_layer=act_elems / L * act, logits_per_token=vocab * hw.logits_bytes,
            hidden_bytes_per_token=h * act, topk=spec.moe_router_topk if spec.is_moe else 0,
            expert_flops_per_token_layer=expert_flops / L,
        )

    @property
    def tokens(self) -> int:
        """Tokens in one micro-batch."""
        return self.seq_length * self.micro_batch

    # ---- parameters one rank holds -------------------------------------------------------
    def layer_dense_params(self, tp: int) -> float:
        return self.layer_replicated + self.layer_sharded / tp

    def layer_expert_params(self, ep: int, etp: int) -> float:
        return self.layer_experts / ep * (self.expert_sharded / etp + self.expert_replicated)

    def first_stage_params(self, tp: int) -> float:
        return self.first_sharded / tp + self.first_replicated

    def last_stage_params(self, tp: int, pp: int) -> float:
        out = self.last_sharded / tp if (not self.tied_output or pp > 1) else 0.0
        return out + self.last_replicated

    # ---- bytes per parameter -------------------------------------------------------------
    def optimizer_bytes_per_param(self) -> int:
        """Adam's two fp32 moments, plus an fp32 main copy of 16-bit weights."""
        return 8 + (4 if self.spec.params_dtype != "fp32" else 0)

    def state_bytes_per_param(self, hw: Hardware, shards: int, dist_opt: bool) -> float:
        """Weights + gradients + optimizer state of one parameter on one rank."""
        optimizer = self.optimizer_bytes_per_param() / (shards if dist_opt else 1)
        return self.spec.bytes_per_param + hw.grad_bytes + optimizer

    # ---- activations -------------------------------------------------------------------
    def layer_activation_bytes(self, tp: int) -> float:
        """What one layer keeps for backward, per micro-batch, on one TP rank."""
        return self.act_per_token_layer * self.tokens / tp

    def logits_bytes(self, tp: int) -> float:
        return self.logits_per_token * self.tokens / tp
