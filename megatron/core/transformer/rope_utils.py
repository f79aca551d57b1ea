"""Applying rotary position embeddings to [s, b, np, hn] (or packed [t, np, hn]) tensors.

`freqs` holds the angles for the rotated part of each head ([s, 1, 1, rot_dim]); when rot_dim is
smaller than the head dim (rotary_percent < 1) the remaining channels pass through unchanged.
Non-interleaved rotation pairs channel i with i + rot_dim/2 (Llama / GPT-NeoX); interleaved rotation
pairs channels 2i and 2i+1 (RoFormer / GPT-J).
"""
from typing import Optional

import torch

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
    t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False, mscale=1.0
) -> torch.Tensor:
    """Packed sequences: t is [total_tokens, np, hn]; each sequence restarts at position 0."""
    seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    pieces = []
    for piece in torch.split(t, seqlens):
        rotated = _apply_rotary_pos_emb_bshd(piece.unsqueeze(1), freqs[: piece.size(0)], rotary_interleaved, mscale)
        pieces.append(rotated.squeeze(1))  # [s, 1, np, hn] -> [s, np, hn]
    return torch.cat(pieces)


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
    return _apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, rotary_interleaved=interleaved, mscale=mscale)


__all__ = ["apply_rotary_pos_emb"]
