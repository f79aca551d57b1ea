"""FP8 building blocks: absolute maximum, scaled quantization (optionally also transposed) and the scaled GEMM.

Each has a Triton / `torch._scaled_mm` path for CUDA GPUs that have FP8 tensor cores (compute capability
8.9 or newer) and a plain-PyTorch path everywhere else (CPU, older GPUs, Triton missing, shapes the FP8
GEMM cannot take). Both paths compute the same numbers: the scale is `fp8_max / (amax * 2**margin)` in
fp32, one exactly rounded division (1 where amax is 0, inf or NaN), values are multiplied by it in fp32,
clamped to the format's range (NaN stays NaN) and rounded to nearest-even; the emulated GEMM multiplies
the FP8 values in fp32 and scales the product. So CPU tests check the algorithm, and a GPU test checks the
fast kernels against the fallback bit for bit.
"""
import functools
import logging
from typing import Optional, Tuple

import torch

from megatron.core.utils import module_available

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _triton_kernels():
    """The Triton kernels, compiled lazily; None when Triton is not installed."""
    if not module_available("triton"):
        return None
    from megatron.core.fp8 import _triton

    return _triton


def native_fp8_device(device: torch.device) -> bool:
    """Whether `device` runs FP8 GEMMs natively (CUDA, compute capability >= 8.9, `torch._scaled_mm`)."""
    device = torch.device(device)
    return device.type == "cuda" and _native_fp8_cuda_device(device)


@functools.lru_cache(maxsize=None)
def _native_fp8_cuda_device(device: torch.device) -> bool:
    """`native_fp8_device` of a CUDA device, asked once per device (it is asked for every FP8 GEMM)."""
    return hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(device) >= (8, 9)


