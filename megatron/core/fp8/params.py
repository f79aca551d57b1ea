"""FP8 parameters (`--fp8-param-gather`): the FP8 copy of a weight that the FP8 GEMMs use as it is.

With FP8 parameters the distributed optimizer keeps fp32 master weights, quantizes each rank's shard of an
FP8 weight into FP8 bytes (one scale per weight: the amax over the shards, `distributed.fp8_param_gather`)
and all-gathers those bytes; the gathered bytes, with their scale, are the weight's primary copy for the
forward (`weight.fp8_weight_copy`), so the FP8 linear does not quantize the weight again. The bf16/fp32
parameter tensor receives the dequantized values, so that everything that reads the parameter (bf16 code,
checkpoints, which load without FP8) sees exactly the weight the FP8 GEMMs use.
"""
from typing import Optional

import torch

from megatron.core.fp8 import kernels


class Fp8WeightCopy:
    """FP8 values `data` (E4M3, the weight's shape) and `scale_inv` ([1] fp32) of a weight, with the
    transposed copy the input-gradient GEMM needs made on first use."""

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor):
        self.data = data
        self.scale_inv = scale_inv
        self._transposed: Optional[torch.Tensor] = None

    def update(self, scale_inv: torch.Tensor) -> None:
        """After new bytes arrived in `data` (in place): take their scale and refresh the transposed copy, both
        in place (captured CUDA graphs keep pointing at the same tensors)."""
        self.scale_inv.copy_(scale_inv)
        if self._transposed is not None:
            self._transposed.copy_(self.data.t())

    def transposed(self) -> torch.Tensor:
        """data^T, contiguous ([in, out] for an [out, in] weight)."""
        if self._transposed is None:
            self._transposed = self.data.t().contiguous()
        return self._transposed

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """data * scale_inv in `dtype`."""
        return (self.data.float() * self.scale_inv).to(dtype)


_ROW = 128


def quantize_shard(shard: torch.Tensor, amax_: torch.Tensor, margin: int = 0):
    """(E4M3 values of a 1-D shard, scale_inv [1]) under the scale of the whole weight's `amax_` ([1] fp32)."""
    n = shard.numel()
    # [n] -> [n / 128, 128] (the quantizer takes 2-D tensors and tiles them 64 x 128: rows of 128 fill its
    # tiles), else [1, n]
    rows = shard.reshape(-1, _ROW) if n % _ROW == 0 and n > 0 else shard.reshape(1, -1)
    q, _, scale_inv = kernels.quantize(rows, amax_, kernels.E4M3, margin)
    return q.reshape(-1), scale_inv


def fp8_copy_of(weight: torch.Tensor) -> Optional[Fp8WeightCopy]:
    """The FP8 primary copy of `weight` when it has one (FP8 parameters after a parameter all-gather)."""
    return getattr(weight, "fp8_weight_copy", None)


__all__ = ["Fp8WeightCopy", "quantize_shard", "fp8_copy_of"]
