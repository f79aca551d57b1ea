"""Triton kernels behind `megatron.core.fp8.kernels` (used only when Triton is installed and a CUDA tensor
is quantized). The numbers match the plain-PyTorch fallback bit for bit (IEEE division for the scale,
round-to-nearest-even conversion of clamped values).

The kernels are defined only when Triton is installed, so that importing this module never fails and
never imports an optional package on machines without it (CPU CI walks and imports every module).
"""
import torch

from megatron.core.fp8.kernels import FP8_MAX
from megatron.core.utils import module_available

_AMAX_BLOCK = 4096
_AMAX_MAX_PROGRAMS = 2048
_TILE = 64

if module_available("triton"):
    import triton
    import triton.language as tl

    @triton.jit
    def _amax_kernel(x_ptr, partials_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(pid * BLOCK, n, step):
            offsets = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.abs(x))
        tl.store(partials_ptr + pid, tl.max(acc, axis=0))

    @triton.jit
    def _quantize_kernel(x_ptr, amax_ptr, q_ptr, qt_ptr, scale_inv_ptr, partials_ptr, M, N, fp8_max, margin_mult,
                         WRITE_T: tl.constexpr, AMAX_OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        bounded = tl.load(amax_ptr).to(tl.float32) * margin_mult
        scale = tl.where(bounded > 0, tl.math.div_rn(fp8_max, tl.maximum(bounded, 1.1754943508222875e-38)), 1.0)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        x = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(x * scale, -fp8_max), fp8_max)
        q = y.to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rows[:, None] * N + cols[None, :], q, mask=mask)
        if WRITE_T:
            mask_t = (cols[:, None] < N) & (rows[None, :] < M)
            tl.store(qt_ptr + cols[:, None] * M + rows[None, :], tl.trans(q), mask=mask_t)
        if AMAX_OUT:
            tl.store(partials_ptr + pid_m * tl.num_programs(1) + pid_n, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
        if pid_m == 0 and pid_n == 0:
            tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))


def amax(tensor: torch.Tensor) -> torch.Tensor:
    """max |tensor| of a contiguous CUDA tensor, fp32 [1]: one maximum per program, then their maximum
    (atomics on one address from every program serialize)."""
    n = tensor.numel()
    programs = min(triton.cdiv(n, _AMAX_BLOCK), _AMAX_MAX_PROGRAMS)
    partials = torch.empty(programs, dtype=torch.float32, device=tensor.device)
    _amax_kernel[(programs,)](tensor, partials, n, BLOCK=_AMAX_BLOCK)
    return partials.amax().reshape(1)


def quantize(tensor: torch.Tensor, amax_: torch.Tensor, fp8_dtype: torch.dtype, margin: int, transpose: bool,
             amax_out: torch.Tensor = None):
    """(q [m, n], q^T [n, m] or None, scale_inv [1]) of a contiguous 2-D CUDA tensor; with `amax_out` (fp32 [1])
    also max(amax_out, max |tensor|) into it, the tensor read once (one maximum per tile, then theirs)."""
    rows, cols = tensor.shape
    q = torch.empty((rows, cols), dtype=fp8_dtype, device=tensor.device)
    q_t = torch.empty((cols, rows), dtype=fp8_dtype, device=tensor.device) if transpose else None
    scale_inv = torch.empty(1, dtype=torch.float32, device=tensor.device)
    grid = (triton.cdiv(rows, _TILE), triton.cdiv(cols, _TILE))
    partials = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=tensor.device) if amax_out is not None \
        else scale_inv
    _quantize_kernel[grid](tensor, amax_, q, q_t if transpose else q, scale_inv, partials, rows, cols,
                           FP8_MAX[fp8_dtype], 2.0 ** margin, WRITE_T=transpose, AMAX_OUT=amax_out is not None,
                           BLOCK_M=_TILE, BLOCK_N=_TILE)
    if amax_out is not None:
        torch.maximum(amax_out, partials.amax().reshape(1), out=amax_out)
    return q, q_t, scale_inv
