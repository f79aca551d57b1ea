"""Megatron Core compatible library.

Names are re-exported lazily (PEP 562) so that `import megatron.core` never imports torch
submodules it does not need, never prints, and never touches CUDA.
"""
import importlib

from megatron.core.package_info import __version__

_LAZY_MODULES = {
    "mpu": "megatron.core.parallel_state",
    "parallel_state": "megatron.core.parallel_state",
    "tensor_parallel": "megatron.core.tensor_parallel",
    "dist_checkpointing": "megatron.core.dist_checkpointing",
    "utils": "megatron.core.utils",
}
_LAZY_ATTRS = {
    "ModelParallelConfig": ("megatron.core.model_parallel_config", "ModelParallelConfig"),
    "DistributedDataParallel": ("megatron.core.distributed", "DistributedDataParallel"),
    "InferenceParams": ("megatron.core.inference_params", "InferenceParams"),
    "Timers": ("megatron.core.timers", "Timers"),
}

__all__ = ["__version__", *_LAZY_MODULES, *_LAZY_ATTRS]


def __getattr__(name):
    if name in _LAZY_MODULES:
        module = importlib.import_module(_LAZY_MODULES[name])
        globals()[name] = module
        return module
    if name in _LAZY_ATTRS:
        module_name, attr = _LAZY_ATTRS[name]
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'megatron.core' has no attribute {name!r}")
