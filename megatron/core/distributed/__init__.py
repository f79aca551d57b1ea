"""Data parallelism: DDP with bucketed, overlapped gradient reduction; gradient finalisation; FSDP2.

Names are Megatron Core 0.13.1's and are loaded lazily (PEP 562) so importing the package is cheap.
"""
import importlib

# `finalize_model_grads` is both a submodule and the function it defines. Bound lazily, the name would
# become the module as soon as anything imported the submodule first (the import system sets the parent's
# attribute once the submodule has loaded), e.g. `from megatron.core.distributed.finalize_model_grads import
# _allreduce_word_embedding_grads`; bound here, after that import, it stays the function, as in Megatron.
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

_LAZY_ATTRS = {
    "DistributedDataParallel": "megatron.core.distributed.distributed_data_parallel",
    "DistributedDataParallelConfig": "megatron.core.distributed.distributed_data_parallel_config",
    "TorchFullyShardedDataParallel": "megatron.core.distributed.torch_fully_sharded_data_parallel",
    "ParamAndGradBuffer": "megatron.core.distributed.param_and_grad_buffer",
    "partition_buckets": "megatron.core.distributed.param_and_grad_buffer",
}
_RENAMED = {"ParamAndGradBuffer": "_ParamAndGradBuffer"}

__all__ = ["finalize_model_grads", *_LAZY_ATTRS]


def __getattr__(name):
    if name in _LAZY_ATTRS:
        module = importlib.import_module(_LAZY_ATTRS[name])
        value = getattr(module, _RENAMED.get(name, name))
        globals()[name] = value
        return value
    raise AttributeError(f"module 'megatron.core.distributed' has no attribute {name!r}")
