"""Triton kernels behind `megatron.core.fp8.kernels` (used only when Triton is installed and a CUDA tensor
is quantized). The numbers match the plain-PyTorch fallback bit for bit (IEEE division for the scale,
round-to-nearest-even conversion of clamped values).

The kernels are defined only when Triton is installed, so that importing this module never fails and
never imports an optional package on machines without it (CPU CI walks and imports every module).
"""
import torch

from megatron.core.utils import module_available

# Launch settings measured on an H200 (benchmarks/gpu/fp8_quant_sweep.py, activations of 16384 tokens): the
# quantizer moves 3.2-3.7 TB/s with them (a bf16 copy: 3.6-4.1), ~5% faster than 64x64 tiles; the amax
# kernel ~14% faster than with 4096-element blocks in at most 2048 programs.
_AMAX_BLOCK = 2048
_AMAX_WARPS = 4
_AMAX_MAX_PROGRAMS = 4096
_TILE_M, _TILE_N, _TILE_WARPS = 64, 128, 4
_RECORD_BLOCK, _RECORD_WARPS = 1024, 4  # one program reduces up to ~23k per-tile maxima

if module_available("triton"):
    import triton
    import triton.language as tl

    @triton.jit
    def _nan_aware_max(values):
        """max of a 1-D block that is NaN when any value is (`tl.max` alone skips NaNs)."""
        nans = tl.sum((values != values).to(tl.int32), axis=0)
        return tl.where(nans > 0, float("nan"), tl.max(values, axis=0))

    @triton.jit
    def _scale_of(amax_ptr, amax_len, fp8_max, margin_mult, AMAX_BLOCK: tl.constexpr):
        """fp8_max / (amax * margin_mult), exactly rounded; 1 for an amax that is 0, inf or NaN; at most the
        largest fp32 (a tiny amax). The amax is the maximum of the first `amax_len` values at `amax_ptr` (an
        amax history; AMAX_BLOCK >= amax_len, a power of two; 1: the first value alone)."""
        if AMAX_BLOCK == 1:
            amax = tl.load(amax_ptr).to(tl.float32)
        else:
            offsets = tl.arange(0, AMAX_BLOCK)
            amax = _nan_aware_max(tl.load(amax_ptr + offsets, mask=offsets < amax_len, other=0.0).to(tl.float32))
        bounded = amax * margin_mult
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
    def _quantize_kernel(x_ptr, amax_ptr, amax_len, q_ptr, qt_ptr, scale_inv_ptr, partials_ptr, M, N, fp8_max,
                         margin_mult, WRITE_T: tl.constexpr, AMAX_OUT: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, AMAX_BLOCK: tl.constexpr):
        # one grid axis (CUDA caps the second and third at 65535 programs: a [1, n] shard of 2**23+ elements
        # would not launch); tile `pid` is row tile pid // tiles_n, column tile pid % tiles_n
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(N, BLOCK_N)
        pid_m = pid // tiles_n
        pid_n = pid % tiles_n
        scale = _scale_of(amax_ptr, amax_len, fp8_max, margin_mult, AMAX_BLOCK)
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
            tl.store(partials_ptr + pid,
                     _nan_aware_max(tl.where(row_nans > 0, float("nan"), row_max)))
        if pid == 0:
            tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))

    @triton.jit
    def _record_amax_kernel(partials_ptr, n_partials, history_ptr, history_len, reference_len, BLOCK: tl.constexpr,
                            HISTORY_BLOCK: tl.constexpr):
        """Delayed scaling's bookkeeping after a quantization, in one program: the tensor's amax (the maximum of
        the quantizer's per-tile maxima) enters the history at position 0, the older entries move one place
        back; a NaN or inf amax is not recorded, the amax the quantizer used (the maximum of the first
        `reference_len` entries) is repeated instead."""
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_partials, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            partial = tl.load(partials_ptr + offsets, mask=offsets < n_partials, other=0.0)
            acc = tl.maximum(acc, partial, propagate_nan=tl.PropagateNan.ALL)
        current = _nan_aware_max(acc)
        slots = tl.arange(0, HISTORY_BLOCK)
        history = tl.load(history_ptr + slots, mask=slots < history_len, other=0.0)
        reference = tl.max(tl.where(slots < reference_len, history, 0.0), axis=0)  # entries are finite, >= 0
        recorded = tl.where((current == current) & (current < float("inf")), current, reference)
        tl.debug_barrier()  # every thread has read the history before any entry moves
        tl.store(history_ptr + slots + 1, history, mask=slots + 1 < history_len)
        tl.store(history_ptr, recorded)


