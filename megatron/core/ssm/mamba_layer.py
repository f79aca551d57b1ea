"""`MambaLayer`: x = x + dropout(mixer(norm(x))) (the pre-norm is fused into the mixer's in_proj in the spec)."""
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import make_viewless_tensor


@dataclass
class MambaLayerSubmodules:
    """Specs of the slots of a Mamba layer."""

    norm: Union[ModuleSpec, type] = IdentityOp
    """Pre-norm (identity when it is fused into the mixer's in_proj)."""

    mixer: Union[ModuleSpec, type] = IdentityOp
    """The Mamba mixer."""

    mamba_bda: Union[ModuleSpec, type] = IdentityFuncOp
    """Bias-dropout-add after the mixer."""


class MambaLayer(MegatronModule):
    """One Mamba layer of a `MambaStack`."""

    def __init__(self, config: TransformerConfig, submodules: MambaLayerSubmodules, layer_number: int = 1,
                 residual_in_fp32: bool = False, model_comm_pgs=None):
        super().__init__(config)
        self.layer_number = layer_number
        self.residual_in_fp32 = residual_in_fp32
        self.hidden_dropout = config.hidden_dropout
        self.norm = build_module(submodules.norm, config=config, hidden_size=config.hidden_size,
                                 eps=config.layernorm_epsilon)
        self.mixer = build_module(submodules.mixer, config=config, d_model=config.hidden_size,
                                  layer_number=layer_number, model_comm_pgs=model_comm_pgs)
        self.mamba_bda = build_module(submodules.mamba_bda)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                inference_context=None, rotary_pos_emb=None, *, inference_params=None, **kwargs):
        """[s, b, h] -> [s, b, h]."""
        residual = hidden_states.float() if self.residual_in_fp32 else hidden_states
        mixed = self.mixer(self.norm(hidden_states), inference_context=inference_context)
        out = self.mamba_bda(self.training, self.config.bias_dropout_fusion)(mixed, residual, self.hidden_dropout)
        out = out.to(hidden_states.dtype)
        return make_viewless_tensor(inp=out, requires_grad=out.requires_grad, keep_graph=True)


__all__ = ["MambaLayer", "MambaLayerSubmodules"]
