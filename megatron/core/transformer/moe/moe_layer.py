"""`MoELayer`: router -> token dispatcher -> local experts -> combine (+ shared experts).

    probs, routing_map = router(x)              # [T, E] each
    rows, probs = dispatch(x, routing_map, probs) # to the ranks holding the experts
    y = combine(experts(rows, probs))             # back to [s/TP, b, h]
    y = y + shared_experts(x)                     # when configured

Returns `(y, None)`; the transformer layer's bias-dropout-add adds the residual. `--recompute-granularity
selective --recompute-modules moe` recomputes the whole layer in backward (`shared_experts` recomputes only
the shared experts); the recompute wraps the module from outside, the forward itself is only the steps.

Compilation note: the layer runs eagerly even inside a compiled transformer layer (`torch.compiler.disable`
on its forward): its shapes depend on the routing and its dispatch reads split sizes on the host, which
would make a compiled graph break and recompile on every new routing.
"""
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import ModelCommProcessGroups, get_default_model_comm_pgs, group_rank, group_size
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
    MoEFlexTokenDispatcher,
    MoETokenDispatcher,
)
from megatron.core.transformer.recompute import checkpoint_forward
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

_DISPATCHERS = {
    "allgather": MoEAllGatherTokenDispatcher,
    "alltoall": MoEAlltoAllTokenDispatcher,
    "flex": MoEFlexTokenDispatcher,
}


@dataclass
class MoESubmodules:
    """Specs of an MoE layer's experts and shared experts."""

    experts: Union[ModuleSpec, type] = None
    """The local experts (GroupedMLP, SequentialMLP, ...)."""

    shared_experts: Union[ModuleSpec, type] = None
    """The shared experts (SharedExpertMLP), built only with moe_shared_expert_intermediate_size."""


class BaseMoELayer(MegatronModule, ABC):
    """Local expert bookkeeping: L = E / EP experts per rank, global indices ep_rank * L ... ep_rank * L + L - 1."""

    def __init__(self, config: TransformerConfig, layer_number: Optional[int] = None,
                 model_comm_pgs: Optional[ModelCommProcessGroups] = None):
        super().__init__(config)
        self.config = config
        self.layer_number = layer_number
        self.ep_group = model_comm_pgs.ep
        self.attn_tp_group = model_comm_pgs.tp
        ep_size, ep_rank = group_size(self.ep_group), group_rank(self.ep_group)
        if config.num_moe_experts % ep_size != 0:
            raise ValueError(f"num_moe_experts ({config.num_moe_experts}) must be divisible by the expert parallel "
                             f"size ({ep_size}).")
        self.num_local_experts = config.num_moe_experts // ep_size
        offset = ep_rank * self.num_local_experts
        self.use_shared_expert = config.moe_shared_expert_intermediate_size is not None
        self.shared_expert_overlap = config.moe_shared_expert_overlap
        self.local_expert_indices = [offset + i for i in range(self.num_local_experts)]
        self.router: Optional[TopKRouter] = None
        self.experts = None
        self.shared_experts = None
        self.token_dispatcher: Optional[MoETokenDispatcher] = None

    @abstractmethod
    def forward(self, hidden_states):
        """The layer's forward."""

    def set_layer_number(self, layer_number: int):
        """The 1-based global layer number (the router records its auxiliary losses under it)."""
        self.layer_number = layer_number
        self.router.set_layer_number(layer_number)


