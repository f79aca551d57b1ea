"""Helpers of the transformer package: activations, masks, process-group lookup, recompute wrapping."""
from typing import Optional

import torch

from megatron.core.activations import erf_gelu, openai_gelu, squared_relu  # noqa: F401  (Megatron's import path)
from megatron.core.process_groups_config import (
    get_pg_rank,
    get_pg_size,
    get_tensor_model_parallel_group_if_none,
)


def attention_mask_func(attention_scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Fill masked positions (mask True) with -10000, Megatron's unfused-softmax convention."""
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


def get_default_causal_mask(sq: int, sk: Optional[int] = None, device=None) -> torch.Tensor:
    """Boolean [sq, sk] mask, True above the diagonal (masked), aligned at the top-left."""
    sk = sq if sk is None else sk
    return torch.triu(torch.ones(sq, sk, dtype=torch.bool, device=device), diagonal=1)


def get_tp_group(tp_group=None, is_expert: bool = False):
    """The tensor-parallel group a layer uses: `tp_group` when given, else parallel_state's (or None)."""
    return get_tensor_model_parallel_group_if_none(tp_group, is_expert=is_expert, check_initialized=False)


def get_tp_world_size(tp_group=None, is_expert: bool = False) -> int:
    """Size of the tensor-parallel group (1 when no group exists)."""
    return get_pg_size(get_tp_group(tp_group, is_expert))


def get_tp_rank(tp_group=None, is_expert: bool = False) -> int:
    """This rank's index in the tensor-parallel group (0 when no group exists)."""
    return get_pg_rank(get_tp_group(tp_group, is_expert))


def get_model_comm_pgs_tp(model_comm_pgs):
    """The `tp` group of a `ModelCommProcessGroups`, or None to use parallel_state's."""
    if model_comm_pgs is None:
        return None
    return getattr(model_comm_pgs, "tp", None)


__all__ = [
    "openai_gelu",
    "erf_gelu",
    "squared_relu",
    "attention_mask_func",
    "get_default_causal_mask",
    "get_tp_group",
    "get_tp_world_size",
    "get_tp_rank",
]
