"""Tensor splitting helpers and `VocabUtility` (which vocabulary slice a TP rank owns)."""
from typing import List, Sequence

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.process_groups_config import get_pg_rank, get_pg_size
from megatron.core.tensor_parallel.mappings import gather_split_1d_tensor
from megatron.core.utils import divide

__all__ = [
    "split_tensor_along_last_dim",
    "split_tensor_into_1d_equal_chunks",
    "gather_split_1d_tensor",
    "VocabUtility",
    "make_tp_sharded_tensor_for_checkpoint",
    "make_sharded_tensor_for_checkpoint",
    "make_sharded_state_dict_for_layer",
]


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> List[torch.Tensor]:
    """Split `tensor` into `num_partitions` equal chunks along its last dimension."""
    last_dim_size = divide(tensor.size()[-1], num_partitions)
    chunks = torch.split(tensor, last_dim_size, dim=tensor.dim() - 1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return chunks


def split_tensor_into_1d_equal_chunks(tensor: torch.Tensor, new_buffer: bool = False, group=None) -> torch.Tensor:
    """This TP rank's equal 1-D chunk of the flattened `tensor` (a view unless new_buffer)."""
    if group is None:
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
    else:
        world_size, rank = get_pg_size(group), get_pg_rank(group)
    partition_size = divide(tensor.numel(), world_size)
    start = partition_size * rank
    # [...] -> [numel] -> [numel/tp]
    data = tensor.reshape(-1)[start:start + partition_size]
    if new_buffer:
        chunk = torch.empty(partition_size, dtype=tensor.dtype, device=tensor.device, requires_grad=False)
        chunk.copy_(data)
        return chunk
    return data


class VocabUtility:
    """Contiguous vocabulary ranges: rank r of a TP group of size p owns ids [r*V/p, (r+1)*V/p)."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int, world_size: int) -> Sequence[int]:
        """(first, last + 1) ids owned by `rank` when each rank holds `per_partition_vocab_size` ids."""
        index_f = rank * per_partition_vocab_size
        return index_f, index_f + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> Sequence[int]:
        """(first, last + 1) ids owned by `rank` for a vocabulary of `global_vocab_size` ids."""
        per_partition_vocab_size = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition_vocab_size, rank, world_size)


def _replica_dp_rank() -> int:
    return parallel_state.get_data_parallel_rank(with_context_parallel=True)


def make_tp_sharded_tensor_for_checkpoint(tensor, key, tp_axis=0, replica_id=None, prepend_offsets=(), **kwargs):
    """ShardedTensor of a TP-split `tensor`: global axis `tp_axis` is cut into TP-size chunks."""
    prepend_axis_num = len(prepend_offsets)
    tp_offset = (tp_axis + prepend_axis_num, parallel_state.get_tensor_model_parallel_rank(),
                 parallel_state.get_tensor_model_parallel_world_size())
    if replica_id is None:
        replica_id = (0, 0, _replica_dp_rank())
    return ShardedTensor.from_rank_offsets(key, tensor, *prepend_offsets, tp_offset, replica_id=replica_id,
                                           prepend_axis_num=prepend_axis_num, **kwargs)


def make_sharded_tensor_for_checkpoint(tensor, key, prepend_offsets=(), replica_id=None, **kwargs):
    """ShardedTensor of a tensor replicated across TP (only TP rank 0 and DP rank 0 write it)."""
    if replica_id is None:
        replica_id = (0, parallel_state.get_tensor_model_parallel_rank(), _replica_dp_rank())
    return ShardedTensor.from_rank_offsets(key, tensor, *prepend_offsets, replica_id=replica_id,
                                           prepend_axis_num=len(prepend_offsets), **kwargs)


def _extra_state_shape_and_offset(sharded_offsets):
    if not sharded_offsets:
        return (1,), (0,)
    ordered = sorted(sharded_offsets, key=lambda item: item[0])
    if [axis for axis, _, _ in ordered] != list(range(len(ordered))):
        raise ValueError(f"sharded_offsets {sharded_offsets} must cover axes 0..n-1 for an extra-state object")
    return tuple(size for _, _, size in ordered), tuple(offset for _, offset, _ in ordered)


def make_sharded_state_dict_for_layer(state_dict, prefix, tensor_parallel_axis_map, sharded_offsets=(),
                                      allow_shape_mismatch=False):
    """Sharded state dict of one layer's plain `state_dict(keep_vars=True)`.

    Keys in `tensor_parallel_axis_map` (e.g. {'weight': 0, 'bias': 0}) are TP-split along that axis;
    `_extra_state` entries become ShardedObjects; everything else is replicated across TP.
    """
    sharded = {}
    for name, value in state_dict.items():
        key = f"{prefix}{name}"
        if name in tensor_parallel_axis_map:
            sharded[key] = make_tp_sharded_tensor_for_checkpoint(
                value, key, tensor_parallel_axis_map[name], prepend_offsets=sharded_offsets,
                allow_shape_mismatch=allow_shape_mismatch,
            )
        elif name.endswith("_extra_state"):
            shape, offset = _extra_state_shape_and_offset(sharded_offsets)
            replica_id = (0, parallel_state.get_tensor_model_parallel_rank(), _replica_dp_rank())
            sharded[key] = ShardedObject(key, value, shape, offset, replica_id)
        else:
            sharded[key] = make_sharded_tensor_for_checkpoint(value, key, prepend_offsets=sharded_offsets)
    return sharded
