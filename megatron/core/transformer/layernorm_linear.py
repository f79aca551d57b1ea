"""`LayerNormColumnParallelLinear`: a norm fused in front of a column-parallel linear.

It mirrors Transformer Engine's `LayerNormLinear` parameter names (`layer_norm_weight`,
`layer_norm_bias`, `weight`, `bias`, in that order), so the Transformer Engine layer spec builds
models whose state dicts carry the same keys as Megatron's default TE models
(`self_attention.linear_qkv.layer_norm_weight`, `mlp.linear_fc1.layer_norm_weight`). The norm runs on
this rank's sequence shard under sequence parallelism; its parameters are marked `sequence_parallel`
so their gradients get summed over the tensor-parallel group.
"""
from typing import Optional

import torch

from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.torch_norm import apply_norm
from megatron.core.transformer.transformer_config import TransformerConfig

_NORM_FIRST = ("layer_norm_weight", "layer_norm_bias", "weight", "bias")


class LayerNormColumnParallelLinear(ColumnParallelLinear):
    """norm(x) @ A^T + b with A split along its output dimension."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        init_method,
        gather_output: bool,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        skip_weight_param_allocation: bool = False,
        tp_comm_buffer_name: Optional[str] = None,
        tp_group=None,
        stride: int = 1,
    ):
        if gather_output:
            raise ValueError("LayerNormColumnParallelLinear does not support gather_output=True.")
        super().__init__(
            input_size,
            output_size,
            config=config,
            init_method=init_method,
            bias=bias,
            gather_output=False,
            stride=stride,
            skip_bias_add=skip_bias_add,
            skip_weight_param_allocation=skip_weight_param_allocation,
            is_expert=is_expert,
            tp_comm_buffer_name=tp_comm_buffer_name,
            tp_group=tp_group,
        )
        self.normalization = config.normalization
        self.eps = config.layernorm_epsilon
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(init(input_size, dtype=config.params_dtype, device=device))
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype, device=device))
        else:
            self.register_parameter("layer_norm_bias", None)
        for param in (self.layer_norm_weight, self.layer_norm_bias):
            if param is not None:
                setattr(param, "sequence_parallel", config.sequence_parallel)
        order = [name for name in _NORM_FIRST if name in self._parameters]
        order += [name for name in self._parameters if name not in order]
        self._parameters = {name: self._parameters[name] for name in order}

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None, runtime_gather_output=None):
        """[s, b, h] (or [s/tp, b, h] with SP) -> ([s, b, out/tp], bias or None)."""
        normed = apply_norm(
            input_, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.zero_centered_gamma
        )
        return super().forward(normed, weight=weight, runtime_gather_output=runtime_gather_output)


__all__ = ["LayerNormColumnParallelLinear"]
