"""Backend spec providers: which module classes fill the slots of a layer spec.

`LocalSpecProvider` returns the native Megatron Core modules (tensor-parallel linears, native
norms, SDPA attention). No Apex or Transformer Engine is needed, and choosing it has no process-wide
side effects. `TECompatibleLocalSpecProvider` returns the same native modules in Transformer Engine's
layout (norms fused into `linear_qkv` / `linear_fc1`, TE's state-dict keys): the `transformer_engine`
spec's fallback when Transformer Engine is absent. `TESpecProvider` (the TE modules themselves) lives in
`megatron.core.extensions.transformer_engine_spec_provider`.
"""
from typing import Optional, Protocol, Tuple

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention, TECompatibleDotProductAttention
from megatron.core.transformer.layernorm_linear import LayerNormColumnParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.torch_norm import L2Norm, WrappedTorchNorm


class BackendSpecProvider(Protocol):
    """What a backend must provide to build GPT layer specs."""

    def column_parallel_linear(self) -> type:
        """Column-parallel linear class."""

    def row_parallel_linear(self) -> type:
        """Row-parallel linear class."""

    def fuse_layernorm_and_linear(self) -> bool:
        """Whether norms are fused into the following linear."""

    def column_parallel_layer_norm_linear(self) -> Optional[type]:
        """Fused norm + column-parallel linear class, if the backend has one."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        """Norm class (LayerNorm or RMSNorm)."""

    def l2_norm(self) -> type:
        """L2 norm class (Llama-4 qk norm)."""

    def core_attention(self) -> type:
        """Core attention class."""

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool) -> Tuple[type, Optional[MLPSubmodules]]:
        """Expert MLP class and its submodules."""

    def activation_func(self) -> Optional[type]:
        """Activation module class, if the backend provides one."""


class LocalSpecProvider:
    """The native Megatron Core backend."""

    def column_parallel_linear(self) -> type:
        """Column-parallel linear class."""
        return ColumnParallelLinear

    def row_parallel_linear(self) -> type:
        """Row-parallel linear class."""
        return RowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        """Norms are separate modules."""
        return False

    def column_parallel_layer_norm_linear(self) -> Optional[type]:
        """No fused norm + linear class."""
        return None

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        """The native norm (LayerNorm or RMSNorm is chosen from `config.normalization`)."""
        return WrappedTorchNorm

    def l2_norm(self) -> type:
        """The native L2 norm (Llama-4 qk norm)."""
        return L2Norm

    def core_attention(self) -> type:
        """SDPA-based core attention."""
        return DotProductAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool):
        """The expert class and its submodules: GroupedMLP (one grouped GEMM for all local experts) with
        grouped GEMM, else SequentialMLP of native column/row-parallel linears (the keys of TE's linears)."""
        if moe_use_grouped_gemm:
            return GroupedMLP, None
        return SequentialMLP, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)

    def activation_func(self) -> Optional[type]:
        """No separate activation module: the MLP applies `config.activation_func`."""
        return None


class TECompatibleLocalSpecProvider(LocalSpecProvider):
    """The native modules in Transformer Engine's layout: norms fused into the following column-parallel
    linear (`LayerNormColumnParallelLinear`) and TE-like attention, so parameter names and state-dict keys
    equal those of Megatron's TE models."""

    def fuse_layernorm_and_linear(self) -> bool:
        """Norms are fused into linear_qkv / linear_fc1."""
        return True

    def column_parallel_layer_norm_linear(self) -> Optional[type]:
        """The native fused norm + column-parallel linear."""
        return LayerNormColumnParallelLinear

    def core_attention(self) -> type:
        """SDPA attention that, like TE's, ignores the mask of a causal layer."""
        return TECompatibleDotProductAttention


__all__ = ["BackendSpecProvider", "LocalSpecProvider", "TECompatibleLocalSpecProvider"]
