"""Grouped GEMM for the experts: `ops.gmm(a, b, batch_sizes)` multiplies consecutive row groups of `a` by
their own matrix of `b` (Megatron's `grouped_gemm_util` names; no `grouped_gemm` package is needed).

`a` [N, K], `b` [G, K, M] (or [G, M, K] with trans_b), batch_sizes [G] rows per group (host tensor or list,
or a device tensor, as the dispatchers return it) -> [N, M]. On CUDA the product is one `torch._grouped_mm`
call (forward and backward) where that kernel works for the dtype and shapes: it is probed once per
(device, dtype) against the loop below on small tensors (zero-row group included). Elsewhere, including CPU,
it is a loop of matmuls over the groups (device sizes are read to the host there), which gives every
group's matrix a gradient (zero for an empty group). A CUDA fallback is logged once per (device, dtype).
"""
import logging
from types import SimpleNamespace
from typing import Dict, Tuple

import torch

from megatron.core.tensor_parallel.wgrad_accumulation import _main_grad_placeholder
from megatron.core.transformer.moe import _triton_grouped_wgrad
from megatron.core.utils import module_available

logger = logging.getLogger(__name__)

_HAS_TRITON = module_available("triton")

# (device, dtype) -> whether torch._grouped_mm matched the reference there
_GROUPED_MM_SUPPORT: Dict[Tuple[torch.device, torch.dtype], bool] = {}
_FALLBACK_LOGGED = set()
# torch._grouped_mm needs 16-byte aligned row strides
_ALIGN_BYTES = 16


def grouped_gemm_is_available() -> bool:
    """The native grouped GEMM is always available."""
    return True


def assert_grouped_gemm_is_available() -> None:
    """Kept for Megatron compatibility: nothing to check (no external package)."""


def _loop_gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes, trans_b: bool) -> torch.Tensor:
    sizes = batch_sizes.tolist() if torch.is_tensor(batch_sizes) else list(batch_sizes)
    outputs = []
    for group, rows in enumerate(torch.split(a, sizes)):
        weight = b[group].t() if trans_b else b[group]
        outputs.append(rows @ weight)  # [n_g, K] x [K, M] -> [n_g, M]
    return torch.cat(outputs, dim=0)


def _offsets(batch_sizes, device) -> torch.Tensor:
    if torch.is_tensor(batch_sizes) and batch_sizes.device.type == "cuda":
        # device counts: cumulative end offsets computed there (no host wait)
        return torch.cumsum(batch_sizes, 0, dtype=torch.int32)
    sizes = batch_sizes if torch.is_tensor(batch_sizes) else torch.tensor(list(batch_sizes))
    # rows per group -> cumulative end offsets, int32 on the device (from pinned memory: no host wait)
    offsets = torch.cumsum(sizes.to(device="cpu", dtype=torch.int64), 0).to(torch.int32)
    return offsets.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else offsets


def _torch_gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes, trans_b: bool) -> torch.Tensor:
    weight = b.transpose(-2, -1) if trans_b else b
    return torch._grouped_mm(a, weight, offs=_offsets(batch_sizes, a.device))


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    """torch._grouped_mm forward and backward against the loop, on small aligned tensors (one empty group)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(24, 32, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(3, 32, 16, generator=generator).to(device=device, dtype=dtype)
    sizes = torch.tensor([8, 0, 16])
    grad = torch.randn(24, 16, generator=generator).to(device=device, dtype=dtype)
    results = []
    try:
        # grad mode on: the first call may come from inside an autograd.Function's forward (no_grad)
        with torch.enable_grad():
            for fn in (_torch_gmm, _loop_gmm):
                a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
                out = fn(a_, b_, sizes, False)
                out.backward(grad)
                results.append((out.float(), a_.grad.float(), b_.grad.float()))
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return False
    tolerance = 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    return all(torch.allclose(x, y, rtol=tolerance, atol=tolerance) for x, y in zip(*results))


def torch_grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` computes the grouped product on `device` for `dtype` (CUDA only; probed once)."""
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm") or torch.compiler.is_compiling():
        return False
    key = (device, dtype)
    if key not in _GROUPED_MM_SUPPORT:
        _GROUPED_MM_SUPPORT[key] = _probe(device, dtype)
    return _GROUPED_MM_SUPPORT[key]


