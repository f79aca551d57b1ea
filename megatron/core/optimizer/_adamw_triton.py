"""Triton kernel behind `megatron.core.optimizer.fused_adamw`: one AdamW step of one fp32 main param that also
writes its fp16/bf16 model copy, each element read and written once (used only when Triton is installed and
the tensors are on a CUDA device).

Arithmetic note: the kernel repeats what torch's fused CUDA AdamW (`torch._fused_adamw_`) computes, operation
by operation and in the same precision: the moments, the weight decay and `denom + eps` in fp64 (torch mixes
its fp32 values with the fp64 hyperparameters), the grad unscale, sqrt and the divisions in fp32, exactly
rounded. The bias corrections are computed once per program in fp64 as `exp2(step * log2(beta))` (torch calls
`pow`; they differ by about 1e-15 relative before both are rounded to fp32). That is torch's CUDA source as
published in 2023; torch 2.11's kernel computes otherwise (in fp32, by its errors). On an H200 (2026-11-30,
tests/unit/optimizer/test_fused_adamw_gpu.py) against AdamW in fp64 from the same inputs, this kernel was at
most 4.8 fp32 ulps of the largest term of an update off (moments 1.0), torch 2.11's up to 855 (moments 5.4
and 6.2). `fp64_math=False` computes the fp64 parts in fp32 (fused multiply-adds), for a device where the
fp64 conversions would cost bandwidth: up to 224 ulps of the largest term where `beta * m` and
`(1 - beta) * g` cancel, like torch's fp32 kernels.

The hyperparameters travel as the int64 bit patterns of the Python floats: a float kernel argument would be
rounded to fp32. The kernel is defined only when Triton is installed, so importing this module never fails
and never imports an optional package on machines without it (CPU CI walks and imports every module).
"""
import struct
from typing import Optional

import torch

from megatron.core.utils import module_available

# Launch settings: blocks of 1024 elements, 4 per thread with 8 warps (128-bit fp32 accesses; with 8 per thread
# Triton stores fp32 in another layout than it loads and converts through shared memory), 8 blocks per
# program so that the per-program fp64 bias corrections are paid once per 8192 elements.
# benchmarks/gpu/adam_bench.py --sweep measures other settings.
_BLOCK = 1024
_WARPS = 8
_BLOCKS_PER_PROGRAM = 8
FP64_MATH = True

