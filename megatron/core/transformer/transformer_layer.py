"""`TransformerLayer`: pre-norm attention and MLP blocks with bias-dropout-add residuals.

    x = x + dropout(attention(input_layernorm(x)))
    x = x + dropout(mlp(pre_mlp_layernorm(x)))

(with an optional cross-attention block in between for encoder-decoder models). Which modules fill
each slot comes from the layer spec. Recompute wraps parts of the layer from outside (see
`recompute.py`); the forward itself is only the math.
"""
from abc import ABC
from dataclasses import dataclass, field
from typing import Dict, Optional, Union

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.utils import apply_prefix_mapping
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import BaseMoELayer
from megatron.core.transformer.recompute import apply_selective_recompute
from megatron.core.transformer.spec_utils import ModuleSpec, build_module, get_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import make_viewless_tensor


@dataclass
class TransformerLayerSubmodules:
    """Specs of the slots of a transformer layer (missing slots are identities)."""

    input_layernorm: Union[ModuleSpec, type] = IdentityOp
    """Norm before self-attention."""

    self_attention: Union[ModuleSpec, type] = IdentityOp
    """Self-attention."""

    self_attn_bda: Union[ModuleSpec, type] = IdentityFuncOp
    """Bias-dropout-add after self-attention."""

    pre_cross_attn_layernorm: Union[ModuleSpec, type] = IdentityOp
    """Norm before cross-attention."""

    cross_attention: Union[ModuleSpec, type] = IdentityOp
    """Cross-attention (encoder-decoder models)."""

    cross_attn_bda: Union[ModuleSpec, type] = IdentityFuncOp
    """Bias-dropout-add after cross-attention."""

    pre_mlp_layernorm: Union[ModuleSpec, type] = IdentityOp
    """Norm before the MLP."""

    mlp: Union[ModuleSpec, type] = IdentityOp
    """The MLP."""

    mlp_bda: Union[ModuleSpec, type] = IdentityFuncOp
    """Bias-dropout-add after the MLP."""

    sharded_state_dict_keys_map: Dict[str, str] = field(default_factory=dict)
    """Prefix renames applied to distributed-checkpoint keys (local names -> TE names)."""



class BaseTransformerLayer(ABC):
    """Marker base class of transformer layers (lets a block spec be given as a single layer spec)."""


