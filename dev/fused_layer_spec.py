"""A CPU stand-in for TransformerEngine's GPT layer spec, for tests.

TransformerEngine (GPU only) fuses each layer norm into the linear layer after it
(``TELayerNormColumnParallelLinear``): the attention's input norm becomes
``self_attention.linear_qkv.layer_norm_weight`` and a dense MLP's norm
``mlp.linear_fc1.layer_norm_weight``, registered before the linear's own weight. The parameter
names and their order (hence the gradient buffers and the distributed optimizer's shards) differ
from megatron's local spec; the logical tensors (``sharded_state_dict`` keys) do not.

``fused_layer_spec(spec)`` builds that structure from megatron's local modules, so a CPU test can
check that ``Layout`` with ``transformer_impl="transformer_engine"`` matches a live model of it,
and that state moves through sharded keys rather than module names.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from liveshard.runtime.spec import ModelSpec


def _fused_linear_class() -> type:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    class LayerNormColumnParallelLinear(ColumnParallelLinear):
        """Norm then column-parallel linear, with the norm's parameters registered first."""

        def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any) -> None:
            super().__init__(input_size, output_size, config=config, **kwargs)
            self._norm = config.normalization
            self._eps = config.layernorm_epsilon
            own = dict(self._parameters)
            self._parameters.clear()
            self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
            if self._norm == "LayerNorm":
                self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype))
            self._parameters.update(own)

        def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
            shape = (x.shape[-1],)
            if self._norm == "RMSNorm":
                x = F.rms_norm(x, shape, self.layer_norm_weight, self._eps)
            else:
                x = F.layer_norm(x, shape, self.layer_norm_weight, self.layer_norm_bias, self._eps)
            return super().forward(x, *args, **kwargs)

    return LayerNormColumnParallelLinear


def fused_layer_spec(spec: ModelSpec) -> Any:
    """megatron's local layer spec with TransformerEngine's fused-norm structure."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp

    layer = copy.deepcopy(get_gpt_layer_local_spec(num_experts=spec.num_moe_experts, qk_layernorm=spec.qk_layernorm,
                                                   normalization=spec.normalization))
    fused = _fused_linear_class()
    sub = layer.submodules
    sub.input_layernorm = IdentityOp
    sub.self_attention.submodules.linear_qkv = fused
    if not spec.is_moe:
        sub.pre_mlp_layernorm = IdentityOp
        sub.mlp.submodules.linear_fc1 = fused
    sub.sharded_state_dict_keys_map = {}
    return layer


__all__ = ["fused_layer_spec"]
