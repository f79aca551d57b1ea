"""Small helpers shared by every part of Megatron Core.

This module sits at the bottom of the import graph: it imports nothing from `megatron.core` except
`config` (the experimental switch), `package_info` and the re-export table (`megatron.core.reexports`), so any
module may import it.
"""
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import math
from functools import lru_cache, wraps
from typing import Any, Callable, List, Optional

import torch
from packaging.version import Version

from megatron.core import config as _config
from megatron.core.package_info import __version__ as _mcore_version
from megatron.core.reexports import lazy_attribute

logger = logging.getLogger(__name__)


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


def get_torch_version() -> Version:
    """The installed torch version (local build tags such as `+cu128` kept, as `packaging` parses them)."""
    return Version(torch.__version__)


@lru_cache(maxsize=None)
def is_torch_min_version(version: str, check_equality: bool = True) -> bool:
    """True when the installed torch is at least `version` (greater-than only if not check_equality)."""
    installed = Version(Version(torch.__version__).base_version)
    if check_equality:
        return installed >= Version(version)
    return installed > Version(version)


# Distribution names Transformer Engine is published under (the framework wheel and the CUDA-specific core).
_TE_DISTRIBUTIONS = ("transformer-engine", "transformer_engine", "transformer-engine-torch", "transformer-engine-cu12")


@lru_cache(maxsize=None)
def get_te_version() -> Optional[Version]:
    """The installed Transformer Engine version, or None when TE is not installed (as Megatron).

    Read from the package metadata, so asking never imports TE; only a TE installed without metadata
    (a source checkout on the path) is imported to read its `__version__`.
    """
    if not module_available("transformer_engine"):
        return None
    for name in _TE_DISTRIBUTIONS:
        try:
            return Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            continue
    module = importlib.import_module("transformer_engine")
    return Version(str(module.__version__)) if hasattr(module, "__version__") else None


@lru_cache(maxsize=None)
def get_fa_version() -> Optional[Version]:
    """The installed flash-attn version (from its package metadata, never importing it), or None."""
    for name in ("flash-attn", "flash_attn"):
        try:
            return Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def is_fa_min_version(version: str, check_equality: bool = True) -> bool:
    """True when flash-attn is installed at `version` or newer (strictly newer if not check_equality)."""
    installed = get_fa_version()
    if installed is None:
        return False
    return installed >= Version(version) if check_equality else installed > Version(version)


def is_te_min_version(version: str, check_equality: bool = True) -> bool:
    """True when Transformer Engine is installed at `version` or newer (strictly newer if not check_equality).

    Without TE this is False (Megatron compares None with a version there and raises TypeError).
    """
    installed = get_te_version()
    if installed is None:
        return False
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


# Megatron's names of the two pieces above.
_kernel_make_viewless_tensor = _viewless_copy
MakeViewlessTensor = _MakeViewlessTensor


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


def log_single_rank(logger: logging.Logger, *args: Any, rank: int = 0, **kwargs: Any) -> None:
    """`logger.log(*args, **kwargs)` on global rank `rank` only (on every process before distributed init)."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != rank:
        return
    logger.log(*args, **kwargs)


def assert_viewless_tensor(tensor, extra_msg: Optional[str] = None):
    """Raise AssertionError if `tensor` (or any tensor of a list) is a view; return it unchanged otherwise.

    Pipeline stages free their outputs' storage; a view would keep its base tensor alive.
    """
    if isinstance(tensor, list):
        return [assert_viewless_tensor(t, extra_msg) for t in tensor]
    if not isinstance(tensor, torch.Tensor):
        return tensor
    if tensor._base is not None:
        raise AssertionError(
            "Ensure tensor._base is None before setting tensor.data or storing tensor to memory buffer; "
            f"found tensor._base of shape {tuple(tensor._base.shape)}. {extra_msg or ''}".rstrip()
        )
    return tensor


def safely_set_viewless_tensor_data(tensor: torch.Tensor, new_data_tensor: torch.Tensor) -> None:
    """Set `tensor.data` after checking that `tensor` is not a view (see `assert_viewless_tensor`)."""
    assert_viewless_tensor(
        tensor,
        extra_msg=f"FYI, tensor._base has shape {None if tensor._base is None else tuple(tensor._base.shape)}, "
        f"and new_data_tensor has shape {tuple(new_data_tensor.shape)}.",
    )
    tensor.data = new_data_tensor


def is_submodule(module: torch.nn.Module, parent_module: torch.nn.Module, strict: bool = True) -> bool:
    """True when `module` is inside `parent_module` (or is it, unless `strict`)."""
    if not strict and module is parent_module:
        return True
    return any(module is child for child in parent_module.modules() if child is not parent_module)


def get_model_xattn(model) -> bool:
    """Whether a possibly wrapped model says it needs cross-attention inputs (`xattn_needed`), else False."""
    try:
        return get_attr_wrapped_model(model, "xattn_needed")
    except RuntimeError:
        return False


def _is_dtensor(tensor) -> bool:
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "to_local")


def to_local_if_dtensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 parameters and gradients); any other tensor unchanged."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor


def get_data_parallel_group_if_dtensor(tensor: torch.Tensor, data_parallel_group=None):
    """The process group a DTensor is sharded over (its 1-D device mesh), or None for a plain tensor.

    Raises ValueError when `data_parallel_group` is given and differs from the DTensor's group.
    """
    if not _is_dtensor(tensor):
        return None
    group = tensor.device_mesh.get_group()
    if data_parallel_group is not None and group != data_parallel_group:
        raise ValueError("get_data_parallel_group_if_dtensor: the DTensor is sharded over another process group "
                         "than the data_parallel_group passed in.")
    return group


def deprecate_inference_params(inference_context, inference_params):
    """`inference_params` is Megatron's old name of `inference_context`: use it when only it was passed."""
    if inference_context is None and inference_params is not None:
        return inference_params
    return inference_context


