"""`main_grad += grad` (DDP's backward hook, the FP8 linears' weight gradients): one Triton pass for a bf16/fp16
gradient into an fp32 main_grad.

torch's `main_grad.add_(grad)` with mixed dtypes runs its non-vectorised elementwise kernel: on an H200
(2026-12-03, the MoE benchmark's expert weights, 184.5M and 92M elements) it moved 10 bytes per element at
about 2.7 TB/s, 130 ms of a 1080 ms MoE iteration. The kernel here reads the fp32 and half-precision
values in 128-bit accesses and writes the fp32 sum, the same arithmetic (the half value widened to fp32,
one fp32 add: bit-identical to torch's). Used only when Triton is installed, both tensors are contiguous
CUDA tensors of the same size and the dtypes are fp32 += bf16/fp16, outside of compilation; everything else is
`add_`. The kernel is defined only when Triton is installed, so importing this module never imports an
optional package on machines without it.
"""
import torch

from megatron.core.utils import module_available

# 4096 elements per program with 8 warps: 16 per thread, i.e. 128-bit loads of the half values (2 per
# thread) and of the fp32 values (4 per thread).
_BLOCK = 4096
_WARPS = 8
_HALF = (torch.bfloat16, torch.float16)

_HAS_TRITON = module_available("triton")

if _HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _accumulate_kernel(main_grad_ptr, grad_ptr, numel, BLOCK: tl.constexpr):
        """main_grad[i] += float(grad[i]) for one block of elements."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        total = tl.load(main_grad_ptr + offsets, mask=mask) + tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
        tl.store(main_grad_ptr + offsets, total, mask=mask)


def _uses_kernel(main_grad: torch.Tensor, grad: torch.Tensor) -> bool:
    return (_HAS_TRITON and main_grad.is_cuda and not torch.compiler.is_compiling() and grad.device == main_grad.device
            and main_grad.dtype == torch.float32 and grad.dtype in _HALF
            and main_grad.numel() == grad.numel() and main_grad.is_contiguous() and grad.is_contiguous())


def accumulate_grad_(main_grad: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """`main_grad += grad` in place (the Triton pass where it applies, see the module docstring); returns
    main_grad."""
    if not _uses_kernel(main_grad, grad):
        return main_grad.add_(grad)
    numel = main_grad.numel()
    if numel:
        _accumulate_kernel[(triton.cdiv(numel, _BLOCK),)](main_grad, grad, numel, BLOCK=_BLOCK, num_warps=_WARPS)
    return main_grad


__all__ = ["accumulate_grad_"]
