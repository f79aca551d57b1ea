"""MoE routers: `Router` (the gate `x W^T`) and `TopKRouter` (top-k routing with load balancing).

`TopKRouter.forward(x [s, b, h]) -> (probs [s*b, E], routing_map [s*b, E] bool)`. Order (Megatron's):
input jitter, gating in `--moe-router-dtype`, optional random logits (`--moe-router-force-load-balancing`),
z-loss attached to the logits, routing by `moe_router_load_balancing_type` (the balancing loss attached to
the probabilities), then the expert-bias token count. Auxiliary losses are computed only in training with
autograd on, so a recomputed forward computes them once (in the recompute pass).

The gate weight [E, H] is created in fp32 on the CPU and initialised there with the default generator
(as Megatron does, whatever the device), then cast to params_dtype and moved to the model's device.
"""
from abc import ABC, abstractmethod
from functools import partial
from typing import Callable, Optional

import torch

from megatron.core.fusions._compile import CudaCompiled
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import (
    ModelCommProcessGroups,
    MoEAuxLossAutoScaler,
    apply_random_logits,
    get_default_model_comm_pgs,
    group_size,
    router_gating_linear,
    save_to_aux_losses_tracker,
    sequence_load_balancing_loss_func,
    sinkhorn,
    switch_load_balancing_loss_func,
    topk_softmax_with_capacity,
    z_loss_func,
)
from megatron.core.transformer.transformer_config import TransformerConfig

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def _softmax_topk_with_switch_loss(logits: torch.Tensor, topk: int, use_pre_softmax: bool,
                                   scaling_factor: Optional[float], moe_aux_loss_coeff: float):
    """Softmax top-k routing of logits [T, E] (no capacity, groups or bias) and the Switch loss of the same
    logits, the exact operations of `topk_softmax_with_capacity` + `compute_routing_scores_for_aux_loss` +
    `switch_load_balancing_loss_func`; returns (probs [T, E], routing_map [T, E] bool, aux_loss [])."""
    probs, routing_map, _ = topk_softmax_with_capacity(logits, topk, use_pre_softmax=use_pre_softmax,
                                                       scaling_factor=scaling_factor)
    scores, loss_map = _scores_for_aux_loss(logits, topk, "softmax")
    aux_loss = switch_load_balancing_loss_func(scores, loss_map.sum(dim=0), topk, moe_aux_loss_coeff)
    return probs, routing_map, aux_loss