def _use_triton(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and tensor.is_contiguous() and tensor.dim() == 2 and _triton_kernels() is not None


def amax(tensor: torch.Tensor) -> torch.Tensor:
    """max |tensor| as an fp32 tensor of shape [1] (no host synchronization)."""
    if _use_triton(tensor) and tensor.numel() > 0:
        return _triton_kernels().amax(tensor)
    if tensor.numel() == 0:
        return torch.zeros(1, dtype=torch.float32, device=tensor.device)
    return torch.linalg.vector_norm(tensor, ord=float("inf")).float().reshape(1)


def scale_from_amax(amax_: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """fp8_max / (amax * 2**margin) in fp32 (one exactly rounded division), shape of `amax_`: 1 where amax is
    0, inf or NaN (nothing usable to scale by), at most the largest fp32 (a tiny amax)."""
    bounded = amax_.float() * (2.0 ** margin)
    usable = (bounded > 0) & torch.isfinite(bounded)
    ones = torch.ones_like(bounded)
    # `full / bounded` (a true division): `python_float / tensor` would round twice (reciprocal, then product)
    scale = torch.full_like(bounded, FP8_MAX[fp8_dtype]).div(torch.where(usable, bounded, ones))
    return torch.where(usable, scale.clamp_max(torch.finfo(torch.float32).max), ones)


def quantize(tensor: torch.Tensor, amax_: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0,
             transpose: bool = False, amax_out: Optional[torch.Tensor] = None
             ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Quantize a 2-D tensor [m, n] with the scale that `amax_` ([1], fp32) gives.

    Returns (q [m, n], q^T [n, m] contiguous or None, scale_inv [1] fp32), so that q * scale_inv ~ tensor.
    With `amax_out` (fp32 [1]) max(amax_out, max |tensor|) is also written there, in the same pass over the
    tensor on GPU (delayed scaling quantizes with an older amax and records the current one).
    """
    if tensor.dim() != 2:
        raise ValueError(f"quantize takes a 2-D tensor, got shape {tuple(tensor.shape)}")
    if _use_triton(tensor) and tensor.numel() > 0:
        return _triton_kernels().quantize(tensor, amax_, fp8_dtype, margin, transpose, amax_out)
    if amax_out is not None:
        torch.maximum(amax_out, amax(tensor), out=amax_out)
    scale = scale_from_amax(amax_, fp8_dtype, margin)
    limit = FP8_MAX[fp8_dtype]
    q = (tensor.float() * scale).clamp_(-limit, limit).to(fp8_dtype)
    q_t = q.t().contiguous() if transpose else None
    return q, q_t, torch.ones_like(scale).div(scale)


def record_amax(history: torch.Tensor, current: torch.Tensor, reference: torch.Tensor) -> None:
    """Delayed scaling's history update, in place: the entries move one place back and `current` ([1]) enters
    at position 0; a NaN or inf `current` is not recorded, `reference` (the amax that was used) is repeated."""
    if history.numel() > 1:
        history.copy_(torch.roll(history, 1))
    history[:1].copy_(torch.where(torch.isfinite(current), current, reference))


def quantize_delayed(tensor: torch.Tensor, history: torch.Tensor, use_max: bool, fp8_dtype: torch.dtype,
                     margin: int = 0, transpose: bool = False, record: bool = True, amax_reduce=None
                     ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Quantize a 2-D tensor with delayed scaling: the scale comes from `history` (fp32 [H]; its maximum with
    `use_max`, else its first entry) and, with `record`, the tensor's own amax then enters the history
    (`record_amax`). `amax_reduce(amax) -> amax`, when given, reduces that amax over the ranks that hold
    shards of the tensor before it is recorded. On GPU without `amax_reduce` this is two kernels.
    Returns (q, q^T or None, scale_inv) as `quantize` does."""
    if tensor.dim() != 2:
        raise ValueError(f"quantize_delayed takes a 2-D tensor, got shape {tuple(tensor.shape)}")
    if amax_reduce is None and _use_triton(tensor) and tensor.numel() > 0 and history.is_contiguous():
        return _triton_kernels().quantize_delayed(tensor, history, use_max, fp8_dtype, margin, transpose, record)
    reference = history.max().reshape(1) if use_max else history[:1].clone()
    if not record:
        return quantize(tensor, reference, fp8_dtype, margin, transpose)
    current = torch.zeros(1, dtype=torch.float32, device=tensor.device)
    quantized = quantize(tensor, reference, fp8_dtype, margin, transpose, amax_out=current)
    if amax_reduce is not None:
        current = amax_reduce(current)
    record_amax(history, current, reference)
    return quantized


_WARNED_DEVICES = set()


def warn_emulated_fp8_gemm(device: torch.device) -> None:
    """One warning per CUDA device whose FP8 GEMMs run as fp32 matmuls (no FP8 tensor cores, or a shape that
    is not a multiple of 16): correct, but slower than bf16."""
    if device.type == "cuda" and device not in _WARNED_DEVICES:
        _WARNED_DEVICES.add(device)
        logger.warning("FP8 GEMMs on %s are emulated in fp32 (FP8 tensor cores need compute capability 8.9+ and "
                       "dimensions divisible by 16): slower than bf16; drop --fp8-format on this GPU.", device)


def _native_gemm_shapes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return all(size % 16 == 0 for size in (a.shape[0], a.shape[1], b.shape[0]))


def scaled_mm(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
              out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None, fast_accum: bool = False) -> torch.Tensor:
    """(a * a_scale_inv) [m, k] @ ((b * b_scale_inv) [n, k])^T (+ bias [n]) -> [m, n] in `out_dtype`.

    Both operands are row-major FP8 ([m, k] and [n, k], the layout Hopper's FP8 GEMM takes); not both E5M2.
    `fast_accum` lets the GEMM accumulate in reduced precision (the forward GEMM's choice in Transformer
    Engine; gradients use full accumulation).
    """
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"scaled_mm: inner dimensions differ: a {tuple(a.shape)}, b {tuple(b.shape)}")
    if native_fp8_device(a.device) and _native_gemm_shapes(a, b):
        fused_bias = bias if bias is not None and bias.dtype == out_dtype and out_dtype != torch.float32 else None
        out = torch._scaled_mm(a, b.t(), scale_a=a_scale_inv.reshape(()), scale_b=b_scale_inv.reshape(()),
                               bias=fused_bias, out_dtype=out_dtype, use_fast_accum=fast_accum)
        if bias is not None and fused_bias is None:
            out = out + bias.to(out_dtype)
        return out
    warn_emulated_fp8_gemm(a.device)
    # [m, k] @ [k, n] -> [m, n] on the FP8 values (exact in fp32, and in TF32 should a GPU use it), then scaled
    out = torch.matmul(a.float(), b.float().t()) * (a_scale_inv * b_scale_inv)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