if module_available("triton"):
    import triton
    import triton.language as tl

    @triton.jit
    def _as_float64(bits):
        """The fp64 whose bit pattern is `bits` (an int32 or int64 scalar)."""
        return bits.to(tl.int64).to(tl.float64, bitcast=True)

    @triton.jit
    def _adamw_update(param, grad, exp_avg, exp_avg_sq, lr_wd, beta1, beta2, eps, step_size, bias_correction2_sqrt,
                      HAS_WEIGHT_DECAY: tl.constexpr, FP64_MATH: tl.constexpr):
        """(param, exp_avg, exp_avg_sq) after one step, all fp32; the scalars are fp64 except the last two."""
        if FP64_MATH:
            if HAS_WEIGHT_DECAY:
                param64 = param.to(tl.float64)
                param = (param64 - lr_wd * param64).to(tl.float32)
            grad64 = grad.to(tl.float64)
            exp_avg = (beta1 * exp_avg.to(tl.float64) + (1 - beta1) * grad64).to(tl.float32)
            exp_avg_sq = (beta2 * exp_avg_sq.to(tl.float64) + (1 - beta2) * grad64 * grad64).to(tl.float32)
            root = tl.math.div_rn(tl.sqrt_rn(exp_avg_sq), bias_correction2_sqrt)
            denom = (root.to(tl.float64) + eps).to(tl.float32)
        else:
            if HAS_WEIGHT_DECAY:
                param = param - lr_wd.to(tl.float32) * param
            exp_avg = beta1.to(tl.float32) * exp_avg + (1 - beta1).to(tl.float32) * grad
            exp_avg_sq = beta2.to(tl.float32) * exp_avg_sq + (1 - beta2).to(tl.float32) * grad * grad
            denom = tl.math.div_rn(tl.sqrt_rn(exp_avg_sq), bias_correction2_sqrt) + eps.to(tl.float32)
        param = param - tl.math.div_rn(step_size * exp_avg, denom)
        return param, exp_avg, exp_avg_sq

    @triton.jit
    def _step_block(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, model_ptr, offsets, mask, grad_out_mask,
                    grad_scale, lr_wd, beta1, beta2, eps, step_size, bias_correction2_sqrt,
                    HAS_GRAD_SCALE: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr, FP64_MATH: tl.constexpr):
        """Load, update and store one block of elements."""
        grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0)
        if HAS_GRAD_SCALE:
            grad = tl.math.div_rn(grad, grad_scale)
            tl.store(grad_ptr + offsets, grad, mask=grad_out_mask)
        param, exp_avg, exp_avg_sq = _adamw_update(
            tl.load(param_ptr + offsets, mask=mask, other=0.0), grad,
            tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0),
            tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0),
            lr_wd, beta1, beta2, eps, step_size, bias_correction2_sqrt, HAS_WEIGHT_DECAY, FP64_MATH)
        tl.store(param_ptr + offsets, param, mask=mask)
        tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
        tl.store(model_ptr + offsets, param.to(model_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["lr_bits", "beta1_bits", "beta2_bits", "weight_decay_bits", "eps_bits"])
    def _adamw_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, model_ptr, step_ptr, grad_scale_ptr,
                      found_inf_ptr, n, lr_bits, beta1_bits, beta2_bits, weight_decay_bits, eps_bits,
                      HAS_GRAD_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr,
                      FP64_MATH: tl.constexpr, BLOCK: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr):
        """One AdamW step of `n` elements; the hyperparameters are fp64 bit patterns (see the module notes)."""
        lr = _as_float64(lr_bits)
        beta1 = _as_float64(beta1_bits)
        beta2 = _as_float64(beta2_bits)
        eps = _as_float64(eps_bits)
        lr_wd = lr * _as_float64(weight_decay_bits)
        # torch: fp64 bias corrections of the (already incremented) step, rounded to fp32; the step size
        # divides the fp64 lr by the fp32 correction.
        step = tl.load(step_ptr).to(tl.float64)
        bias_correction1 = (1 - tl.exp2(step * tl.log2(beta1))).to(tl.float32)
        bias_correction2_sqrt = tl.sqrt(1 - tl.exp2(step * tl.log2(beta2))).to(tl.float32)
        step_size = (lr / bias_correction1.to(tl.float64)).to(tl.float32)
        if HAS_FOUND_INF:
            n = n * (tl.load(found_inf_ptr) != 1.0).to(n.dtype)  # torch skips the whole update where it is 1
        grad_scale = 1.0
        write_grad = 0
        if HAS_GRAD_SCALE:
            grad_scale = tl.load(grad_scale_ptr)
            # The unscaled grad is written back like torch's kernel does, except where it cannot differ.
            write_grad = (grad_scale != 1.0).to(tl.int32)
        # Each program takes BLOCKS_PER_PROGRAM consecutive blocks (the fp64 bias corrections above are paid
        # once for all of them). Full blocks carry masks that are constant over them (`full_end` is a
        # multiple of BLOCK), so that their accesses are vectorized whatever `n` is; the last, partial block
        # follows in the program whose range holds it.
        num_full = n // BLOCK
        full_end = num_full * BLOCK
        first = tl.program_id(0) * BLOCKS_PER_PROGRAM
        for block in range(first, tl.minimum(first + BLOCKS_PER_PROGRAM, num_full)):
            offsets = tl.cast(block, tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: tensors of 2**31 and more
            _step_block(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, model_ptr, offsets, offsets < full_end,
                        offsets < full_end * write_grad, grad_scale, lr_wd, beta1, beta2, eps, step_size,
                        bias_correction2_sqrt, HAS_GRAD_SCALE, HAS_WEIGHT_DECAY, FP64_MATH)
        if tl.program_id(0) == num_full // BLOCKS_PER_PROGRAM:
            offsets = tl.cast(full_end, tl.int64) + tl.arange(0, BLOCK)
            _step_block(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, model_ptr, offsets, offsets < n,
                        offsets < n * write_grad, grad_scale, lr_wd, beta1, beta2, eps, step_size,
                        bias_correction2_sqrt, HAS_GRAD_SCALE, HAS_WEIGHT_DECAY, FP64_MATH)


def _float_bits(value: float) -> int:
    """The IEEE fp64 bit pattern of `value` as a signed 64-bit integer."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               model_param: torch.Tensor, step: torch.Tensor, *, lr: float, beta1: float, beta2: float,
               weight_decay: float, eps: float, grad_scale: Optional[torch.Tensor] = None,
               found_inf: Optional[torch.Tensor] = None, fp64_math: bool = FP64_MATH, block: int = _BLOCK,
               num_warps: int = _WARPS, blocks_per_program: int = _BLOCKS_PER_PROGRAM) -> None:
    """One torch-fused-AdamW step of `param` in place (decoupled weight decay), `model_param` set to the result
    in its own dtype. All tensors contiguous with the same number of elements; `param`, `grad` and the moments
    fp32; `step` (fp32, one element) already incremented, as torch's fused kernel expects; `grad_scale` and
    `found_inf` fp32 one-element tensors or None, with torch's meaning (grad divided by `grad_scale` and written
    back; nothing updated where `found_inf` is 1)."""
    numel = param.numel()
    if numel == 0:
        return
    _adamw_kernel[(triton.cdiv(triton.cdiv(numel, block), blocks_per_program),)](
        param, grad, exp_avg, exp_avg_sq, model_param, step,
        grad_scale if grad_scale is not None else step, found_inf if found_inf is not None else step, numel,
        _float_bits(lr), _float_bits(beta1), _float_bits(beta2), _float_bits(weight_decay), _float_bits(eps),
        HAS_GRAD_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
        HAS_WEIGHT_DECAY=weight_decay != 0, FP64_MATH=fp64_math, BLOCK=block, BLOCKS_PER_PROGRAM=blocks_per_program,
        num_warps=num_warps)