def _scores_for_aux_loss(logits: torch.Tensor, topk: int, score_function: str):
    """(scores [T, E], top-k map [T, E]) the balancing losses use: softmax, or sigmoid normalised per token;
    plain top-k (no groups, bias or capacity)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"moe_router_score_function ({score_function!r}) must be 'softmax' or 'sigmoid'.")
    _, top_indices = torch.topk(scores, k=topk, dim=1)
    return scores, torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()


# one compiled region each way on CUDA (the MoE layer itself runs eagerly: ~25 small kernels become a few)
_softmax_topk_with_switch_loss_fused = CudaCompiled(_softmax_topk_with_switch_loss)


def _model_device(config) -> torch.device:
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class Router(ABC, MegatronModule):
    """Base router: the gate weight [E, H] and `gating(x) = x W^T` in the router dtype."""

    def __init__(self, config: TransformerConfig, model_comm_pgs: Optional[ModelCommProcessGroups] = None) -> None:
        super().__init__(config)
        if model_comm_pgs is None:
            model_comm_pgs = get_default_model_comm_pgs()
        self.config = config
        self.num_experts = config.num_moe_experts
        self.moe_aux_loss_func = None
        self.layer_number = None
        self.tp_group = model_comm_pgs.tp
        self.cp_group = model_comm_pgs.cp
        self.tp_cp_group = model_comm_pgs.tp_cp
        self.weight = torch.nn.Parameter(torch.empty((config.num_moe_experts, config.hidden_size), dtype=torch.float32))
        # A per-token loss is divided by the global token count in finalize_model_grads: the auxiliary
        # losses are multiplied by the local token count to keep their intended scale.
        self.calculate_per_token_loss = config.calculate_per_token_loss
        self.reset_parameters()

    def reset_parameters(self):
        """Initialise the gate (CPU default generator), cast it to params_dtype, move it to the model device."""
        if self.config.perform_initialization:
            self.config.init_method(self.weight)
        self.weight.data = self.weight.data.to(dtype=self.config.params_dtype, device=_model_device(self.config))
        setattr(self.weight, "sequence_parallel", self.config.sequence_parallel)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """[s, b, h] -> logits [s, b, E] in `--moe-router-dtype` (the input's dtype when unset)."""
        router_dtype = _ROUTER_DTYPES.get(self.config.moe_router_dtype, input.dtype)
        return router_gating_linear(input, self.weight, router_dtype)

    @abstractmethod
    def routing(self, logits: torch.Tensor):
        """(probs [T, E], routing_map [T, E]) from the logits."""

    @abstractmethod
    def forward(self, input: torch.Tensor):
        """(probs, routing_map) of the input tokens."""

    def set_layer_number(self, layer_number: int):
        """The 1-based global layer number (index of this layer's auxiliary losses in the tracker)."""
        self.layer_number = layer_number


class TopKRouter(Router):
    """Route each token to its top-k experts (softmax or sigmoid scores, optional groups, bias, capacity)."""

    def __init__(self, config: TransformerConfig, model_comm_pgs: Optional[ModelCommProcessGroups] = None) -> None:
        super().__init__(config=config, model_comm_pgs=model_comm_pgs)
        self.topk = config.moe_router_topk
        self.routing_type = config.moe_router_load_balancing_type
        self.score_function = config.moe_router_score_function
        self.input_jitter = None
        self.enable_expert_bias = config.moe_router_enable_expert_bias
        if self.enable_expert_bias:
            device = _model_device(config)
            self.register_buffer("local_tokens_per_expert",
                                 torch.zeros(config.num_moe_experts, dtype=torch.float32, device=device),
                                 persistent=False)
            self.register_buffer("expert_bias", torch.zeros(config.num_moe_experts, dtype=torch.float32, device=device))
        else:
            self.local_tokens_per_expert = None
            self.expert_bias = None

    def _maintain_float32_expert_bias(self):
        """Keep the expert bias in fp32 (Float16Module casts buffers to bf16/fp16)."""
        if getattr(self, "expert_bias", None) is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias.data = self.expert_bias.data.to(torch.float32)

    def sinkhorn_load_balancing(self, logits: torch.Tensor):
        """Sinkhorn routing: experts chosen on the Sinkhorn-normalised logits (in training), probabilities are
        sigmoid (k = 1) or softmax over all experts, not renormalised over the chosen ones."""
        if self.config.moe_aux_loss_coeff != 0:
            raise ValueError(f"moe_router_load_balancing_type='sinkhorn' needs moe_aux_loss_coeff = 0 (got "
                             f"{self.config.moe_aux_loss_coeff}): Sinkhorn routing has no auxiliary loss.")

        def activation(values):
            if self.topk == 1:
                return torch.sigmoid(values)
            return torch.softmax(values, dim=-1, dtype=torch.float32).type_as(values)

        if self.training:
            with torch.no_grad():
                norm_logits = sinkhorn(logits.to(dtype=torch.float32))
                _, indices = torch.topk(norm_logits, k=self.topk, dim=1)
            logits = activation(logits)
        else:
            logits = activation(logits)
            _, indices = torch.topk(logits, k=self.topk, dim=1)
        routing_map = torch.zeros_like(logits).int().scatter(1, indices, 1).bool()
        return logits * routing_map, routing_map

    def compute_routing_scores_for_aux_loss(self, logits: torch.Tensor):
        """(scores [T, E], top-k map [T, E]) the balancing losses use: softmax, or sigmoid normalised per token;
        plain top-k (no groups, bias or capacity)."""
        return _scores_for_aux_loss(logits, self.topk, self.score_function)

    def _topk(self, logits: torch.Tensor):
        config = self.config
        return topk_softmax_with_capacity(
            logits,
            self.topk,
            capacity_factor=config.moe_expert_capacity_factor,
            pad_to_capacity=config.moe_pad_expert_input_to_capacity,
            drop_policy=config.moe_token_drop_policy,
            use_pre_softmax=config.moe_router_pre_softmax,
            num_groups=config.moe_router_num_groups,
            group_topk=config.moe_router_group_topk,
            scaling_factor=config.moe_router_topk_scaling_factor,
            deterministic_mode=config.deterministic_mode,
            score_function=self.score_function,
            expert_bias=self.expert_bias,
        )

    def _fused_aux_loss_routing(self, logits: torch.Tensor):
        """(probs with the Switch loss attached, routing_map) from one fused function in the plain case
        (softmax scores, no capacity, groups, expert bias or sequence split; a non-zero coefficient), else None."""
        config = self.config
        if (self.score_function != "softmax" or config.moe_expert_capacity_factor is not None
                or config.moe_router_group_topk or self.expert_bias is not None or config.moe_aux_loss_coeff == 0
                or self._sequence_partition_group() is not None):
            return None
        probs, routing_map, aux_loss = _softmax_topk_with_switch_loss_fused(
            logits, self.topk, config.moe_router_pre_softmax, config.moe_router_topk_scaling_factor,
            config.moe_aux_loss_coeff)
        return self._attach_load_balancing_loss(probs, aux_loss, None), routing_map

    def aux_loss_load_balancing(self, logits: torch.Tensor):
        """Top-k routing with the GShard/Switch auxiliary loss attached to the probabilities."""
        if self.training and torch.is_grad_enabled():
            fused = self._fused_aux_loss_routing(logits)
            if fused is not None:
                return fused
        probs, routing_map, _ = self._topk(logits)
        if self.training and torch.is_grad_enabled():
            scores, loss_routing_map = self.compute_routing_scores_for_aux_loss(logits)
            aux_loss_func = partial(switch_load_balancing_loss_func, probs=scores,
                                    tokens_per_expert=loss_routing_map.sum(dim=0), topk=self.topk)
            probs = self.apply_load_balancing_loss(activation=probs, load_balancing_loss_func=aux_loss_func)
        return probs, routing_map

    def seq_aux_loss_load_balancing(self, logits: torch.Tensor, bsz: int, seq_length: int):
        """Top-k routing with the sequence-level auxiliary loss attached to the probabilities."""
        probs, routing_map, _ = self._topk(logits)
        if self.training and torch.is_grad_enabled():
            scores, loss_routing_map = self.compute_routing_scores_for_aux_loss(logits)
            aux_loss_func = partial(sequence_load_balancing_loss_func, probs=scores, routing_map=loss_routing_map,
                                    batch_size=bsz, seq_length=seq_length, topk=self.topk)
            probs = self.apply_load_balancing_loss(activation=probs, load_balancing_loss_func=aux_loss_func)
        return probs, routing_map

    def _sequence_partition_group(self):
        return self.tp_cp_group if group_size(self.tp_cp_group) > 1 else None

    def _num_tracked_layers(self) -> int:
        return self.config.num_layers + (self.config.mtp_num_layers or 0)

    def apply_load_balancing_loss(self, activation: torch.Tensor, load_balancing_loss_func: Callable):
        """Compute the balancing loss, record `loss / coeff` for logging, attach it to `activation`."""
        moe_aux_loss_coeff = self.config.moe_aux_loss_coeff
        if moe_aux_loss_coeff == 0:
            return activation
        sequence_partition_group = self._sequence_partition_group()
        aux_loss = load_balancing_loss_func(moe_aux_loss_coeff=moe_aux_loss_coeff,
                                            sequence_partition_group=sequence_partition_group)
        return self._attach_load_balancing_loss(activation, aux_loss, sequence_partition_group)

    def _attach_load_balancing_loss(self, activation: torch.Tensor, aux_loss: torch.Tensor, sequence_partition_group):
        """Record `aux_loss / coeff` for logging and attach aux_loss (times the local token count with a
        per-token loss) to `activation`'s backward."""
        moe_aux_loss_coeff = self.config.moe_aux_loss_coeff
        save_to_aux_losses_tracker("load_balancing_loss", aux_loss / moe_aux_loss_coeff, self.layer_number,
                                   self._num_tracked_layers(), reduce_group=sequence_partition_group)
        if self.calculate_per_token_loss:
            return MoEAuxLossAutoScaler.apply(activation, aux_loss * activation.shape[0])
        return MoEAuxLossAutoScaler.apply(activation, aux_loss)

    def apply_z_loss(self, logits):
        """Attach the z-loss (`moe_z_loss_coeff / |TP x CP|` per rank) to the logits and record it."""
        if self.config.moe_z_loss_coeff is None or not (self.training and torch.is_grad_enabled()):
            return logits
        moe_z_loss_coeff = self.config.moe_z_loss_coeff / group_size(self.tp_cp_group)
        z_loss = z_loss_func(logits, moe_z_loss_coeff)
        scaled = z_loss * logits.shape[0] if self.calculate_per_token_loss else z_loss
        logits = MoEAuxLossAutoScaler.apply(logits, scaled)
        save_to_aux_losses_tracker("z_loss", z_loss / moe_z_loss_coeff, self.layer_number, self._num_tracked_layers())
        return logits

    def apply_input_jitter(self, input: torch.Tensor):
        """Multiply the input by U(1 - eps, 1 + eps) noise (`--moe-input-jitter-eps`; train and eval)."""
        if self.config.moe_input_jitter_eps is None:
            return input
        eps = self.config.moe_input_jitter_eps
        if self.input_jitter is None:
            self.input_jitter = torch.distributions.uniform.Uniform(
                torch.tensor(1.0 - eps, device=input.device), torch.tensor(1.0 + eps, device=input.device)
            ).rsample
        return input * self.input_jitter(input.shape)

    def routing(self, logits: torch.Tensor):
        """logits [s, b, E] -> (probs [s*b, E], routing_map [s*b, E])."""
        seq_length, bsz = logits.shape[:2]
        # [s, b, E] -> [s*b, E]
        logits = logits.view(-1, self.config.num_moe_experts)
        logits = self.apply_z_loss(logits)
        if self.routing_type == "sinkhorn":
            scores, routing_map = self.sinkhorn_load_balancing(logits)
        elif self.routing_type == "aux_loss":
            scores, routing_map = self.aux_loss_load_balancing(logits)
        elif self.routing_type == "seq_aux_loss":
            scores, routing_map = self.seq_aux_loss_load_balancing(logits, bsz, seq_length)
        elif self.routing_type == "none":
            scores, routing_map, _ = self._topk(logits)
        else:
            raise ValueError(f"moe_router_load_balancing_type ({self.routing_type!r}) must be 'aux_loss', "
                             "'seq_aux_loss', 'sinkhorn' or 'none'.")
        # Counted once per optimizer step's forwards: not in evaluation, not in a no-grad recompute pass.
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0)
        return scores, routing_map

    def forward(self, input: torch.Tensor):
        """x [s, b, h] -> (probs [s*b, E], routing_map [s*b, E] bool)."""
        self._maintain_float32_expert_bias()
        input = self.apply_input_jitter(input)
        logits = self.gating(input)
        if self.config.moe_router_force_load_balancing:
            logits = apply_random_logits(logits)
        return self.routing(logits)

    def _load_from_state_dict(self, *args, **kwargs):
        """Load into an fp32 expert bias."""
        self._maintain_float32_expert_bias()
        return super()._load_from_state_dict(*args, **kwargs)

    def _save_to_state_dict(self, *args, **kwargs):
        """Save the expert bias in fp32."""
        self._maintain_float32_expert_bias()
        return super()._save_to_state_dict(*args, **kwargs)


__all__ = ["Router", "TopKRouter"]
