"""Triton kernels behind `megatron.core.fp8.kernels` (used only when Triton is installed and a CUDA tensor
is quantized). The numbers match the plain-PyTorch fallback bit for bit (IEEE division for the scale,
round-to-nearest-even conversion of clamped values).

The kernels are defined only when Triton is installed, so that importing this module never fails and
never imports an optional package on machines without it (CPU CI walks and imports every module).
"""
import torch

from megatron.core.fp8.kernels import FP8_MAX
from megatron.core.utils import module_available

# Launch settings measured on an H200 (benchmarks/gpu/fp8_quant_sweep.py, activations of 16384 tokens): the
# quantizer moves 3.2-3.7 TB/s with them (a bf16 copy: 3.6-4.1), ~5% faster than 64x64 tiles; the amax
# kernel ~14% faster than with 4096-element blocks in at most 2048 programs.
_AMAX_BLOCK = 2048
_AMAX_WARPS = 4
_AMAX_MAX_PROGRAMS = 4096
_TILE_M, _TILE_N, _TILE_WARPS = 64, 128, 4

if module_available("triton"):
    import triton
    import triton.language as tl

    @triton.jit
    def _nan_aware_max(values):
        """max of a 1-D block that is NaN when any value is (`tl.max` alone skips NaNs)."""
        nans = tl.sum((values != values).to(tl.int32), axis=0)
        return tl.where(nans > 0, float("nan"), tl.max(values, axis=0))

    @triton.jit
    def _scale_of(amax_ptr, fp8_max, margin_mult):
        """fp8_max / (amax * margin_mult), exactly rounded; 1 for an amax that is 0, inf or NaN; at most the
        largest fp32 (a tiny amax)."""
        bounded = tl.load(amax_ptr).to(tl.float32) * margin_mult
        usable = (bounded > 0) & (bounded < float("inf"))
        scale = tl.math.div_rn(fp8_max, tl.where(usable, bounded, 1.0))
        return tl.where(usable, tl.minimum(scale, 3.4028234663852886e38), 1.0)

    @triton.jit
    def _amax_kernel(x_ptr, partials_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(pid * BLOCK, n, step):
            offsets = start.to(tl.int64) + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
        tl.store(partials_ptr + pid, _nan_aware_max(acc))

    @triton.jit
    def _quantize_kernel(x_ptr, amax_ptr, q_ptr, qt_ptr, scale_inv_ptr, partials_ptr, M, N, fp8_max, margin_mult,
                         WRITE_T: tl.constexpr, AMAX_OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        scale = _scale_of(amax_ptr, fp8_max, margin_mult)
        rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: tensors of 2**31 elements and more
        cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        x = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # a NaN stays NaN (as in the PyTorch fallback's clamp)
        y = tl.maximum(x * scale, -fp8_max, propagate_nan=tl.PropagateNan.ALL)
        y = tl.minimum(y, fp8_max, propagate_nan=tl.PropagateNan.ALL)
        q = y.to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rows[:, None] * N + cols[None, :], q, mask=mask)
        if WRITE_T:
            mask_t = (cols[:, None] < N) & (rows[None, :] < M)
            tl.store(qt_ptr + cols[:, None] * M + rows[None, :], tl.trans(q), mask=mask_t)
        if AMAX_OUT:
            row_max = tl.max(tl.abs(x), axis=1)
            row_nans = tl.sum((x != x).to(tl.int32), axis=1)
            tl.store(partials_ptr + pid_m * tl.num_programs(1) + pid_n,
                     _nan_aware_max(tl.where(row_nans > 0, float("nan"), row_max)))
        if pid_m == 0 and pid_n == 0:
            tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))


def amax(tensor: torch.Tensor) -> torch.Tensor:
    """max |tensor| of a contiguous CUDA tensor, fp32 [1]: one maximum per program, then their maximum
    (atomics on one address from every program serialize)."""
    n = tensor.numel()
    programs = min(triton.cdiv(n, _AMAX_BLOCK), _AMAX_MAX_PROGRAMS)
    partials = torch.empty(programs, dtype=torch.float32, device=tensor.device)
    _amax_kernel[(programs,)](tensor, partials, n, BLOCK=_AMAX_BLOCK, num_warps=_AMAX_WARPS)
    return partials.amax().reshape(1)


def quantize(tensor: torch.Tensor, amax_: torch.Tensor, fp8_dtype: torch.dtype, margin: int, transpose: bool,
             amax_out: torch.Tensor = None):
    """(q [m, n], q^T [n, m] or None, scale_inv [1]) of a contiguous 2-D CUDA tensor; with `amax_out` (fp32 [1])
    also max(amax_out, max |tensor|) into it, the tensor read once (one maximum per tile, then theirs)."""
    rows, cols = tensor.shape
    q = torch.empty((rows, cols), dtype=fp8_dtype, device=tensor.device)
    q_t = torch.empty((cols, rows), dtype=fp8_dtype, device=tensor.device) if transpose else None
    scale_inv = torch.empty(1, dtype=torch.float32, device=tensor.device)
    grid = (triton.cdiv(rows, _TILE_M), triton.cdiv(cols, _TILE_N))
    partials = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=tensor.device) if amax_out is not None \
        else scale_inv
    _quantize_kernel[grid](tensor, amax_, q, q_t if transpose else q, scale_inv, partials, rows, cols,
                           FP8_MAX[fp8_dtype], 2.0 ** margin, WRITE_T=transpose, AMAX_OUT=amax_out is not None,
                           BLOCK_M=_TILE_M, BLOCK_N=_TILE_N, num_warps=_TILE_WARPS)
    if amax_out is not None:
        torch.maximum(amax_out, partials.amax().reshape(1), out=amax_out)
    return q, q_t, scale_inv