class MoELayer(BaseMoELayer):
    """Mixture-of-experts layer: top-k router, a token dispatcher (allgather / alltoall / flex), the local
    experts and optional shared experts."""

    def __init__(self, config: TransformerConfig, submodules: Optional[MoESubmodules] = None,
                 layer_number: Optional[int] = None, model_comm_pgs: Optional[ModelCommProcessGroups] = None):
        self.submodules = submodules
        if model_comm_pgs is None:
            model_comm_pgs = get_default_model_comm_pgs()
        super().__init__(config=config, layer_number=layer_number, model_comm_pgs=model_comm_pgs)
        self.moe_layer_recompute = config.recompute_granularity == "selective" and "moe" in config.recompute_modules
        self.router = TopKRouter(config=config, model_comm_pgs=model_comm_pgs)
        dispatcher = _DISPATCHERS.get(config.moe_token_dispatcher_type)
        if dispatcher is None:
            raise ValueError(f"moe_token_dispatcher_type ({config.moe_token_dispatcher_type!r}) must be one of "
                             f"{sorted(_DISPATCHERS)}.")
        self.token_dispatcher = dispatcher(self.num_local_experts, self.local_expert_indices, config=config,
                                           model_comm_pgs=model_comm_pgs)
        self.experts = build_module(submodules.experts, self.num_local_experts, config, model_comm_pgs=model_comm_pgs)
        if self.use_shared_expert:
            self.shared_experts = build_module(submodules.shared_experts, config=config, model_comm_pgs=model_comm_pgs)
            if self.shared_expert_overlap:
                self.token_dispatcher.set_shared_experts(self.shared_experts)
            elif config.recompute_granularity == "selective" and "shared_experts" in config.recompute_modules:
                checkpoint_forward(self.shared_experts)
        if self.moe_layer_recompute:
            checkpoint_forward(self)
            self.forward = torch.compiler.disable(self.forward)

    def router_and_preprocess(self, hidden_states: torch.Tensor):
        """Route, then prepare the dispatch; returns (tokens, probs, residual = the layer input)."""
        residual = hidden_states
        probs, routing_map = self.router(hidden_states)
        hidden_states, probs = self.token_dispatcher.dispatch_preprocess(hidden_states, routing_map, probs)
        return hidden_states, probs, residual

    def dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Send the tokens and their probabilities to the ranks holding their experts."""
        return self.token_dispatcher.token_dispatch(hidden_states, probs)

    def experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor, residual: torch.Tensor):
        """Shared experts on the layer input (when not overlapped), the local experts on the dispatched rows;
        returns (expert output prepared for the combine, shared-expert output or None, None)."""
        shared_expert_output = None
        if self.use_shared_expert and not self.shared_expert_overlap:
            shared_expert_output = self.shared_experts(residual)
        dispatched_input, tokens_per_expert, permuted_probs = self.token_dispatcher.dispatch_postprocess(
            hidden_states, probs)
        expert_output, mlp_bias = self.experts(dispatched_input, tokens_per_expert, permuted_probs)
        if mlp_bias is not None:
            raise ValueError("MoE experts must not return a bias: use --disable-bias-linear.")
        return self.token_dispatcher.combine_preprocess(expert_output), shared_expert_output, mlp_bias

    def combine(self, output: torch.Tensor, shared_expert_output: Optional[torch.Tensor]):
        """Bring the expert outputs back to their tokens and add the shared experts' output."""
        output = self.token_dispatcher.token_combine(output)
        output = self.token_dispatcher.combine_postprocess(output)
        if shared_expert_output is not None:
            output = output + shared_expert_output
        return output

    @torch.compiler.disable
    def forward(self, hidden_states: torch.Tensor):
        """[s/TP, b, h] -> ([s/TP, b, h], None)."""
        if self.training and group_size(self.attn_tp_group) > 1 and not self.config.sequence_parallel:
            raise ValueError("MoE layers with tensor parallelism need --sequence-parallel in training (each TP "
                             "rank would otherwise route the same tokens).")
        hidden_states, probs, residual = self.router_and_preprocess(hidden_states)
        dispatched_input, probs = self.dispatch(hidden_states, probs)
        output, shared_expert_output, mlp_bias = self.experts_compute(dispatched_input, probs, residual)
        return self.combine(output, shared_expert_output), mlp_bias


__all__ = ["BaseMoELayer", "MoELayer", "MoESubmodules"]