# ---- Multi-tensor operations (Apex's `amp_C` signatures, in plain PyTorch) ----------------------------------

_MULTI_TENSOR_CHUNK_SIZE = 2048 * 32


def local_multi_tensor_applier(op: Callable, noop_flag_buffer: torch.Tensor, tensor_lists, *args):
    """Apex's `multi_tensor_applier`: call `op(chunk_size, noop_flag_buffer, tensor_lists, *args)`."""
    return op(_MULTI_TENSOR_CHUNK_SIZE, noop_flag_buffer, tensor_lists, *args)


def local_multi_tensor_l2_norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, per_tensor: bool, *args):
    """L2 norm over every tensor of `tensor_lists` (Apex's `amp_C.multi_tensor_l2norm`).

    Returns `(norm, per_tensor_norms)`: `norm` is a float32 tensor of shape [1] on the tensors' device
    (computed there, with no host synchronisation), `per_tensor_norms` the float32 norm of each tensor
    when `per_tensor` is True, else None. Each norm accumulates in float32 whatever the tensors' dtype.
    `chunk_size` and `noop_flag` are accepted for the signature and not used.
    """
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    if not tensors:
        device = noop_flag.device if isinstance(noop_flag, torch.Tensor) else "cpu"
        return torch.zeros(1, dtype=torch.float32, device=device), None
    norms = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors])
    total = torch.linalg.vector_norm(norms).reshape(1)  # [] -> [1], amp_C's shape
    return total, (norms if per_tensor else None)


def local_multi_tensor_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, scale) -> None:
    """`dst = src * scale` for each pair of `tensor_lists = [srcs, dsts]` (Apex's `amp_C.multi_tensor_scale`).

    `src` and `dst` may be the same tensors (in-place scaling, as gradient clipping uses it) and may differ in
    dtype (the product is cast to `dst`'s). `chunk_size` and `noop_flag` are accepted and not used.
    """
    sources, destinations = tensor_lists[0], tensor_lists[1]
    if len(sources) != len(destinations):
        raise ValueError(f"local_multi_tensor_scale: {len(sources)} sources but {len(destinations)} destinations")
    for src, dst in zip(sources, destinations):
        if src is dst:
            dst.mul_(scale)
        else:
            dst.copy_(src * scale)


# ---- Experimental features (gated by `megatron.core.config`) ------------------------------------------------


class ExperimentalNotEnabledError(Exception):
    """Raised when experimental code runs while `megatron.core.config.ENABLE_EXPERIMENTAL` is False."""


def _warn_if_past_lifetime(name: str, introduced_with_version: str, max_lifetime: int) -> None:
    introduced = Version(introduced_with_version)
    current = Version(_mcore_version)
    if (current.major, current.minor) > (introduced.major, introduced.minor + max_lifetime):
        logger.warning("%s has reached end of life. Please migrate to a non-experimental function.", name)


def _require_experimental(name: str) -> None:
    if _config.is_experimental_enabled() is not True:
        raise ExperimentalNotEnabledError(
            f"{name} is experimental: call megatron.core.config.set_experimental_flag(True) "
            "(or pass --enable-experimental) to use it."
        )