def amax(tensor: torch.Tensor) -> torch.Tensor:
    """max |tensor| of a contiguous CUDA tensor, fp32 [1]: one maximum per program, then their maximum
    (atomics on one address from every program serialize)."""
    n = tensor.numel()
    programs = min(triton.cdiv(n, _AMAX_BLOCK), _AMAX_MAX_PROGRAMS)
    partials = torch.empty(programs, dtype=torch.float32, device=tensor.device)
    _amax_kernel[(programs,)](tensor, partials, n, BLOCK=_AMAX_BLOCK, num_warps=_AMAX_WARPS)
    return partials.amax().reshape(1)


def _quantize(tensor: torch.Tensor, amax_: torch.Tensor, amax_len: int, fp8_dtype: torch.dtype, margin: int,
              transpose: bool, with_partials: bool):
    """Launch the quantizer with the scale of max(amax_[:amax_len]): (q, q^T or None, scale_inv, the per-tile
    maxima of |tensor| or None)."""
    rows, cols = tensor.shape
    q = torch.empty((rows, cols), dtype=fp8_dtype, device=tensor.device)
    q_t = torch.empty((cols, rows), dtype=fp8_dtype, device=tensor.device) if transpose else None
    scale_inv = torch.empty(1, dtype=torch.float32, device=tensor.device)
    grid = (triton.cdiv(rows, _TILE_M) * triton.cdiv(cols, _TILE_N),)
    partials = torch.empty(grid[0], dtype=torch.float32, device=tensor.device) if with_partials else None
    # the format's largest finite value (448 for E4M3, 57344 for E5M2), the `kernels.FP8_MAX` entry
    fp8_max = torch.finfo(fp8_dtype).max
    _quantize_kernel[grid](tensor, amax_, amax_len, q, q_t if transpose else q, scale_inv,
                           scale_inv if partials is None else partials, rows, cols, fp8_max, 2.0 ** margin,
                           WRITE_T=transpose, AMAX_OUT=with_partials, BLOCK_M=_TILE_M, BLOCK_N=_TILE_N,
                           AMAX_BLOCK=1 if amax_len == 1 else triton.next_power_of_2(amax_len), num_warps=_TILE_WARPS)
    return q, q_t, scale_inv, partials


def quantize(tensor: torch.Tensor, amax_: torch.Tensor, fp8_dtype: torch.dtype, margin: int, transpose: bool,
             amax_out: torch.Tensor = None):
    """(q [m, n], q^T [n, m] or None, scale_inv [1]) of a contiguous 2-D CUDA tensor; with `amax_out` (fp32 [1])
    also max(amax_out, max |tensor|) into it, the tensor read once (one maximum per tile, then theirs)."""
    q, q_t, scale_inv, partials = _quantize(tensor, amax_, 1, fp8_dtype, margin, transpose, amax_out is not None)
    if amax_out is not None:
        torch.maximum(amax_out, partials.amax().reshape(1), out=amax_out)
    return q, q_t, scale_inv


def quantize_delayed(tensor: torch.Tensor, history: torch.Tensor, use_max: bool, fp8_dtype: torch.dtype, margin: int,
                     transpose: bool, record: bool):
    """`kernels.quantize_delayed` in two launches: the quantizer reads its amax from the history itself, and
    (`record`) one single-program kernel updates the history from the quantizer's per-tile maxima. Every step
    of the PyTorch version (clone, zeros, max, isfinite, where, roll, copy) is a launch of its own, ~8 per
    quantized tensor and ~1500 per Llama-1B iteration."""
    reference_len = history.numel() if use_max else 1
    q, q_t, scale_inv, partials = _quantize(tensor, history, reference_len, fp8_dtype, margin, transpose, record)
    if record:
        _record_amax_kernel[(1,)](partials, partials.numel(), history, history.numel(), reference_len,
                                  BLOCK=_RECORD_BLOCK, HISTORY_BLOCK=triton.next_power_of_2(history.numel()),
                                  num_warps=_RECORD_WARPS)
    return q, q_t, scale_inv