def _layers_per_stage(config: TransformerConfig, pp_size: int):
    """Decoder layers on every (virtual stage, pipeline rank): a [vp][pp] table, vp-major order."""
    vp_size = config.virtual_pipeline_model_parallel_size if pp_size > 1 else None
    vp_size = vp_size or 1
    layout = config.pipeline_model_parallel_layout
    if layout is not None:
        return [[layout.get_num_layers_to_build(vp_stage=v, pp_rank=p) for p in range(pp_size)] for v in range(vp_size)]
    first, last = config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage
    if pp_size > 1 and (first is not None or last is not None):
        per_rank = _uneven_layers_per_rank(config.num_layers, pp_size, first, last)
    else:
        total = config.num_layers + config.account_for_embedding_in_pipeline_split
        total += config.account_for_loss_in_pipeline_split
        per_rank = [total // pp_size] * pp_size
    table = [[n // vp_size for n in per_rank] for _ in range(vp_size)]
    if config.account_for_embedding_in_pipeline_split:
        table[0][0] -= 1
    if config.account_for_loss_in_pipeline_split:
        table[-1][-1] -= 1
    return table


def _uneven_layers_per_rank(num_layers, pp_size, first, last):
    middle_stages = pp_size - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    per_middle = middle_layers // middle_stages if middle_stages > 0 else 0
    per_rank = [per_middle] * pp_size
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    return per_rank


def _pp_rank_and_size(pp_rank: Optional[int] = None):
    size = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank
    return rank, size


def _mlp_kwargs(mlp_spec, model_comm_pgs, tp_group) -> dict:
    """An MoE layer takes the model's process groups (EP, expert TP, ...); a dense MLP its TP group."""
    module = get_module(mlp_spec) if isinstance(mlp_spec, (ModuleSpec, type)) else None
    if isinstance(module, type) and issubclass(module, BaseMoELayer):
        return {"model_comm_pgs": model_comm_pgs} if model_comm_pgs is not None else {}
    return {"tp_group": tp_group} if tp_group is not None else {}


def get_transformer_layer_offset(config: TransformerConfig, vp_stage: Optional[int] = None, pp_rank=None) -> int:
    """0-based global index of this stage's first decoder layer (layers are numbered vp-major)."""
    rank, size = _pp_rank_and_size(pp_rank)
    if size == 1:
        return 0
    table = _layers_per_stage(config, size)
    vp = vp_stage or 0
    before = [n for v, row in enumerate(table) for p, n in enumerate(row) if v * size + p < vp * size + rank]
    return sum(before)


class TransformerLayer(MegatronModule, BaseTransformerLayer):
    """One transformer layer built from `TransformerLayerSubmodules`."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: TransformerLayerSubmodules,
        layer_number: int = 1,
        hidden_dropout: Optional[float] = None,
        model_comm_pgs=None,
        vp_stage: Optional[int] = None,
    ):
        super().__init__(config=config)
        self.submodules_config = submodules
        self.layer_number = layer_number + get_transformer_layer_offset(config, vp_stage)
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout
        self.vp_stage = vp_stage
        tp_group = getattr(model_comm_pgs, "tp", None) if model_comm_pgs is not None else None
        norm_kwargs = {"config": config, "hidden_size": config.hidden_size, "eps": config.layernorm_epsilon}
        attn_kwargs = {"config": config, "layer_number": self.layer_number, "model_comm_pgs": model_comm_pgs}
        self.input_layernorm = build_module(submodules.input_layernorm, **norm_kwargs)
        self.self_attention = build_module(submodules.self_attention, **attn_kwargs)
        self.self_attn_bda = build_module(submodules.self_attn_bda)
        self.pre_cross_attn_layernorm = build_module(submodules.pre_cross_attn_layernorm, **norm_kwargs)
        self.cross_attention = build_module(submodules.cross_attention, **attn_kwargs)
        self.cross_attn_bda = build_module(submodules.cross_attn_bda, config=config)
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, **norm_kwargs)
        self.mlp = build_module(submodules.mlp, config=config, **_mlp_kwargs(submodules.mlp, model_comm_pgs, tp_group))
        if isinstance(self.mlp, BaseMoELayer):
            self.mlp.set_layer_number(self.layer_number)
        self.mlp_bda = build_module(submodules.mlp_bda)
        if config.recompute_granularity == "selective":
            # An MoE layer recomputes itself ("moe", "moe_act", "shared_experts"); "mlp" means dense MLPs only.
            modules = [m for m in config.recompute_modules if not (m == "mlp" and isinstance(self.mlp, BaseMoELayer))]
            apply_selective_recompute(self, modules)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        context: Optional[torch.Tensor] = None,
        context_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        rotary_pos_cos: Optional[torch.Tensor] = None,
        rotary_pos_sin: Optional[torch.Tensor] = None,
        attention_bias: Optional[torch.Tensor] = None,
        inference_context=None,
        packed_seq_params=None,
        sequence_len_offset: Optional[torch.Tensor] = None,
        *,
        inference_params=None,
    ):
        """[s, b, h] -> ([s, b, h], context)."""
        bda = (self.training, self.config.bias_dropout_fusion)
        attention = self.self_attention(
            self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            attention_bias=attention_bias,
            inference_context=inference_context,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
        )
        hidden_states = self.self_attn_bda(*bda)(attention, hidden_states, self.hidden_dropout)

        cross = self.cross_attention(
            self.pre_cross_attn_layernorm(hidden_states), attention_mask=context_mask, key_value_states=context
        )
        if isinstance(cross, dict) and "context" in cross:
            context = cross["context"]
        hidden_states = self.cross_attn_bda(*bda)(cross, hidden_states, self.hidden_dropout)

        mlp_output = self.mlp(self.pre_mlp_layernorm(hidden_states))
        hidden_states = self.mlp_bda(*bda)(mlp_output, hidden_states, self.hidden_dropout)
        output = make_viewless_tensor(inp=hidden_states, requires_grad=hidden_states.requires_grad, keep_graph=True)
        return output, context

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Sharded state dict with the spec's key renames (local norm names -> TE names) applied."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        renames = {f"{prefix}{old}": f"{prefix}{new}" for old, new in self.submodules_config.sharded_state_dict_keys_map.items()}
        if renames:
            apply_prefix_mapping(sharded, renames)
        return sharded


__all__ = [
    "TransformerLayer",
    "TransformerLayerSubmodules",
    "BaseTransformerLayer",
    "get_transformer_layer_offset",
]
