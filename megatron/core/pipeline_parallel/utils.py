"""Small helpers of the pipeline schedules: stage predicates and the auxiliary-loss scale hooks.

Auxiliary losses (MoE load balancing, multi-token prediction) run their backward through an
autograd trick and need the same scale the schedule applies to the main loss. Megatron's schedule
imports those classes from `megatron.core.transformer`; here the dependency points the other way
(pipeline_parallel must not import transformer): the owner registers a setter once with
`register_aux_loss_scale_setter(fn)` and the schedule calls `fn(config, scale)` after every forward.
"""
from typing import Callable, List, Optional

import torch

_AUX_LOSS_SCALE_SETTERS: List[Callable] = []


def register_aux_loss_scale_setter(setter: Callable) -> None:
    """Register `setter(config, scale_tensor)`; called after each microbatch's forward step."""
    if setter not in _AUX_LOSS_SCALE_SETTERS:
        _AUX_LOSS_SCALE_SETTERS.append(setter)


def set_aux_loss_scales(config, device: torch.device, num_microbatches: int) -> None:
    """Tell every registered auxiliary loss the scale of this step's main loss."""
    if not _AUX_LOSS_SCALE_SETTERS:
        return
    ones = torch.ones(1, device=device)
    scale = config.grad_scale_func(ones) if config.grad_scale_func is not None else ones
    if not getattr(config, "calculate_per_token_loss", False):
        scale = scale / num_microbatches
    for setter in _AUX_LOSS_SCALE_SETTERS:
        setter(config, scale)


def is_vp_first_stage(vp_stage: Optional[int], vp_size: Optional[int]) -> bool:
    """True for the first model chunk (or when there is no virtual pipeline)."""
    return vp_size is None or vp_stage is None or vp_stage == 0


def is_vp_last_stage(vp_stage: Optional[int], vp_size: Optional[int]) -> bool:
    """True for the last model chunk (or when there is no virtual pipeline)."""
    return vp_size is None or vp_stage is None or vp_stage == vp_size - 1
