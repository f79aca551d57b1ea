"""`get_gpt_heterogeneous_layer_spec`: one layer spec per block of a `HeterogeneousTransformerConfig`.

Per block (Megatron Core 0.13.1's mapping):
- attention: `no_op` -> IdentityOp (no norm, no bias-dropout-add); `replace_with_linear` -> one h -> h linear
  whose output is gathered back to the activation layout; else SelfAttention (its query groups come from the
  layer's config, `HeterogeneousTransformerConfig.get_config_for_layer`);
- MLP: `no_op` -> IdentityOp; `replace_with_linear` -> the gathered linear; else MLP (its intermediate size
  from the layer's config).
With `use_te` (`--transformer-impl transformer_engine`) the norms are fused into the following column-parallel
linear (Transformer Engine's layout and keys), built from the native modules (Transformer Engine's own
modules are not wired for heterogeneous layers). Without it the norms are separate modules and the
distributed-checkpoint keys are renamed to TE's only where Megatron renames them (a block with its own
query groups or intermediate size, or replaced by a linear): checkpoints interchange with Megatron's.
Layers are non-homogeneous, so their distributed-checkpoint keys carry the global layer index
(`decoder.layers.{i}.…`, `TransformerBlock.sharded_state_dict`).
"""
from typing import Dict, Optional, Union

from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import _transformer_engine_backend
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.heterogeneous.heterogeneous_config import (
    AttentionConfig,
    HeterogeneousTransformerConfig,
    MLPConfig,
    TransformerBlockConfig,
)
from megatron.core.transformer.heterogeneous.linear_replacements import (
    ColumnParallelLinearGathered,
    LayerNormColumnParallelLinearGathered,
)
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)


def _backend(use_te: bool):
    if not use_te:
        return LocalSpecProvider()
    backend = _transformer_engine_backend()
    if isinstance(backend, TESpecProvider):
        raise ValueError(
            "heterogeneous layers (--heterogeneous-layers-config-path) are built from the native modules: "
            "Transformer Engine's modules are not wired for them. Pass --transformer-impl local, or run where "
            "transformer_engine is not installed to get the native modules in Transformer Engine's layout."
        )
    return backend


def _replacement(backend) -> type:
    return LayerNormColumnParallelLinearGathered if backend.fuse_layernorm_and_linear() else ColumnParallelLinearGathered


def _layer_norm(part: Union[AttentionConfig, MLPConfig], backend, rms: bool) -> type:
    """No separate norm for a no-op block, nor where the backend fuses it into the next linear."""
    if part.no_op or backend.fuse_layernorm_and_linear():
        return IdentityOp
    return backend.layer_norm(rms_norm=rms, for_qk=False)


def _attention_spec(attention: AttentionConfig, backend, qk_layernorm: bool, rms: bool) -> ModuleSpec:
    if attention.no_op:
        return ModuleSpec(module=IdentityOp)
    if attention.replace_with_linear:
        return ModuleSpec(module=_replacement(backend), params={"tp_comm_buffer_name": "linear_attn"})
    fused = backend.fuse_layernorm_and_linear()
    qk_norm = backend.layer_norm(rms_norm=rms, for_qk=True) if qk_layernorm else IdentityOp
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=backend.column_parallel_layer_norm_linear() if fused else backend.column_parallel_linear(),
            core_attention=backend.core_attention(),
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=qk_norm,
            k_layernorm=qk_norm,
        ),
    )


def _mlp_spec(mlp: MLPConfig, backend) -> ModuleSpec:
    if mlp.no_op:
        return ModuleSpec(module=IdentityOp)
    if mlp.replace_with_linear:
        return ModuleSpec(module=_replacement(backend), params={"tp_comm_buffer_name": "linear_mlp"})
    fused = backend.fuse_layernorm_and_linear()
    fc1 = backend.column_parallel_layer_norm_linear() if fused else backend.column_parallel_linear()
    return ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=backend.row_parallel_linear()))


def _sharded_state_dict_keys_map(block: TransformerBlockConfig, use_te: bool) -> Dict[str, str]:
    """Megatron's renames of the separate norms' keys to TE's (local spec only, and only for these blocks)."""
    mapping = {}
    if use_te:
        return mapping
    if block.attention.num_query_groups is not None:
        mapping["input_layernorm."] = "self_attention.linear_qkv.layer_norm_"
    if block.attention.replace_with_linear:
        mapping["input_layernorm."] = "self_attention.layer_norm_"
    if block.mlp.ffn_hidden_size is not None:
        mapping["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    if block.mlp.replace_with_linear:
        mapping["pre_mlp_layernorm."] = "mlp.layer_norm_"
    return mapping


def _layer_spec(block: TransformerBlockConfig, backend, config: HeterogeneousTransformerConfig,
                use_te: bool) -> ModuleSpec:
    rms = config.normalization == "RMSNorm"
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=_layer_norm(block.attention, backend, rms),
            self_attention=_attention_spec(block.attention, backend, config.qk_layernorm, rms),
            self_attn_bda=IdentityFuncOp if block.attention.no_op else get_bias_dropout_add,
            pre_mlp_layernorm=_layer_norm(block.mlp, backend, rms),
            mlp=_mlp_spec(block.mlp, backend),
            mlp_bda=IdentityFuncOp if block.mlp.no_op else get_bias_dropout_add,
            sharded_state_dict_keys_map=_sharded_state_dict_keys_map(block, use_te),
        ),
    )


def get_gpt_heterogeneous_layer_spec(
    config: HeterogeneousTransformerConfig, use_te: bool = False, vp_stage: Optional[int] = None
) -> TransformerBlockSubmodules:
    """Specs of this (virtual) pipeline stage's layers, one per block of `config`, and the final norm."""
    if not isinstance(config, HeterogeneousTransformerConfig):
        raise ValueError(f"get_gpt_heterogeneous_layer_spec needs a HeterogeneousTransformerConfig, got "
                         f"{type(config).__name__}: build it with --heterogeneous-layers-config-path")
    backend = _backend(use_te)
    specs = [_layer_spec(block, backend, config, use_te) for block in config.per_block_parameters]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    local_specs = specs[offset : offset + get_num_layers_to_build(config, vp_stage=vp_stage)]
    return TransformerBlockSubmodules(layer_specs=local_specs, layer_norm=backend.layer_norm())


__all__ = ["get_gpt_heterogeneous_layer_spec"]
