"""`TransformerBlock`: this pipeline stage's transformer layers plus the final layernorm.

Layer placement (`get_num_layers_to_build`, `get_transformer_layer_offset`) supports even splits,
virtual pipeline stages, uneven first/last stages, embedding/loss accounting and explicit layouts.
Full activation recompute wraps whole layers ('uniform': chunks of `recompute_num_layers` layers;
'block': the first `recompute_num_layers` layers of the stage). The block is built plain: FP8 GEMMs,
compiled layers and CUDA graphs are applied afterwards by the optimisation plan
(`megatron.core.optimization_plan`), which `megatron.training.get_model` runs on every model chunk.
"""
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import List, Optional, Union

import torch

from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.optimization_plan.resolve import settings_applied_by_plan
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.recompute import checkpointed_call
from megatron.core.transformer.sharded import sharded_state_dict_default
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    BaseTransformerLayer,
    _layers_per_stage,
    _pp_rank_and_size,
    get_transformer_layer_offset,
)
from megatron.core.utils import make_viewless_tensor

LayerNormImpl = WrappedTorchNorm


def get_num_layers_to_build(config: TransformerConfig, vp_stage: Optional[int] = None, pp_rank=None) -> int:
    """Number of decoder layers on this (pipeline rank, virtual stage)."""
    rank, size = _pp_rank_and_size(pp_rank)
    table = _layers_per_stage(config, size)
    return table[(vp_stage or 0) if len(table) > 1 else 0][rank]


@dataclass
class TransformerBlockSubmodules:
    """Per-layer specs of this stage and the final layernorm spec."""

    layer_specs: List[ModuleSpec] = field(default_factory=list)
    """Spec of every layer on this stage."""

    layer_norm: Optional[Union[ModuleSpec, type]] = None
    """Final norm (built on the last stage)."""



def _get_block_submodules(config, spec, vp_stage=None) -> TransformerBlockSubmodules:
    if isinstance(spec, TransformerBlockSubmodules):
        return spec
    if isinstance(spec, ModuleSpec):
        if isinstance(spec.module, type) and issubclass(spec.module, TransformerBlock):
            return spec.submodules
        if isinstance(spec.module, type) and issubclass(spec.module, BaseTransformerLayer):
            num_layers = get_num_layers_to_build(config, vp_stage)
            return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=LayerNormImpl)
    raise ValueError(f"TransformerBlock spec must be a layer spec, a block spec or TransformerBlockSubmodules, got {spec!r}")


def _plan_not_applied(settings):
    def guard(module, args):
        raise RuntimeError(
            f"TransformerBlock: the config asks for {', '.join(settings)}, which the optimisation plan carries "
            "out, but no plan was applied to this model. After building the model chunks call "
            "apply_optimization_plan(chunks, resolve_plan(config, device_facts_of(chunks))) from "
            "megatron.core.optimization_plan (megatron.training.get_model does).")

    return guard


