"""Optimizer param groups: which params get weight decay, an LR multiplier, or the decoupled LR.

Groups are keyed by `(wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr)`. Defaults follow
Megatron: no weight decay for biases and 1-D params (norms); `lr_mult` only for params selected by
`scale_lr_cond`; expert-parallel params are those with `allreduce=False`; the decoupled LR applies
to input-embedding and output-layer params when `decoupled_lr` is set.

Note group alignment: distributed checkpoints need identical groups on every rank, so the group
keys are all-gathered over the world and every rank creates every group (possibly empty), in the
order of first appearance.
"""
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

PARAM_GROUP_IDENTIFIER_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")

_EMBEDDING_OR_OUTPUT_SUFFIXES = ("embedding.word_embeddings.weight", "output_layer.weight")


def _is_embedding_or_output_parameter(name: str, param: torch.Tensor) -> bool:
    """The model flags these params; the name check covers models that do not."""
    flag = getattr(param, "is_embedding_or_output_parameter", None)
    if flag is not None:
        return bool(flag)
    return name.endswith(_EMBEDDING_OR_OUTPUT_SUFFIXES)


def _param_key(
    name: str,
    param: torch.Tensor,
    no_weight_decay_cond: Optional[Callable],
    scale_lr_cond: Optional[Callable],
    lr_mult: float,
    use_decoupled_lr: bool,
    default_skip_embedding_weight_decay: bool,
) -> Tuple[float, float, bool, bool]:
    is_expert_parallel = not getattr(param, "allreduce", True)
    if no_weight_decay_cond is not None:
        no_wd = bool(no_weight_decay_cond(name, param))
    else:
        no_wd = (
            name.endswith(".bias")
            or len(param.shape) == 1
            or (default_skip_embedding_weight_decay and "embedding" in name)
        )
    scale_lr = bool(scale_lr_cond(name, param)) if scale_lr_cond is not None else False
    wd_mult = 0.0 if no_wd else 1.0
    group_lr_mult = lr_mult if scale_lr else 1.0
    is_decoupled_lr = use_decoupled_lr and _is_embedding_or_output_parameter(name, param)
    return (wd_mult, group_lr_mult, is_expert_parallel, is_decoupled_lr)


def _align_keys_across_ranks(keys: List[Tuple]) -> List[Tuple]:
    """Local keys followed by keys that only other ranks have, in first-seen order."""
    if not (dist.is_available() and dist.is_initialized()):
        return keys
    gathered: List[Optional[List[Tuple]]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, keys)
    aligned = list(keys)
    for rank_keys in gathered:
        for key in rank_keys:
            key = tuple(key)
            if key not in aligned:
                aligned.append(key)
    return aligned


def _update_min_and_max_lr_in_param_groups(
    param_groups: List[Dict],
    lr: Optional[float],
    min_lr: Optional[float],
    decoupled_lr: Optional[float],
    decoupled_min_lr: Optional[float],
) -> List[Dict]:
    """Set `max_lr` / `min_lr` of each group: the decoupled values for decoupled-LR groups."""
    if decoupled_min_lr is None:
        decoupled_min_lr = min_lr
    for group in param_groups:
        if group["is_decoupled_lr"]:
            group["max_lr"] = decoupled_lr
            group["min_lr"] = decoupled_min_lr
        else:
            group["max_lr"] = lr
            group["min_lr"] = min_lr
    return param_groups


def _get_param_groups(
    model_chunks: List[torch.nn.Module],
    no_weight_decay_cond: Optional[Callable],
    scale_lr_cond: Optional[Callable],
    lr_mult: float,
    lr: Optional[float],
    min_lr: Optional[float],
    decoupled_lr: Optional[float],
    decoupled_min_lr: Optional[float],
    default_skip_embedding_weight_decay: bool = False,
) -> List[Dict]:
    """Param groups over the trainable params of `model_chunks` (see the module docstring)."""
    params_map: Dict[Tuple, List[torch.Tensor]] = {}
    for model_chunk in model_chunks:
        for name, param in model_chunk.named_parameters():
            if not param.requires_grad:
                continue
            key = _param_key(
                name,
                param,
                no_weight_decay_cond,
                scale_lr_cond,
                lr_mult,
                decoupled_lr is not None,
                default_skip_embedding_weight_decay,
            )
            params_map.setdefault(key, []).append(param)
    param_groups = []
    for key in _align_keys_across_ranks(list(params_map.keys())):
        wd_mult, group_lr_mult, is_expert_parallel, is_decoupled_lr = key
        param_groups.append(
            {
                "params": params_map.get(key, []),
                "wd_mult": wd_mult,
                "lr_mult": group_lr_mult,
                "is_expert_parallel": is_expert_parallel,
                "is_decoupled_lr": is_decoupled_lr,
            }
        )
    return _update_min_and_max_lr_in_param_groups(param_groups, lr, min_lr, decoupled_lr, decoupled_min_lr)


def get_param_groups_and_buffers(
    model_chunks: List[torch.nn.Module],
    model_chunk_offset: int,
    config,
    no_weight_decay_cond: Optional[Callable],
    scale_lr_cond: Optional[Callable],
    lr_mult: float,
    filter_fn: Callable[[Dict], bool],
    buffer_name: str,
    default_skip_embedding_weight_decay: bool = False,
) -> Tuple[List[Dict], Dict[int, list]]:
    """Param groups passing `filter_fn`, and each chunk's DDP buffers (`buffer_name`) keyed by chunk index."""
    param_groups = _get_param_groups(
        model_chunks,
        no_weight_decay_cond,
        scale_lr_cond,
        lr_mult,
        lr=config.lr,
        min_lr=config.min_lr,
        decoupled_lr=config.decoupled_lr,
        decoupled_min_lr=config.decoupled_min_lr,
        default_skip_embedding_weight_decay=default_skip_embedding_weight_decay,
    )
    param_groups = [group for group in param_groups if filter_fn(group)]
    buffers = {}
    for index, model_chunk in enumerate(model_chunks):
        if hasattr(model_chunk, buffer_name):
            buffers[index + model_chunk_offset] = getattr(model_chunk, buffer_name)
    return param_groups, buffers
