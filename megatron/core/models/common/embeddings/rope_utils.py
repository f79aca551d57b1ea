"""Megatron's import path for the RoPE helpers; they live in `megatron.core.transformer.rope_utils` so
that attention (in the transformer package) does not import the models package."""
from megatron.core.transformer.rope_utils import (
    _apply_rotary_pos_emb_bshd,
    _apply_rotary_pos_emb_thd,
    _rotate_half,
    apply_rotary_pos_emb,
)

__all__ = ["apply_rotary_pos_emb", "_apply_rotary_pos_emb_bshd", "_apply_rotary_pos_emb_thd", "_rotate_half"]
