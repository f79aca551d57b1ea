"""Distributed checkpointing (Megatron Core's `megatron.core.dist_checkpointing` API).

The mapping types are imported eagerly (modules use them to build `sharded_state_dict()`); the
save/load entry points, which pull in `torch.distributed.checkpoint`, are resolved lazily (PEP 562;
the table is `megatron.core.reexports`).
"""
from megatron.core.dist_checkpointing.core import check_is_distributed_checkpoint
from megatron.core.dist_checkpointing.mapping import (
    CheckpointingException,
    LocalNonpersistentObject,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.reexports import lazy_attribute, reexported_names

__all__ = [
    "check_is_distributed_checkpoint", "CheckpointingException", "LocalNonpersistentObject", "ShardedObject",
    "ShardedStateDict", "ShardedTensor", "ShardedTensorFactory", "StateDict", "StrictHandling",
    *reexported_names(__name__),
]


def __getattr__(name):
    return lazy_attribute(__name__, name)
