"""Applying rotary position embeddings to [s, b, np, hn] (or packed [t, np, hn]) tensors.

`freqs` holds the angles for the rotated part of each head ([s, 1, 1, rot_dim]); when rot_dim is
smaller than the head dim (rotary_percent < 1) the remaining channels pass through unchanged.
Non-interleaved rotation pairs channel i with i + rot_dim/2 (Llama / GPT-NeoX); interleaved rotation
pairs channels 2i and 2i+1 (RoFormer / GPT-J).
"""
from typing import Optional

import torch

from megatron.core import parallel_state
from megatron.core.context_parallel.layout import thd_partitioned_indices, thd_positions
from megatron.core.fusions._compile import CudaCompiled


def _rotate_half(x: torch.Tensor, rotary_interleaved: bool) -> torch.Tensor:
    if not rotary_interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    rotated = torch.stack((-x2, x1), dim=-1)
    return rotated.flatten(-2)  # [..., d/2, 2] -> [..., d]


def _apply_rotary_pos_emb_bshd(
    t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False, mscale: float = 1.0
) -> torch.Tensor:
    """Rotate the first freqs.shape[-1] channels of t ([s, b, np, hn]) by angles `freqs` ([s, 1, 1, rot])."""
    rot_dim = freqs.shape[-1]
    freqs = freqs.to(t.device)
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos_ = (torch.cos(freqs) * mscale).to(t.dtype)
    sin_ = (torch.sin(freqs) * mscale).to(t.dtype)
    t_rot = (t_rot * cos_) + (_rotate_half(t_rot, rotary_interleaved) * sin_)
    return torch.cat((t_rot, t_pass), dim=-1)


# On CUDA the rotation (cos/sin, rotate-half, multiply-add, concat) is one compiled kernel forward and
# one backward instead of about eight eager passes over q and k; on CPU it runs eagerly.
_apply_rotary_pos_emb_bshd_fused = CudaCompiled(_apply_rotary_pos_emb_bshd)


def _apply_rotary_pos_emb_thd(
    t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False, mscale=1.0,
    cp_group=None,
) -> torch.Tensor:
    """Packed sequences: t is [tokens, np, hn]; each sequence restarts at position 0.

    `cu_seqlens` are the prefix sums of the full (all CP ranks) sequence lengths. Under context parallelism
    this rank holds chunks r and 2CP-1-r of every sequence, whose positions are [r*c, (r+1)*c) and
    [L - (r+1)*c, L - r*c) with c = L / (2CP) (Megatron's rule). No host synchronisation."""
    cp_size, cp_rank = _cp_size_and_rank(cp_group)
    if cp_size == 1:
        index = torch.arange(t.size(0), device=t.device)
    else:
        index = thd_partitioned_indices(cu_seqlens.to(t.device), t.size(0) * cp_size, cp_size, cp_rank)
    positions = thd_positions(index, cu_seqlens)
    angles = freqs.to(t.device)[positions]  # [S, 1, 1, rot] -> [t, 1, 1, rot]
    return _apply_rotary_pos_emb_bshd(t.unsqueeze(1), angles, rotary_interleaved, mscale).squeeze(1)  # [t, 1, np, hn] -> [t, np, hn]


def _get_thd_freqs_on_this_cp_rank(cp_rank: int, cp_size: int, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Angles of one packed sequence's tokens on this CP rank: x holds its 2 local chunks ([2c, ...]), so the
    positions are [r*c, (r+1)*c) and [L - (r+1)*c, L - r*c) with L = cp * 2c (Megatron's helper)."""
    if cp_size == 1:
        return freqs[: x.size(0)]
    half, full = x.size(0) // 2, cp_size * x.size(0)
    return torch.cat([freqs[cp_rank * half:(cp_rank + 1) * half],
                      freqs[full - (cp_rank + 1) * half:full - cp_rank * half]])


def _cp_size_and_rank(cp_group):
    if cp_group is not None:
        return cp_group.size(), cp_group.rank()
    return parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    config,
    cu_seqlens: Optional[torch.Tensor] = None,
    mscale: float = 1.0,
    cp_group=None,
) -> torch.Tensor:
    """Apply RoPE to `t` ([s, b, np, hn], or [t, np, hn] with `cu_seqlens`) with `config.rotary_interleaved`.

    `config.apply_rope_fusion` selects Transformer Engine's fused kernel in Megatron; here the rotation is
    compiled into one kernel on CUDA either way (same result).
    """
    interleaved = config.rotary_interleaved
    if cu_seqlens is None:
        return _apply_rotary_pos_emb_bshd_fused(t, freqs, interleaved, mscale)
    return _apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, rotary_interleaved=interleaved, mscale=mscale,
                                     cp_group=cp_group)


__all__ = ["apply_rotary_pos_emb", "_get_thd_freqs_on_this_cp_rank"]
