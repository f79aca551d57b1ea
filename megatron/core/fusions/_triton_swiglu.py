"""Triton kernels behind `fused_bias_swiglu`'s backward on CUDA: the gradient of silu(gate) * up, and of the
MoE experts' probability-weighted silu(gate) * up * w (with d w, in one pass).

`torch.compile` turns the backward into one pointwise kernel over the concatenated [d gate, d up], in which
the threads of each half load both gate and up; on an H200 at the Llama-1B shape ([16384, 2 x 5632], bf16)
it moved 3.0 TB/s. Here each program reads a tile of gate, the matching tile of up and of the incoming
gradient once and writes both gradient tiles: 4.0 TB/s, a bf16 copy of the same bytes 4.2
(`benchmarks/gpu/activation_bench.py`, docs/performance.md). Arithmetic in fp32, one rounding at the end, as
the compiled kernel does. The weighted kernel replaces the compiled pair the experts had (a pointwise kernel
at 2.6 TB/s and a separate reduction for d w that re-read g and y: 180 + 68 us a call at the MoE benchmark's
[8192, 2 x 5632] in an H200 profile, 2026-12-03); each of its programs walks one row.

Defined only where Triton is installed, so importing this module never fails (CPU CI imports every module).
"""
import torch

from megatron.core.utils import module_available

_BLOCK, _WARPS = 1024, 4  # measured: 512-2048 columns and 4 or 8 warps within 1%
_HAVE_TRITON = module_available("triton")  # asked once: `usable` runs inside compiled layers

if _HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _swiglu_back_kernel(g_ptr, y_ptr, out_ptr, ffn, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # int64: rows * 2 * ffn may pass 2**31
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < ffn
        gate = tl.load(y_ptr + row * 2 * ffn + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(y_ptr + row * 2 * ffn + ffn + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * ffn + cols, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        d_gate = g * up * (sig * (1 + gate * (1 - sig)))
        d_up = g * (gate * sig)
        tl.store(out_ptr + row * 2 * ffn + cols, d_gate.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + row * 2 * ffn + ffn + cols, d_up.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _weighted_swiglu_back_kernel(g_ptr, y_ptr, w_ptr, out_ptr, dw_ptr, ffn, BLOCK: tl.constexpr):
        """One row: [d gate, d up] of silu(gate) * up * w from g, and d w = sum(g * silu(gate) * up)."""
        row = tl.program_id(0).to(tl.int64)  # int64: rows * 2 * ffn may pass 2**31
        w = tl.load(w_ptr + row).to(tl.float32)
        partial = tl.full((BLOCK,), 0.0, dtype=tl.float32)
        for start in range(0, ffn, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < ffn
            gate = tl.load(y_ptr + row * 2 * ffn + cols, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(y_ptr + row * 2 * ffn + ffn + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + row * ffn + cols, mask=mask, other=0.0).to(tl.float32)
            sig = 1.0 / (1.0 + tl.exp(-gate))  # tl.sigmoid's formula, written out: the interpreter test runs it
            silu = gate * sig
            weighted = g * w
            d_gate = weighted * up * sig * (1 + gate * (1 - sig))
            d_up = weighted * silu
            tl.store(out_ptr + row * 2 * ffn + cols, d_gate.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(out_ptr + row * 2 * ffn + ffn + cols, d_up.to(out_ptr.dtype.element_ty), mask=mask)
            partial += g * silu * up  # masked columns load gate = 0, so silu = 0
        tl.store(dw_ptr + row, tl.sum(partial, axis=0).to(dw_ptr.dtype.element_ty))


def usable(g: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the kernel takes these operands: contiguous CUDA tensors of one floating dtype, y [..., 2f] and
    g [..., f] with the same leading dimensions."""
    return (_HAVE_TRITON and g.is_cuda and y.is_cuda and g.dtype == y.dtype
            and g.dtype in (torch.bfloat16, torch.float16, torch.float32) and g.is_contiguous() and y.is_contiguous()
            and y.dim() >= 1 and y.shape[:-1] == g.shape[:-1] and y.shape[-1] == 2 * g.shape[-1] and g.numel() > 0)


def swiglu_back(g: torch.Tensor, y: torch.Tensor, block: int = _BLOCK, num_warps: int = _WARPS) -> torch.Tensor:
    """[d gate, d up] (shaped like y) for y = [gate, up] and the gradient g of silu(gate) * up; `usable` first.
    `block` columns per program (a power of two) and `num_warps`: launch settings (the benchmark varies them)."""
    ffn = g.shape[-1]
    out = torch.empty_like(y)
    _swiglu_back_kernel[(g.numel() // ffn, triton.cdiv(ffn, block))](g, y, out, ffn, BLOCK=block, num_warps=num_warps)
    return out


def weighted_usable(g: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether `weighted_swiglu_back` takes these operands: `usable(g, y)` on 2-D [N, f] / [N, 2f] operands and
    one contiguous CUDA weight per row ([N] or [N, 1], any floating dtype)."""
    return (usable(g, y) and g.dim() == 2 and weights.is_cuda and weights.is_contiguous()
            and weights.is_floating_point() and weights.numel() == g.shape[0])


def weighted_swiglu_back(g: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, block: int = _BLOCK,
                         num_warps: int = _WARPS):
    """(d y shaped like y, d weights shaped like weights) of silu(gate) * up * w for y = [gate, up] [N, 2f],
    weights [N, 1] and the output gradient g [N, f]; one program per row, fp32 arithmetic, d weights summed in
    fp32 and rounded once to the weights' dtype. `weighted_usable` first."""
    rows, ffn = g.shape
    out = torch.empty_like(y)
    weights_grad = torch.empty_like(weights)
    _weighted_swiglu_back_kernel[(rows,)](g, y, weights, out, weights_grad, ffn, BLOCK=block, num_warps=num_warps)
    return out, weights_grad
