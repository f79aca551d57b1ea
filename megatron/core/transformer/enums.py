"""Enums of the transformer package (same names and values as Megatron Core 0.13.1)."""
import enum

from megatron.core.enums import ModelType


class LayerType(enum.Enum):
    """Kinds of layer a pipeline layout can place on a stage."""

    embedding = 1
    loss = 2
    encoder = 3
    decoder = 4
    mtp = 5


class AttnType(enum.Enum):
    """Self-attention or cross-attention."""

    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    """How the attention mask is formed."""

    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5


class AttnBackend(enum.Enum):
    """Attention kernel selection (`--attention-backend`)."""

    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5


__all__ = ["ModelType", "LayerType", "AttnType", "AttnMaskType", "AttnBackend"]
