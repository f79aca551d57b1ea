"""`MambaStack`: the decoder of hybrid models, a sequence of Mamba (`M`), attention (`*`) and MLP (`-`) layers.

The layer types come from `allocate_layers` (ratios or an override pattern). Each pipeline stage builds a
contiguous slice of `num_layers // PP` layers; the last stage adds the final norm (`final_norm`). Distributed
checkpoint keys carry the global layer index (`decoder.layers.<g>.`): the layers differ, so they are not stacked.
"""
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.ssm.mamba_hybrid_layer_allocation import Symbols, allocate_layers
from megatron.core.ssm.mamba_layer import MambaLayer
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.recompute import checkpointed_call
from megatron.core.transformer.sharded import sharded_state_dict_default
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import make_viewless_tensor


@dataclass
class MambaStackSubmodules:
    """Specs of the three layer kinds of a hybrid stack."""

    mamba_layer: Union[ModuleSpec, type] = IdentityOp
    """Spec of a Mamba layer (`M`)."""

    attention_layer: Union[ModuleSpec, type] = IdentityOp
    """Spec of an attention-only transformer layer (`*`)."""

    mlp_layer: Union[ModuleSpec, type] = IdentityOp
    """Spec of an MLP-only layer (`-`)."""


def stage_layer_range(num_layers: int, pp_size: int, pp_rank: int):
    """(first, end) global layer indices of a pipeline stage: contiguous, `num_layers // pp_size` each."""
    if num_layers % pp_size:
        raise ValueError(f"--num-layers ({num_layers}) must be divisible by --pipeline-model-parallel-size "
                         f"({pp_size}) for Mamba / hybrid models.")
    per_stage = num_layers // pp_size
    return pp_rank * per_stage, (pp_rank + 1) * per_stage


class MambaStack(MegatronModule):
    """The hybrid layers of one pipeline stage and, on the last stage, the final norm."""

    def __init__(self, config: TransformerConfig, submodules: MambaStackSubmodules, residual_in_fp32: bool = False,
                 pre_process: bool = True, hybrid_attention_ratio: float = 0.0, hybrid_mlp_ratio: float = 0.0,
                 hybrid_override_pattern: Optional[str] = None, post_layer_norm: bool = True,
                 post_process: bool = True, device=None, dtype=None, model_comm_pgs=None):
        super().__init__(config)
        self.pre_process, self.post_process, self.post_layer_norm = pre_process, post_process, post_layer_norm
        self.residual_in_fp32 = residual_in_fp32
        self.input_tensor = None
        self.layer_type_list = allocate_layers(config.num_layers, hybrid_attention_ratio, hybrid_mlp_ratio,
                                               hybrid_override_pattern)
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank() if pp_size > 1 else 0
        first, end = stage_layer_range(config.num_layers, pp_size, pp_rank)
        self.pp_layer_offset = first
        layers = []
        for i, symbol in enumerate(self.layer_type_list[first:end]):
            if symbol == Symbols.MAMBA:
                layer = build_module(submodules.mamba_layer, config=config, residual_in_fp32=residual_in_fp32,
                                     layer_number=i + 1 + first, model_comm_pgs=model_comm_pgs)
            else:
                spec = submodules.attention_layer if symbol == Symbols.ATTENTION else submodules.mlp_layer
                # TransformerLayer adds this stage's offset itself.
                layer = build_module(spec, config=config, layer_number=i + 1, model_comm_pgs=model_comm_pgs)
            layers.append(layer)
        self.layers = torch.nn.ModuleList(layers)
        if post_process and post_layer_norm:
            self.final_norm = WrappedTorchNorm(config=config, hidden_size=config.hidden_size,
                                               eps=config.layernorm_epsilon)

    def set_input_tensor(self, input_tensor: torch.Tensor):
        """The activation received from the previous pipeline stage (used instead of `hidden_states`)."""
        self.input_tensor = input_tensor

    def _run_layers(self, start: int, end: int):
        def run(hidden_states, attention_mask=None, inference_context=None, rotary_pos_emb=None):
            for layer in self.layers[start:end]:
                if isinstance(layer, MambaLayer):
                    hidden_states = layer(hidden_states, attention_mask=attention_mask,
                                          inference_context=inference_context)
                else:
                    hidden_states, _ = layer(hidden_states, attention_mask=attention_mask,
                                             inference_context=inference_context, rotary_pos_emb=rotary_pos_emb)
            return hidden_states

        return run

    def _layer_chunks(self):
        """(start, end, recompute) ranges of this stage's layers per the full-recompute settings."""
        n, config = len(self.layers), self.config
        if not (config.recompute_granularity == "full" and self.training and torch.is_grad_enabled()):
            return [(0, n, False)]
        if config.recompute_method == "uniform":
            step = config.recompute_num_layers
            return [(start, min(start + step, n), True) for start in range(0, n, step)]
        return [(i, i + 1, i < min(config.recompute_num_layers, n)) for i in range(n)]

    def forward(self, hidden_states: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor] = None,
                inference_context=None, rotary_pos_emb: Optional[torch.Tensor] = None, *, inference_params=None,
                **kwargs) -> torch.Tensor:
        """[s, b, h] (or the pipeline input tensor) -> [s, b, h]."""
        inference_context = inference_context if inference_context is not None else inference_params
        if not self.pre_process:
            hidden_states = self.input_tensor
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if self.config.sequence_parallel else nullcontext()
        with rng:
            for start, end, recompute in self._layer_chunks():
                run = self._run_layers(start, end)
                if recompute:
                    hidden_states = checkpointed_call(run, bool(self.config.distribute_saved_activations),
                                                      hidden_states, attention_mask=attention_mask,
                                                      rotary_pos_emb=rotary_pos_emb)
                else:
                    hidden_states = run(hidden_states, attention_mask, inference_context, rotary_pos_emb)
        if self.post_process and self.post_layer_norm:
            hidden_states = self.final_norm(hidden_states)
        return make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Layers under their global index (`<prefix>layers.<g>.`), then the final norm."""
        sharded = {}
        for index, layer in enumerate(self.layers):
            local_prefix = f"{prefix}layers.{index}."
            layer_sharded = sharded_state_dict_default(layer, local_prefix, (), metadata)
            replace_prefix_for_sharding(layer_sharded, local_prefix, f"{prefix}layers.{self.pp_layer_offset + index}.")
            sharded.update(layer_sharded)
        for name, module in self.named_children():
            if module is not self.layers:
                sharded.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata))
        return sharded


__all__ = ["MambaStack", "MambaStackSubmodules", "stage_layer_range"]
