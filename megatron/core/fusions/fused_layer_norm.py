"""`FusedLayerNorm`: Megatron's Apex-backed LayerNorm, here the native LayerNorm with the same constructor.

Megatron builds it from `get_gpt_layer_local_spec` when Apex is installed (and `WrappedTorchNorm` otherwise);
the parameters are the same (`weight`, `bias`), so checkpoints move between the two. `persist_layer_norm`
picked Apex's persistent kernel and changes nothing here.
"""
import torch

from megatron.core.transformer.torch_norm import LayerNorm
from megatron.core.transformer.transformer_config import TransformerConfig


class FusedLayerNorm(LayerNorm):
    """LayerNorm over the last dimension (zero-centred gamma from the config, sequence-parallel aware).

    Args:
        config: its `layernorm_zero_centered_gamma`, `sequence_parallel`, `params_dtype` and
            `use_cpu_initialization` are used, as in Megatron.
        hidden_size: normalised size.
        eps: added to the variance.
        persist_layer_norm: accepted (Apex's persistent kernel); no effect.
        zero_centered_gamma: accepted; Megatron reads the config's value instead, and so does this.
        normalization: must be "LayerNorm" (Megatron's FusedLayerNorm has no RMSNorm).
    """

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = True,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ):
        if normalization != "LayerNorm":
            raise ValueError(f"FusedLayerNorm supports only normalization='LayerNorm', got {normalization!r}: "
                             "use WrappedTorchNorm (or TENorm) for RMSNorm.")
        super().__init__(config, hidden_size, eps, zero_centered_gamma=config.layernorm_zero_centered_gamma)
        self.persist_layer_norm = persist_layer_norm


__all__ = ["FusedLayerNorm"]
