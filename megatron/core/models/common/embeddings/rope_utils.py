"""Megatron's import path for the RoPE helpers. The rotation itself lives in
`megatron.core.transformer.rope_utils` (attention, in the transformer package, must not import the models
package); this module adds the helpers that only model code and user code call."""
from typing import Optional

import torch

from megatron.core import parallel_state
from megatron.core.transformer.rope_utils import (
    _apply_rotary_pos_emb_bshd,
    _apply_rotary_pos_emb_thd,
    _get_thd_freqs_on_this_cp_rank,
    _rotate_half,
    apply_rotary_pos_emb,
)


def get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group=None) -> torch.Tensor:
    """This context-parallel rank's part of position embeddings along `seq_dim`.

    The sequence is cut into 2 * CP chunks and rank r keeps chunks r and 2 * CP - 1 - r (the load-balanced
    split of causal attention). `cp_group` None means parallel_state's context-parallel group.
    """
    if cp_group is None:
        cp_size = parallel_state.get_context_parallel_world_size()
        cp_rank = parallel_state.get_context_parallel_rank()
    else:
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
    if cp_size == 1:
        return pos_emb
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    shape = pos_emb.shape
    chunks = pos_emb.view(*shape[:seq_dim], 2 * cp_size, -1, *shape[seq_dim + 1:])  # [.., s, ..] -> [.., 2cp, s/2cp, ..]
    selected = chunks.index_select(seq_dim, index)
    return selected.reshape(*shape[:seq_dim], -1, *shape[seq_dim + 1:])  # [.., 2, s/2cp, ..] -> [.., s/cp, ..]


def apply_rotary_pos_emb_with_cos_sin(
    t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_interleaved: bool = False
) -> torch.Tensor:
    """Rotate t ([s, b, np, hn]) by precomputed cos and sin tables of shape [>= s, rot / 2].

    The first `rot = 2 * cos.shape[-1]` channels of each head are rotated, the rest pass through: channel i
    pairs with i + rot/2 (or, interleaved, 2i with 2i + 1), both rotated by angle i of the position. cos and
    sin are cast to t's dtype first, as Megatron does. Equals `apply_rotary_pos_emb(t, freqs)` for
    `cos = freqs.cos()`, `sin = freqs.sin()` of the non-repeated angles.
    """
    seq_len = t.size(0)
    cos = cos[:seq_len].to(device=t.device, dtype=t.dtype)
    sin = sin[:seq_len].to(device=t.device, dtype=t.dtype)
    if rotary_interleaved:
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)  # [s, rot/2] -> [s, rot]
    else:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # [s, rot/2] -> [s, rot]
    cos, sin = cos[:, None, None, :], sin[:, None, None, :]  # [s, rot] -> [s, 1, 1, rot]
    rot_dim = cos.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    rotated = t_rot * cos + _rotate_half(t_rot, rotary_interleaved) * sin
    return torch.cat((rotated, t_pass), dim=-1)


__all__ = [
    "apply_rotary_pos_emb",
    "apply_rotary_pos_emb_with_cos_sin",
    "get_pos_emb_on_this_cp_rank",
    "_apply_rotary_pos_emb_bshd",
    "_apply_rotary_pos_emb_thd",
    "_get_thd_freqs_on_this_cp_rank",
    "_rotate_half",
]