class TransformerBlock(MegatronModule):
    """The transformer layers of one (virtual) pipeline stage."""

    def __init__(
        self,
        config: TransformerConfig,
        spec: Union[TransformerBlockSubmodules, ModuleSpec],
        post_layer_norm: bool = True,
        pre_process: bool = True,
        post_process: bool = True,
        model_comm_pgs=None,
        vp_stage: Optional[int] = None,
    ):
        super().__init__(config=config)
        self.submodules = _get_block_submodules(config, spec, vp_stage)
        self.post_layer_norm = post_layer_norm
        self.pre_process = pre_process
        self.post_process = post_process
        self.vp_stage = vp_stage
        self.input_tensor = None
        self.layers = torch.nn.ModuleList(
            [
                build_module(layer_spec, config=self._layer_config(i), layer_number=i + 1,
                             model_comm_pgs=model_comm_pgs, vp_stage=vp_stage)
                for i, layer_spec in enumerate(self.submodules.layer_specs)
            ]
        )
        if self.submodules.layer_norm is not None and post_process and post_layer_norm:
            self.final_layernorm = build_module(
                self.submodules.layer_norm, config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon
            )
        else:
            self.final_layernorm = None
        self.num_layers_per_pipeline_rank = len(self.layers)
        # The plan applied to this block (`mark_plan_applied`). Until then a config asking for something only
        # the plan carries out (FP8, CUDA graphs, ...) makes the first forward raise instead of silently
        # running the plain block.
        self.optimization_plan = None
        pending = settings_applied_by_plan(config)
        self._plan_guard = self.register_forward_pre_hook(_plan_not_applied(pending)) if pending else None

    def mark_plan_applied(self, plan) -> None:
        """Record that `optimization_plan.apply` carried out `plan` on this block (lifts the guard)."""
        self.optimization_plan = plan
        if self._plan_guard is not None:
            self._plan_guard.remove()
            self._plan_guard = None

    def _layer_config(self, index: int) -> TransformerConfig:
        """The config of this stage's layer `index`: its own with heterogeneous block specs (each layer may
        differ, `HeterogeneousTransformerConfig.get_config_for_layer`), else the block's."""
        if not self.config.heterogeneous_block_specs:
            return self.config
        return self.config.get_config_for_layer(get_transformer_layer_offset(self.config, self.vp_stage) + index + 1)

    def _get_layer(self, layer_number: int):
        return self.layers[layer_number]

    def set_input_tensor(self, input_tensor: torch.Tensor):
        """The activation received from the previous pipeline stage (used instead of `hidden_states`)."""
        self.input_tensor = input_tensor

    def forward(
        self,
        hidden_states: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor],
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
    ) -> torch.Tensor:
        """[s, b, h] (or the pipeline input tensor) -> [s, b, h]."""
        if not self.pre_process:
            hidden_states = self.input_tensor
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        layer_kwargs = dict(
            attention_mask=attention_mask,
            context=context,
            context_mask=context_mask,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            attention_bias=attention_bias,
            inference_context=inference_context,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
        )
        # Under sequence parallelism each rank holds a different sequence shard, so dropout must differ.
        rng_context = tensor_parallel.get_cuda_rng_tracker().fork() if self.config.sequence_parallel else nullcontext()
        with rng_context:
            for start, end, recompute in self._layer_chunks():
                run = self._run_layers(start, end)
                if recompute:
                    hidden_states, context = checkpointed_call(
                        run, bool(self.config.distribute_saved_activations), hidden_states, **layer_kwargs
                    )
                else:
                    hidden_states, context = run(hidden_states, **layer_kwargs)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
            hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        if not self.pre_process and len(self.layers) == 0 and self.final_layernorm is None:
            hidden_states = hidden_states.clone()
        return hidden_states

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Layers stacked along a leading global axis of size num_layers (`<prefix>layers.<param>`)."""
        if sharded_offsets:
            raise ValueError(f"TransformerBlock.sharded_state_dict got unexpected sharded_offsets {sharded_offsets}")
        non_homogeneous = bool(metadata and metadata.get("non_homogeneous_layers", False))
        # Layers that may differ cannot be stacked along one layer axis: keys carry the global layer index.
        non_homogeneous |= self.config.heterogeneous_block_specs or self.config.hetereogenous_dist_checkpoint
        # A model mixing MoE and dense layers cannot stack them on one layer axis (Megatron's rule).
        freq = self.config.moe_layer_freq
        if self.config.num_moe_experts is not None and (isinstance(freq, list) or freq > 1):
            non_homogeneous = True
        sharded = {}
        layer_prefix = f"{prefix}layers."
        for index, layer in enumerate(self.layers):
            global_index = layer.layer_number - 1
            local_prefix = f"{layer_prefix}{index}."
            if non_homogeneous:
                sharded_prefix, offsets = f"{layer_prefix}{global_index}.", ()
            else:
                sharded_prefix, offsets = layer_prefix, ((0, global_index, self.config.num_layers),)
            layer_sharded = layer.sharded_state_dict(prefix=local_prefix, sharded_offsets=offsets, metadata=metadata)
            replace_prefix_for_sharding(layer_sharded, local_prefix, sharded_prefix)
            sharded.update(layer_sharded)
        for name, module in self.named_children():
            if module is not self.layers:
                sharded.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata))
        return sharded

    def _run_layers(self, start: int, end: int):
        def run(hidden_states, context=None, **kwargs):
            for layer in self.layers[start:end]:
                hidden_states, context = layer(hidden_states, context=context, **kwargs)
            return hidden_states, context

        return run

    def _layer_chunks(self):
        """(start, end, recompute) ranges covering this stage's layers, per the recompute settings."""
        n = len(self.layers)
        config = self.config
        full = config.recompute_granularity == "full" and self.training and torch.is_grad_enabled()
        if not full:
            return [(0, n, False)]
        if config.recompute_method == "uniform":
            step = config.recompute_num_layers
            return [(start, min(start + step, n), True) for start in range(0, n, step)]
        recomputed = min(config.recompute_num_layers, n)
        return [(i, i + 1, i < recomputed) for i in range(n)]


__all__ = ["TransformerBlock", "TransformerBlockSubmodules", "get_num_layers_to_build"]
