"""Linear layers that replace a whole attention or MLP block (`replace_with_linear` in a heterogeneous config).

A replacement is one h -> h column-parallel linear whose output is gathered back to the layer's activation
layout, so the bias-dropout-add and residual that follow see the same `[s, b, h]` (or, with sequence
parallelism, `[s/tp, b, h]`) as after a real block. Megatron's names and parameter layout:
`ColumnParallelLinearGathered` (local spec: weight, bias; its norm is the layer's separate input norm) and,
in Transformer Engine's layout with the norm fused in front, `LayerNormColumnParallelLinearGathered`
(layer_norm_weight, [layer_norm_bias,] weight, bias), built where Megatron builds
`TELayerNormColumnParallelLinearGathered`.

With sequence parallelism Megatron pads this rank's `[s, b, h/tp]` output to `[s, b, h]` with zeros and
reduce-scatters it along the sequence; here the output is all-gathered along the hidden dim and this rank's
sequence slice kept: the same values (adding zeros is exact) for half the traffic.
"""
from typing import Optional

import torch

from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.layernorm_linear import LayerNormColumnParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import get_model_comm_pgs_tp


def _replacement_linear_kwargs(config: TransformerConfig, tp_comm_buffer_name, tp_group, model_comm_pgs):
    return dict(
        config=config, init_method=config.init_method, gather_output=False, bias=config.add_bias_linear,
        skip_bias_add=False, is_expert=False, tp_comm_buffer_name=tp_comm_buffer_name,
        tp_group=tp_group if tp_group is not None else get_model_comm_pgs_tp(model_comm_pgs),
    )


class _GatherToActivationLayout:
    """Mixin: turn the column-parallel output `[s, b, h/tp]` back into the layer's activation layout."""

    def _gathered(self, output: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return output
        # [s, b, h/tp] -> [s, b, h]
        output = gather_from_tensor_model_parallel_region(output, group=self.tp_group)
        if self.config.sequence_parallel:
            # [s, b, h] -> [s/tp, b, h]
            output = scatter_to_sequence_parallel_region(output, group=self.tp_group)
        return output

    def _check_not_gathering(self, runtime_gather_output) -> None:
        if runtime_gather_output or self.gather_output:
            raise ValueError("gathering TP outputs is not supported for a linear replacement of a block")


class ColumnParallelLinearGathered(_GatherToActivationLayout, ColumnParallelLinear):
    """A block replaced by one h -> h column-parallel linear (local spec), output in the activation layout."""

    def __init__(self, config: TransformerConfig, *args, tp_comm_buffer_name: Optional[str] = None, tp_group=None,
                 model_comm_pgs=None, **kwargs):
        super().__init__(config.hidden_size, config.hidden_size,
                         **_replacement_linear_kwargs(config, tp_comm_buffer_name, tp_group, model_comm_pgs))

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None, runtime_gather_output=None,
                **kwargs):
        """[s, b, h] (or [s/tp, b, h] with SP) -> (same layout, None); attention keyword arguments are ignored."""
        self._check_not_gathering(runtime_gather_output)
        output, bias = super().forward(input_, weight, runtime_gather_output)
        return self._gathered(output), bias


class LayerNormColumnParallelLinearGathered(_GatherToActivationLayout, LayerNormColumnParallelLinear):
    """A block replaced by norm + one h -> h column-parallel linear (Transformer Engine's layout)."""

    def __init__(self, config: TransformerConfig, *args, tp_comm_buffer_name: Optional[str] = None, tp_group=None,
                 model_comm_pgs=None, **kwargs):
        super().__init__(config.hidden_size, config.hidden_size,
                         **_replacement_linear_kwargs(config, tp_comm_buffer_name, tp_group, model_comm_pgs))

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None, runtime_gather_output=None,
                **kwargs):
        """[s, b, h] (or [s/tp, b, h] with SP) -> (same layout, None); attention keyword arguments are ignored."""
        self._check_not_gathering(runtime_gather_output)
        output, bias = super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        return self._gathered(output), bias


__all__ = ["ColumnParallelLinearGathered", "LayerNormColumnParallelLinearGathered"]
