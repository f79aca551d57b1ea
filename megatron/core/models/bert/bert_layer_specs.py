"""Layer specs of BERT encoders (Megatron Core's names): GPT's dense layer with padding self-attention.

`bert_layer_local_spec` holds native modules with separate norms (their distributed-checkpoint keys renamed to
TE's). `get_bert_layer_with_transformer_engine_spec()` (and the module-level `bert_layer_with_transformer_engine_spec`
Megatron's scripts read) fuses the norms into `linear_qkv` / `linear_fc1` with TE's keys, built from TE's modules
when Transformer Engine imports and from the native modules in the same layout otherwise (whose core
attention is then `PaddingVarlenAttention`: padded batches run FlashAttention's varlen kernel on GPUs).
"""
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.bert.padding_attention import PaddingVarlenAttention
from megatron.core.models.gpt.gpt_layer_specs import _dense_layer_spec, _transformer_engine_backend
from megatron.core.transformer.dot_product_attention import TECompatibleDotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec


def _bert_layer_spec(backend) -> ModuleSpec:
    """A dense transformer layer of `backend` whose self-attention takes a padding mask (not causal)."""
    spec = _dense_layer_spec(backend, qk_layernorm=False, qk_l2_norm=False, normalization=None)
    spec.submodules.self_attention.params = {"attn_mask_type": AttnMaskType.padding}
    attention = spec.submodules.self_attention.submodules
    if attention.core_attention is TECompatibleDotProductAttention:  # native TE layout: packed varlen on GPUs
        attention.core_attention = PaddingVarlenAttention
    return spec


def get_bert_layer_with_transformer_engine_spec() -> ModuleSpec:
    """BERT layer in Transformer Engine's layout (TE's modules when TE imports, else the native ones)."""
    return _bert_layer_spec(_transformer_engine_backend())


def get_bert_layer_local_spec() -> ModuleSpec:
    """BERT layer of native modules with separate norms (`--spec local` / `--transformer-impl local`)."""
    return _bert_layer_spec(LocalSpecProvider())


bert_layer_local_spec = get_bert_layer_local_spec()
bert_layer_with_transformer_engine_spec = get_bert_layer_with_transformer_engine_spec()

__all__ = [
    "bert_layer_local_spec",
    "bert_layer_with_transformer_engine_spec",
    "get_bert_layer_local_spec",
    "get_bert_layer_with_transformer_engine_spec",
]
