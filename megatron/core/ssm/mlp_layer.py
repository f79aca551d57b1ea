"""`MLPLayer`: the MLP-only layer (`-`) of hybrid models, x = x + dropout(mlp(norm(x)))."""
from typing import Optional

import torch

from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import make_viewless_tensor


class MLPLayer(TransformerLayer):
    """A `TransformerLayer` whose spec fills only the MLP slots; its forward runs the MLP block alone."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, context=None,
                *args, **kwargs):
        """[s, b, h] -> ([s, b, h], context)."""
        mlp_output = self.mlp(self.pre_mlp_layernorm(hidden_states))
        bda = self.mlp_bda(self.training, self.config.bias_dropout_fusion)
        hidden_states = bda(mlp_output, hidden_states, self.hidden_dropout)
        output = make_viewless_tensor(inp=hidden_states, requires_grad=hidden_states.requires_grad, keep_graph=True)
        return output, context


__all__ = ["MLPLayer"]
