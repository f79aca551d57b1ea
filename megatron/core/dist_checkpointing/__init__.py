"""Distributed checkpointing (Megatron Core's `megatron.core.dist_checkpointing` API).

The mapping types are imported eagerly (modules use them to build `sharded_state_dict()`); the
save/load entry points, which pull in `torch.distributed.checkpoint`, are resolved lazily (PEP 562).
"""
import importlib

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

_LAZY_ATTRS = {
    "save": "megatron.core.dist_checkpointing.serialization",
    "load": "megatron.core.dist_checkpointing.serialization",
    "load_common_state_dict": "megatron.core.dist_checkpointing.serialization",
    "load_tensors_metadata": "megatron.core.dist_checkpointing.serialization",
    "load_sharded_metadata": "megatron.core.dist_checkpointing.serialization",
    "load_plain_tensors": "megatron.core.dist_checkpointing.serialization",
    "load_content_metadata": "megatron.core.dist_checkpointing.serialization",
    "remove_sharded_tensors": "megatron.core.dist_checkpointing.serialization",
}

__all__ = [
    "check_is_distributed_checkpoint", "CheckpointingException", "LocalNonpersistentObject", "ShardedObject",
    "ShardedStateDict", "ShardedTensor", "ShardedTensorFactory", "StateDict", "StrictHandling", *_LAZY_ATTRS,
]


def __getattr__(name):
    if name in _LAZY_ATTRS:
        value = getattr(importlib.import_module(_LAZY_ATTRS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'megatron.core.dist_checkpointing' has no attribute {name!r}")
