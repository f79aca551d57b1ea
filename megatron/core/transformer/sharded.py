"""Distributed-checkpoint (torch_dist) sharded state dicts of model modules.

Keys and layouts follow Megatron: layers of a block are stacked along a leading global axis
(`decoder.layers.<param>` with shape [num_layers, ...]), TP-split tensors carry their TP offset, and a
gated fc1, stored per rank as [gate_shard; up_shard], is saved as the global [all gate; all up].
"""
from typing import Dict, Tuple

import torch

from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.tensor_parallel.utils import make_sharded_state_dict_for_layer


def sharded_state_dict_default(module: torch.nn.Module, prefix: str = "", sharded_offsets: Tuple = (), metadata=None):
    """The module's own sharded state dict if it defines one; else its tensors replicated, children recursed."""
    if hasattr(module, "sharded_state_dict"):
        return module.sharded_state_dict(prefix, sharded_offsets, metadata)
    return generic_sharded_state_dict(module, prefix, sharded_offsets, metadata)


def generic_sharded_state_dict(module: torch.nn.Module, prefix: str, sharded_offsets: Tuple, metadata) -> Dict:
    """Own tensors as replicated ShardedTensors (extra state as ShardedObjects), then every child."""
    own = {}
    module._save_to_state_dict(own, "", keep_vars=True)
    result = make_sharded_state_dict_for_layer(own, prefix, {}, sharded_offsets)
    for name, child in module.named_children():
        result.update(sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata))
    return result


def apply_swiglu_sharded_factory(original: ShardedTensor, sharded_offsets: Tuple) -> ShardedTensorFactory:
    """Save a local [gate_shard; up_shard] tensor as two pieces of the global [all gate; all up] tensor."""
    axis = len(sharded_offsets)
    local_rows = original.local_shape[0]
    rank_offset = original.global_offset[axis] // local_rows
    fragments = original.axis_fragmentations[axis]

    def build(key, data, replica_id, flattened_range):
        half = data.shape[0] // 2
        gate, up = data.narrow(0, 0, half), data.narrow(0, half, half)  # [2f/tp, h] -> 2 x [f/tp, h]
        gate_offset = (axis, rank_offset, fragments * 2)
        up_offset = (axis, rank_offset + fragments, fragments * 2)
        return [
            ShardedTensor.from_rank_offsets(key, gate, *sharded_offsets, gate_offset, replica_id=replica_id,
                                            prepend_axis_num=axis),
            ShardedTensor.from_rank_offsets(key, up, *sharded_offsets, up_offset, replica_id=replica_id,
                                            prepend_axis_num=axis),
        ]

    def merge(loaded):
        return torch.cat(loaded)

    return ShardedTensorFactory(original.key, original.data, build, merge, original.replica_id)


__all__ = ["sharded_state_dict_default", "generic_sharded_state_dict", "apply_swiglu_sharded_factory"]
