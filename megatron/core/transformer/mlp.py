"""`MLP`: fc1 -> activation -> fc2, with gated variants (SwiGLU, GeGLU) through one fused fc1.

For a gated unit the local fc1 shard is [gate_shard; up_shard] (Megatron's per-rank layout). fc1 is
built with stride=2 so that, with use_cpu_initialization, the full master weight is [gate; up] and
every rank takes its slice of each half: the TP model then equals the single-process model.
"""
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.sharded import apply_swiglu_sharded_factory, sharded_state_dict_default
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class MLPSubmodules:
    """Specs of the two projections of an MLP."""

    linear_fc1: Union[ModuleSpec, type] = None
    """First projection h -> ffn (x2 when gated), column-parallel."""

    linear_fc2: Union[ModuleSpec, type] = None
    """Second projection ffn -> h, row-parallel."""



class MLP(MegatronModule):
    """h -> ffn (x2 when gated) -> activation -> h, column- then row-parallel."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        is_expert: bool = False,
        input_size: Optional[int] = None,
        ffn_hidden_size: Optional[int] = None,
        tp_group=None,
    ):
        super().__init__(config=config)
        self.input_size = input_size if input_size is not None else config.hidden_size
        ffn_hidden_size = config.ffn_hidden_size if ffn_hidden_size is None else ffn_hidden_size
        fc1_output_size = ffn_hidden_size * 2 if config.gated_linear_unit else ffn_hidden_size
        fc1_kwargs = {"stride": 2} if config.gated_linear_unit else {}
        self.linear_fc1 = build_module(
            submodules.linear_fc1,
            self.input_size,
            fc1_output_size,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=config.add_bias_linear,
            skip_bias_add=True,
            is_expert=is_expert,
            tp_comm_buffer_name="fc1",
            tp_group=tp_group,
            **fc1_kwargs,
        )
        self.activation_func = config.activation_func
        self.linear_fc2 = build_module(
            submodules.linear_fc2,
            ffn_hidden_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=is_expert,
            tp_comm_buffer_name="fc2",
            tp_group=tp_group,
        )

    def forward(self, hidden_states: torch.Tensor, per_token_scale: Optional[torch.Tensor] = None):
        """[s, b, h] -> (output [s, b, h], fc2 bias or None)."""
        intermediate, bias = self.linear_fc1(hidden_states)
        intermediate = self.activation(intermediate, bias)
        if per_token_scale is not None:
            # MoE experts: the routing probability (possibly fp32) weights each row; the product is cast back
            intermediate = (intermediate * per_token_scale.unsqueeze(-1)).to(intermediate.dtype)
        return self.linear_fc2(intermediate)

    def activation(self, intermediate: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """Bias add and (gated) activation, fused when `bias_activation_fusion` allows it."""
        config = self.config
        if config.bias_activation_fusion:
            if self.activation_func is F.gelu and not config.gated_linear_unit and bias is not None:
                return bias_gelu_impl(intermediate, bias)
            if self.activation_func is F.silu and config.gated_linear_unit:
                return bias_swiglu_impl(intermediate, bias, config.activation_func_fp8_input_store)
        if bias is not None:
            intermediate = intermediate + bias
        if config.gated_linear_unit:
            gate, up = torch.chunk(intermediate, 2, dim=-1)
            return self.activation_func(gate) * up
        return self.activation_func(intermediate)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """fc1 of a gated unit is saved as the global [all gate; all up] (Megatron's torch_dist layout)."""
        sharded = {}
        for name, module in self.named_children():
            sub = sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata)
            if self.config.gated_linear_unit and name == "linear_fc1":
                for key in (f"{prefix}{name}.weight", f"{prefix}{name}.bias"):
                    if key in sub:
                        sub[key] = apply_swiglu_sharded_factory(sub[key], sharded_offsets)
            sharded.update(sub)
        return sharded


__all__ = ["MLP", "MLPSubmodules"]
