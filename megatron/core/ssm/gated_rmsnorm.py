"""Grouped, gated RMSNorm of the Mamba-2 mixer (the `norm` of `MambaMixer`, key `norm.weight`).

`y = RMSNorm_grouped(x * silu(z)) * weight` with `norm_before_gate=False` (Megatron's only setting): the mean
square is taken over groups of `group_size` channels. Groups never straddle tensor-parallel ranks, so each rank
normalises its own channels exactly.
"""
from typing import Optional

import torch
import torch.nn.functional as F


class RMSNormGated(torch.nn.Module):
    """RMS norm over channel groups, optionally gated by silu(z) before normalising."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: Optional[int] = None,
                 norm_before_gate: bool = False, device=None, dtype=None):
        super().__init__()
        if norm_before_gate:
            raise ValueError("RMSNormGated: norm_before_gate=True is not supported (Megatron uses False).")
        self.eps = eps
        self.group_size = group_size or hidden_size
        if hidden_size % self.group_size:
            raise ValueError(f"RMSNormGated: hidden_size ({hidden_size}) must be divisible by group_size "
                             f"({self.group_size}).")
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, z: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x, z [..., d] -> [..., d] (fp32 math, result in the dtype of x)."""
        return gated_rms_norm(x, z, self.weight, self.group_size, self.eps)


def gated_rms_norm(x: torch.Tensor, z: Optional[torch.Tensor], weight: torch.Tensor, group_size: int,
                   eps: float) -> torch.Tensor:
    """RMSNorm_grouped(x * silu(z)) * weight over the last dimension (z optional), fp32 math."""
    xf = x.float()
    if z is not None:
        xf = xf * F.silu(z.float())
    grouped = xf.reshape(*xf.shape[:-1], -1, group_size)  # [..., d] -> [..., groups, group_size]
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = grouped.reshape(xf.shape) * weight.float()  # [..., groups, group_size] -> [..., d]
    return out.to(x.dtype)


__all__ = ["RMSNormGated", "gated_rms_norm"]
