"""Small helpers shared by every part of Megatron Core.

This module sits at the bottom of the import graph: it imports nothing from `megatron.core` but the
re-export table (`megatron.core.reexports`), so any module may import it.
"""
import importlib.util
import math
from functools import lru_cache
from typing import Any, Callable, Optional

import torch
from packaging.version import Version

from megatron.core.reexports import lazy_attribute


def ensure_divisibility(numerator: int, denominator: int) -> None:
    """Raise ValueError unless `denominator` divides `numerator`."""
    if denominator == 0 or numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")


def divide(numerator: int, denominator: int) -> int:
    """Exact integer division; raises ValueError when it is not exact."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


@lru_cache(maxsize=None)
def module_available(name: str) -> bool:
    """True when `name` can be imported; never imports it (so never prints or touches CUDA)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@lru_cache(maxsize=None)
def is_torch_min_version(version: str, check_equality: bool = True) -> bool:
    """True when the installed torch is at least `version` (greater-than only if not check_equality)."""
    installed = Version(Version(torch.__version__).base_version)
    if check_equality:
        return installed >= Version(version)
    return installed > Version(version)


def get_attr_wrapped_model(model, attr: str, allow_none: bool = True, return_model_obj: bool = False):
    """Read `attr` from the innermost module that has it, looking through wrappers (DDP, Float16Module).

    `model` may be a list of model chunks, in which case the first chunk is used.
    """
    if isinstance(model, list):
        if len(model) != 1:
            model = model[:1]
        model = model[0]
    while True:
        if hasattr(model, attr) and (allow_none or getattr(model, attr) is not None):
            break
        if not hasattr(model, "module"):
            raise RuntimeError(f"couldn't find attribute {attr} in the wrapped model")
        model = model.module
    return model if return_model_obj else getattr(model, attr)


def get_model_config(model):
    """The `TransformerConfig` (or `ModelParallelConfig`) of a possibly wrapped model."""
    return get_attr_wrapped_model(model, "config", allow_none=False)


def get_model_type(model):
    """The `ModelType` of a possibly wrapped model."""
    return get_attr_wrapped_model(model, "model_type")


def unwrap_model(model, module_instances: Optional[tuple] = None):
    """Strip wrapper modules (anything exposing `.module`) from a model or a list of model chunks."""
    return_list = isinstance(model, list)
    chunks = model if return_list else [model]
    unwrapped = []
    for chunk in chunks:
        while hasattr(chunk, "module") and (module_instances is None or isinstance(chunk, module_instances)):
            chunk = chunk.module
        unwrapped.append(chunk)
    return unwrapped if return_list else unwrapped[0]


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], Any]:
    """Init function drawing from N(0, sigma)."""

    def init_(tensor):
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(sigma: float, num_layers: int, multiplier: float = 2.0):
    """Init function drawing from N(0, sigma / sqrt(multiplier * num_layers)) (output projections)."""
    std = sigma / math.sqrt(multiplier * num_layers)

    def init_(tensor):
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)

    return init_


def _viewless_copy(inp: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    out = torch.empty((1,), dtype=inp.dtype, device=inp.device, requires_grad=requires_grad)
    out.data = inp.data
    return out


class _MakeViewlessTensor(torch.autograd.Function):
    """Forward: same storage without `._base`; backward: gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, inp, requires_grad):
        return _viewless_copy(inp, requires_grad)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


def make_viewless_tensor(inp: torch.Tensor, requires_grad: bool, keep_graph: bool) -> torch.Tensor:
    """Return a tensor with no `._base`, so that freeing a pipeline stage's output frees its memory."""
    if inp._base is None:
        return inp
    if keep_graph:
        return _MakeViewlessTensor.apply(inp, requires_grad)
    return _viewless_copy(inp, requires_grad)


def get_torch_device_type() -> str:
    """'cuda' when a GPU is usable, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() else "cpu"


# Megatron also exposes names from here that live higher in the import graph (`get_pg_size`, ...); they
# are resolved lazily (PEP 562) from the table in `megatron.core.reexports`.
def __getattr__(name):
    return lazy_attribute(__name__, name)
