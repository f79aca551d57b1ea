"""`mamba_stack_spec`: Megatron's hybrid stack spec (`--spec megatron.core.models.mamba.mamba_layer_specs
mamba_stack_spec`), built from the native modules in Transformer Engine's layout: every pre-norm is fused into
the following column-parallel linear (`mixer.in_proj.layer_norm_weight`, `self_attention.linear_qkv.
layer_norm_weight`, `mlp.linear_fc1.layer_norm_weight`), so state-dict keys equal those of Megatron's TE spec.
"""
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import TECompatibleDotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.layernorm_linear import LayerNormColumnParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

mamba_stack_spec = ModuleSpec(
    module=MambaStack,
    submodules=MambaStackSubmodules(
        mamba_layer=ModuleSpec(
            module=MambaLayer,
            submodules=MambaLayerSubmodules(
                mixer=ModuleSpec(
                    module=MambaMixer,
                    submodules=MambaMixerSubmodules(in_proj=LayerNormColumnParallelLinear,
                                                    out_proj=RowParallelLinear),
                ),
                mamba_bda=get_bias_dropout_add,
            ),
        ),
        attention_layer=ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                self_attention=ModuleSpec(
                    module=SelfAttention,
                    params={"attn_mask_type": AttnMaskType.causal},
                    submodules=SelfAttentionSubmodules(linear_qkv=LayerNormColumnParallelLinear,
                                                       core_attention=TECompatibleDotProductAttention,
                                                       linear_proj=RowParallelLinear),
                ),
                self_attn_bda=get_bias_dropout_add,
            ),
        ),
        mlp_layer=ModuleSpec(
            module=MLPLayer,
            submodules=TransformerLayerSubmodules(
                mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=LayerNormColumnParallelLinear,
                                                                    linear_fc2=RowParallelLinear)),
                mlp_bda=get_bias_dropout_add,
            ),
        ),
    ),
)

__all__ = ["mamba_stack_spec"]