def _aligned(a: torch.Tensor, b: torch.Tensor) -> bool:
    elements = _ALIGN_BYTES // a.element_size()
    return a.shape[-1] % elements == 0 and b.shape[-1] % elements == 0 and b.shape[-2] % elements == 0


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes, trans_b: bool = False) -> torch.Tensor:
    """Grouped product `a[rows of group g] @ b[g]` (b[g]^T with trans_b) -> [N, M] (see the module docstring)."""
    if a.is_cuda:
        if torch_grouped_mm_supported(a.device, a.dtype) and _aligned(a, b):
            return _torch_gmm(a, b, batch_sizes, trans_b)
        key = (a.device, a.dtype)
        if key not in _FALLBACK_LOGGED:
            _FALLBACK_LOGGED.add(key)
            logger.warning("grouped GEMM: torch._grouped_mm is not usable for %s %s with these shapes; the experts "
                           "run as a loop of matmuls.", a.device, a.dtype)
    return _loop_gmm(a, b, batch_sizes, trans_b)


class _GroupedGemmFusedWgrad(torch.autograd.Function):
    """`torch._grouped_mm(a, weight.view(grouped_shape), offs)` whose weight gradient goes straight into the
    parameter's fp32 `main_grad` (one Triton kernel, `_triton_grouped_wgrad`) instead of a bf16 gradient that
    DDP's hook then adds; autograd gets Megatron's placeholder and `grad_added_to_main_grad` is set, as the
    tensor-parallel linears do with gradient-accumulation fusion."""

    @staticmethod
    def forward(ctx, a, weight, grouped_shape, offsets):
        """a [N, K] x weight viewed as [G, K, M] -> [N, M]."""
        ctx.save_for_backward(a, offsets)
        ctx.weight, ctx.grouped_shape = weight, grouped_shape
        return torch._grouped_mm(a, weight.view(grouped_shape), offs=offsets)

    @staticmethod
    def backward(ctx, grad_output):
        """d a = grad [N, M] x weight^T per group; main_grad[g] += a_g^T grad_g."""
        a, offsets = ctx.saved_tensors
        weight = ctx.weight
        grad_output = grad_output.contiguous()
        grad_a = None
        if ctx.needs_input_grad[0]:
            grad_a = torch._grouped_mm(grad_output, weight.view(ctx.grouped_shape).transpose(-2, -1), offs=offsets)
        _triton_grouped_wgrad.grouped_wgrad_accumulate_(weight.main_grad.view(ctx.grouped_shape), a, grad_output,
                                                        offsets)
        return grad_a, _main_grad_placeholder(weight), None, None


def fused_wgrad_supported(a: torch.Tensor, weight: torch.nn.Parameter, grouped_shape) -> bool:
    """Whether `gmm_fused_wgrad` applies: a bf16/fp16 CUDA input where `torch._grouped_mm` works, Triton, a
    weight with an fp32 `main_grad` (under Megatron's DDP), autograd recording, outside compilation."""
    main_grad = getattr(weight, "main_grad", None)
    return (a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and _HAS_TRITON
            and main_grad is not None and main_grad.dtype == torch.float32 and main_grad.is_contiguous()
            and weight.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and torch_grouped_mm_supported(a.device, a.dtype) and _aligned(a, weight.view(grouped_shape)))


def gmm_fused_wgrad(a: torch.Tensor, weight: torch.nn.Parameter, grouped_shape, batch_sizes) -> torch.Tensor:
    """`gmm(a, weight.view(grouped_shape), batch_sizes)` with the weight gradient accumulated straight into
    `weight.main_grad` (gradient-accumulation fusion for the grouped experts; see `fused_wgrad_supported`)."""
    return _GroupedGemmFusedWgrad.apply(a, weight, tuple(grouped_shape), _offsets(batch_sizes, a.device))


ops = SimpleNamespace(gmm=gmm)
"""Megatron's `grouped_gemm_util.ops` namespace: `ops.gmm(a, b, batch_sizes, trans_b=False)`."""

__all__ = ["grouped_gemm_is_available", "assert_grouped_gemm_is_available", "torch_grouped_mm_supported", "gmm",
           "fused_wgrad_supported", "gmm_fused_wgrad", "ops"]
