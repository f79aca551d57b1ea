"""Helpers of the transformer package: activations, masks, process-group lookup, sharded-state-dict helpers,
and switching a built model's sequence parallelism."""
from typing import Callable, Dict, Iterable, Optional, Tuple

import torch

from megatron.core import parallel_state
from megatron.core.activations import erf_gelu, openai_gelu, squared_relu  # noqa: F401  (Megatron's import path)
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.process_groups_config import (
    get_pg_rank,
    get_pg_size,
    get_tensor_model_parallel_group_if_none,
)
from megatron.core.tensor_parallel.utils import _extra_state_shape_and_offset, make_sharded_state_dict_for_layer
from megatron.core.transformer.sharded import sharded_state_dict_default  # noqa: F401  (Megatron's import path)


def attention_mask_func(attention_scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Fill masked positions (mask True) with -10000, Megatron's unfused-softmax convention."""
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


def get_default_causal_mask(sq: int, sk: Optional[int] = None, device=None) -> torch.Tensor:
    """Boolean [sq, sk] mask, True above the diagonal (masked), aligned at the top-left."""
    sk = sq if sk is None else sk
    return torch.triu(torch.ones(sq, sk, dtype=torch.bool, device=device), diagonal=1)


def get_sliding_window_causal_mask(sq: int, skv: int, window_size: Tuple[int, int], device=None) -> torch.Tensor:
    """Boolean [sq, skv] mask, True where masked: query i sees keys j with
    `i + skv - sq - window_size[0] <= j <= i + skv - sq + window_size[1]` (queries aligned at the bottom-right)."""
    visible = torch.ones(sq, skv, dtype=torch.bool, device=device)
    visible = torch.triu(visible, diagonal=skv - sq - window_size[0])
    visible = torch.tril(visible, diagonal=skv - sq + window_size[1])
    return ~visible


def gelu_impl(x: torch.Tensor) -> torch.Tensor:
    """OpenAI's tanh-approximated GELU (Megatron's name for the function behind `openai_gelu`)."""
    return openai_gelu(x)


def get_linear_layer(rows: int, columns: int, init_method: Callable, perform_initialization: bool = True):
    """A plain `torch.nn.Linear(rows, columns)` with `init_method` applied to its weight and a zero bias."""
    layer = torch.nn.Linear(rows, columns)
    if perform_initialization:
        init_method(layer.weight)
    with torch.no_grad():
        layer.bias.zero_()
    return layer


def make_sharded_tensors_for_checkpoint(
    state_dict: Dict,
    prefix: str = "",
    tensor_parallel_layers_axis_map: Optional[Dict[str, int]] = None,
    sharded_offsets: Iterable[Tuple[int, int, int]] = (),
    extra_state_suffix: str = "_extra_state",
):
    """Sharded state dict of a module's plain `state_dict(keep_vars=True)`: names in
    `tensor_parallel_layers_axis_map` are split over TP along that axis, `*_extra_state` entries become
    ShardedObjects, everything else is replicated across TP. Keys are `prefix + name`."""
    if extra_state_suffix != "_extra_state":
        raise ValueError(f"make_sharded_tensors_for_checkpoint: extra_state_suffix={extra_state_suffix!r} is not "
                         "supported; extra state is recognised by the '_extra_state' suffix.")
    return make_sharded_state_dict_for_layer(state_dict, prefix, tensor_parallel_layers_axis_map or {},
                                             tuple(sharded_offsets))


def make_sharded_object_for_checkpoint(obj, key: str, sharded_offsets: Iterable[Tuple[int, int, int]] = (),
                                       replica_id=None, **kwargs) -> ShardedObject:
    """ShardedObject for a non-tensor value (Transformer Engine's `_extra_state`, say) stored under `key`.

    Its shape and offset are the layer-stack axes of `sharded_offsets`; by default only TP rank 0 and DP
    rank 0 write it."""
    if replica_id is None:
        replica_id = (0, parallel_state.get_tensor_model_parallel_rank(),
                      parallel_state.get_data_parallel_rank(with_context_parallel=True))
    shape, offset = _get_extra_state_offsets(sharded_offsets)
    return ShardedObject(key, obj, shape, offset, replica_id, **kwargs)


def _get_extra_state_offsets(sharded_offsets: Iterable[Tuple[int, int, int]]):
    """(shape, offset) of a ShardedObject placed on the layer-stack axes of `sharded_offsets`."""
    return _extra_state_shape_and_offset(tuple(sharded_offsets))


# Attributes that decide whether a built module runs with sequence parallelism.
_SEQUENCE_PARALLEL_ATTRS = ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings")


def set_model_to_sequence_parallel(model: torch.nn.Module, set_to: bool = False, exclude_modules=None) -> None:
    """Switch sequence parallelism of a built model on or off (Megatron uses it to turn SP off for decoding).

    Sets `model.config.sequence_parallel` and, on `model` and every submodule that has them, the attributes
    `sequence_parallel` (linears, norms), `scatter_to_sequence_parallel` (the embedding's scatter of its output)
    and, unless the model uses learned absolute position embeddings, `reduce_scatter_embeddings` (the word
    embedding reduce-scattering instead of all-reducing, which is only correct when nothing is added to its
    output before the scatter). Modules in `exclude_modules`, and everything inside them, are left alone.
    The parameters' own `sequence_parallel` flags (which grads finalize_model_grads all-reduces over TP)
    keep their values, as in Megatron.
    """
    attrs = list(_SEQUENCE_PARALLEL_ATTRS)
    if getattr(model, "position_embedding_type", None) == "learned_absolute":
        attrs.remove("reduce_scatter_embeddings")
    excluded = list(exclude_modules or [])
    model.config.sequence_parallel = set_to

    def visit(module: torch.nn.Module) -> None:
        if any(module is other for other in excluded):
            return
        for attr in attrs:
            if hasattr(module, attr):
                setattr(module, attr, set_to)
        for child in module.children():
            visit(child)

    visit(model)


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
    "gelu_impl",
    "squared_relu",
    "attention_mask_func",
    "get_default_causal_mask",
    "get_sliding_window_causal_mask",
    "get_linear_layer",
    "make_sharded_tensors_for_checkpoint",
    "make_sharded_object_for_checkpoint",
    "sharded_state_dict_default",
    "set_model_to_sequence_parallel",
    "get_tp_group",
    "get_tp_world_size",
    "get_tp_rank",
]
