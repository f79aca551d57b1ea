"""Megatron's older module name for the torch norms: `WrappedTorchLayerNorm` is `WrappedTorchNorm`.

Megatron warns on importing it (deprecated in favour of `torch_norm`); here importing stays silent, as every
module's import does."""
from megatron.core.transformer.torch_norm import WrappedTorchNorm

WrappedTorchLayerNorm = WrappedTorchNorm

__all__ = ["WrappedTorchLayerNorm"]
