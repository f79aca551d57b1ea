"""Data parallelism: DDP with bucketed, overlapped gradient reduction; gradient finalisation; FSDP2.

Names are Megatron Core 0.13.1's and are loaded lazily (PEP 562) so importing the package is cheap.
"""
import importlib

_LAZY_ATTRS = {
    "DistributedDataParallel": "megatron.core.distributed.distributed_data_parallel",
    "DistributedDataParallelConfig": "megatron.core.distributed.distributed_data_parallel_config",
    "finalize_model_grads": "megatron.core.distributed.finalize_model_grads",
    "TorchFullyShardedDataParallel": "megatron.core.distributed.torch_fully_sharded_data_parallel",
    "ParamAndGradBuffer": "megatron.core.distributed.param_and_grad_buffer",
    "partition_buckets": "megatron.core.distributed.param_and_grad_buffer",
}
_RENAMED = {"ParamAndGradBuffer": "_ParamAndGradBuffer"}

__all__ = list(_LAZY_ATTRS)


def __getattr__(name):
    if name in _LAZY_ATTRS:
        module = importlib.import_module(_LAZY_ATTRS[name])
        value = getattr(module, _RENAMED.get(name, name))
        globals()[name] = value
        return value
    raise AttributeError(f"module 'megatron.core.distributed' has no attribute {name!r}")
