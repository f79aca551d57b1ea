"""`TESpecProvider`: the Transformer Engine backend of the layer specs (Megatron Core's path and name).

It hands out the wrapper classes of `megatron.core.extensions.transformer_engine`; Transformer Engine
itself is imported only when one of them is constructed. Norms are fused into the following
column-parallel linear (`TELayerNormColumnParallelLinear`), as in Megatron's TE models.
"""
from typing import Optional

from megatron.core.extensions.transformer_engine import (
    TEColumnParallelLinear,
    TEDotProductAttention,
    TELayerNormColumnParallelLinear,
    TENorm,
    TERowParallelLinear,
)
from megatron.core.transformer.torch_norm import L2Norm


class TESpecProvider:
    """The Transformer Engine backend (see `megatron.core.models.backends.BackendSpecProvider`)."""

    def column_parallel_linear(self) -> type:
        """TE column-parallel linear."""
        return TEColumnParallelLinear

    def row_parallel_linear(self) -> type:
        """TE row-parallel linear."""
        return TERowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        """Norms are fused into linear_qkv / linear_fc1."""
        return True

    def column_parallel_layer_norm_linear(self) -> Optional[type]:
        """TE's LayerNormLinear as a column-parallel linear."""
        return TELayerNormColumnParallelLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        """TE's LayerNorm or RMSNorm (chosen from `config.normalization`)."""
        return TENorm

    def l2_norm(self) -> type:
        """The native L2 norm (it has no weight, so nothing is gained from TE)."""
        return L2Norm

    def core_attention(self) -> type:
        """TE's DotProductAttention."""
        return TEDotProductAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool):
        """Transformer Engine's expert modules are not wired here (the native experts are, without TE)."""
        raise ValueError("mixture-of-experts layers (--num-experts) with Transformer Engine's modules are not wired "
                         "in this framework: use --transformer-impl local (the native experts, same checkpoint "
                         "layout).")

    def activation_func(self) -> Optional[type]:
        """No separate activation module: the MLP applies `config.activation_func`."""
        return None


__all__ = ["TESpecProvider"]
