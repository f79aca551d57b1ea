"""Mamba-2 operations with an explicit implementation choice.

`impl="torch"` runs the pure-PyTorch reference (`reference.py`); `impl="triton"` runs the Triton kernels
(`triton_ssd.py`, `triton_conv1d.py`, same signatures); `impl="auto"` picks Triton when the inputs are CUDA
tensors and the Triton module imports, else the reference. The choice is an argument (from the model config),
never an environment variable.
"""

import importlib

from megatron.core.ssm.ops import reference

IMPLS = ("auto", "torch", "triton")

_TRITON_MODULES = {}


def _triton_module(name: str):
    """The Triton kernel module `megatron.core.ssm.ops.<name>`, or None when it (or triton) does not import."""
    if name not in _TRITON_MODULES:
        try:
            module = importlib.import_module(f"megatron.core.ssm.ops.{name}")
        except ImportError:
            module = None
        # the kernel modules import without triton (their kernels are then undefined): unavailable too
        _TRITON_MODULES[name] = module if getattr(module, "_HAVE_TRITON", False) else None
    return _TRITON_MODULES[name]


def resolve_impl(impl: str, tensor, module_name: str):
    """The module implementing an op for `impl` ("auto" | "torch" | "triton") and the tensor's device."""
    if impl not in IMPLS:
        raise ValueError(f"ssm ops: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch":
        return reference
    module = _triton_module(module_name)
    if impl == "triton":
        if module is None:
            raise ValueError(f"ssm ops: impl='triton' but megatron.core.ssm.ops.{module_name} does not import "
                             "(is triton installed?): use impl='torch' or 'auto'")
        return module
    return module if (module is not None and tensor.is_cuda) else reference


def ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=True,
                   initial_states=None, return_final_states=False, impl="auto"):
    """The chunked SSD scan (see `reference.ssd_chunk_scan`) by the implementation `impl` selects."""
    module = resolve_impl(impl, x, "triton_ssd")
    return module.ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                 initial_states=initial_states, return_final_states=return_final_states)


def causal_conv1d(x, weight, bias=None, activation=None, impl="auto"):
    """The causal depthwise conv1d (see `reference.causal_conv1d`) by the implementation `impl` selects."""
    module = resolve_impl(impl, x, "triton_conv1d")
    return module.causal_conv1d(x, weight, bias=bias, activation=activation)