def experimental_fn(introduced_with_version: str):
    """Decorator: the function raises ExperimentalNotEnabledError unless experimental features are on.

    A function more than three minor releases older than this library logs an end-of-life warning when
    decorated.
    """

    def decorate(func: Callable, max_lifetime: int = 3) -> Callable:
        _warn_if_past_lifetime(func.__name__, introduced_with_version, max_lifetime)

        @wraps(func)
        def wrapped(*args, **kwargs):
            _require_experimental(func.__name__)
            return func(*args, **kwargs)

        return wrapped

    return decorate


def experimental_cls(introduced_with_version: str):
    """Class decorator: constructing the class raises ExperimentalNotEnabledError unless experimental features
    are on. The class itself is returned (so `isinstance` and subclassing keep working)."""

    def decorate(cls: type, max_lifetime: int = 3) -> type:
        _warn_if_past_lifetime(cls.__name__, introduced_with_version, max_lifetime)
        original_init = cls.__init__

        @wraps(original_init)
        def guarded_init(self, *args, **kwargs):
            _require_experimental(cls.__name__)
            original_init(self, *args, **kwargs)

        cls.__init__ = guarded_init
        return cls

    return decorate


# ---- NVTX ranges (for Nsight profiles; off unless configured) -----------------------------------------------

_nvtx_enabled = False
_nvtx_range_messages: List[str] = []


def configure_nvtx_profiling(enabled: bool) -> None:
    """Turn the NVTX ranges of `nvtx_range_push` / `nvtx_range_pop` / `nvtx_decorator` on or off."""
    global _nvtx_enabled
    _nvtx_enabled = enabled


def _nvtx_caller_path() -> str:
    caller = inspect.currentframe().f_back.f_back
    return f"{caller.f_globals.get('__name__', '?')}.{caller.f_code.co_name}"


def nvtx_range_push(msg: Optional[str] = None, suffix: Optional[str] = None) -> None:
    """Open an NVTX range named `msg` (default: the calling function's module path) when profiling is on."""
    if not _nvtx_enabled:
        return
    msg = msg if msg is not None else _nvtx_caller_path()
    if suffix is not None:
        msg = f"{msg}.{suffix}"
    _nvtx_range_messages.append(msg)
    torch.cuda.nvtx.range_push(msg)


def nvtx_range_pop(msg: Optional[str] = None, suffix: Optional[str] = None) -> None:
    """Close the innermost NVTX range; with `msg`, raise ValueError (closing nothing) unless it is that range."""
    if not _nvtx_enabled:
        return
    if msg is not None and suffix is not None:
        msg = f"{msg}.{suffix}"
    last = _nvtx_range_messages[-1] if _nvtx_range_messages else None
    if msg is not None and msg != last:
        raise ValueError(f"nvtx_range_pop({msg!r}) does not match the open range {last!r}")
    if _nvtx_range_messages:
        _nvtx_range_messages.pop()
    torch.cuda.nvtx.range_pop()


def nvtx_decorator(message: Optional[str] = None, color: Optional[str] = None):
    """Decorator: run the function inside an NVTX range (`message` or its name) when profiling is on.
    `color` is accepted for Megatron's signature (torch's NVTX ranges have no colour)."""

    def decorate(func: Callable) -> Callable:
        name = message or func.__qualname__

        @wraps(func)
        def wrapped(*args, **kwargs):
            if not _nvtx_enabled:
                return func(*args, **kwargs)
            torch.cuda.nvtx.range_push(name)
            try:
                return func(*args, **kwargs)
            finally:
                torch.cuda.nvtx.range_pop()

        return wrapped

    return decorate


def prepare_input_tensors_for_wgrad_compute(grad_output: torch.Tensor, all_gathered_input: torch.Tensor):
    """Both operands of a weight-gradient GEMM made contiguous and 2-D: `[s, b, h] -> [s*b, h]` each (2-D
    operands are returned contiguous as they are)."""
    grad_output = grad_output.contiguous()
    all_gathered_input = all_gathered_input.contiguous()
    if grad_output.dim() == 3:
        # [s, b, out] -> [s*b, out]; [s, b, in] -> [s*b, in]
        grad_output = grad_output.view(grad_output.shape[0] * grad_output.shape[1], grad_output.shape[2])
        all_gathered_input = all_gathered_input.view(
            all_gathered_input.shape[0] * all_gathered_input.shape[1], all_gathered_input.shape[2])
    return grad_output, all_gathered_input


# Megatron also exposes names from here that live higher in the import graph (`get_pg_size`, ...); they
# are resolved lazily (PEP 562) from the table in `megatron.core.reexports`.
def __getattr__(name):
    return lazy_attribute(__name__, name)
