"""Layer and block specs of T5 encoders and decoders (Megatron Core's function names).

Encoder layers: padding self-attention + MLP. Decoder layers: causal self-attention, a separate
`pre_cross_attn_layernorm`, `CrossAttention` (`linear_q`, `linear_kv`, `linear_proj`; mask type
`arbitrary`) and an MLP. The Transformer Engine specs fuse the input and pre-MLP norms into `linear_qkv`
/ `linear_fc1` (TE's keys; TE's modules when Transformer Engine imports, else the native modules in its
layout, whose encoder self-attention is `PaddingVarlenAttention`: FlashAttention's varlen kernel for padded
batches on GPUs without a relative-position bias); the local specs keep separate norms and rename them to TE's keys in distributed checkpoints.
"""
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.bert.padding_attention import PaddingVarlenAttention
from megatron.core.models.gpt.gpt_layer_specs import _dense_layer_spec, _transformer_engine_backend
from megatron.core.transformer.attention import CrossAttention, CrossAttentionSubmodules
from megatron.core.transformer.dot_product_attention import TECompatibleDotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules


def _encoder_spec(backend) -> ModuleSpec:
    spec = _dense_layer_spec(backend, qk_layernorm=False, qk_l2_norm=False, normalization=None)
    spec.submodules.self_attention.params = {"attn_mask_type": AttnMaskType.padding}
    attention = spec.submodules.self_attention.submodules
    if attention.core_attention is TECompatibleDotProductAttention:  # native TE layout: packed varlen on GPUs
        attention.core_attention = PaddingVarlenAttention
    return spec


def _decoder_spec(backend) -> ModuleSpec:
    spec = _dense_layer_spec(backend, qk_layernorm=False, qk_l2_norm=False, normalization=None)
    spec.submodules.pre_cross_attn_layernorm = backend.layer_norm()
    spec.submodules.cross_attention = ModuleSpec(
        module=CrossAttention,
        params={"attn_mask_type": AttnMaskType.arbitrary},
        submodules=CrossAttentionSubmodules(
            linear_q=backend.column_parallel_linear(),
            linear_kv=backend.column_parallel_linear(),
            core_attention=backend.core_attention(),
            linear_proj=backend.row_parallel_linear(),
        ),
    )
    spec.submodules.cross_attn_bda = get_bias_dropout_add
    return spec


def encoder_model_with_transformer_engine_default_spec() -> ModuleSpec:
    """T5 encoder layer in Transformer Engine's layout."""
    return _encoder_spec(_transformer_engine_backend())


def decoder_model_with_transformer_engine_default_spec() -> ModuleSpec:
    """T5 decoder layer in Transformer Engine's layout."""
    return _decoder_spec(_transformer_engine_backend())


def encoder_model_with_local_spec() -> ModuleSpec:
    """T5 encoder layer of native modules with separate norms."""
    return _encoder_spec(LocalSpecProvider())


def decoder_model_with_local_spec() -> ModuleSpec:
    """T5 decoder layer of native modules with separate norms."""
    return _decoder_spec(LocalSpecProvider())


def _block(layer_spec: ModuleSpec, num_layers: int, backend) -> TransformerBlockSubmodules:
    return TransformerBlockSubmodules([layer_spec] * num_layers, layer_norm=backend.layer_norm())


def get_t5_encoder_with_transformer_engine_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """`num_layers` TE-layout encoder layers and the final norm."""
    return _block(encoder_model_with_transformer_engine_default_spec(), num_layers, _transformer_engine_backend())


def get_t5_decoder_with_transformer_engine_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """`num_layers` TE-layout decoder layers and the final norm."""
    return _block(decoder_model_with_transformer_engine_default_spec(), num_layers, _transformer_engine_backend())


def get_t5_encoder_with_local_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """`num_layers` local encoder layers and the final norm."""
    return _block(encoder_model_with_local_spec(), num_layers, LocalSpecProvider())


def get_t5_decoder_with_local_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """`num_layers` local decoder layers and the final norm."""
    return _block(decoder_model_with_local_spec(), num_layers, LocalSpecProvider())


__all__ = [
    "encoder_model_with_transformer_engine_default_spec",
    "decoder_model_with_transformer_engine_default_spec",
    "encoder_model_with_local_spec",
    "decoder_model_with_local_spec",
    "get_t5_encoder_with_transformer_engine_block_spec",
    "get_t5_decoder_with_transformer_engine_block_spec",
    "get_t5_encoder_with_local_block_spec",
    "get_t5_decoder_with_local_block_spec",
]
