"""SwiGLU backward at the Llama-1B-s4096 shape (y [4096, 4, 11264] = [gate, up], grad [4096, 4, 5632], bf16)
on one GPU, not part of the product:

  python benchmarks/gpu/swiglu_bench.py

Variants: `torch.compile` of the product's `swiglu_back` (what a compiled layer runs: one pointwise kernel
per output element of the concatenated [d gate, d up], each reading gate and up); a Triton kernel whose
programs read a gate tile, its up tile and the grad tile once and write both gradient tiles; and a bf16
copy moving the same bytes as the minimum traffic (read y and grad, write dy) as the memory-speed yardstick.
Prints one JSON line per variant: median microseconds, TB/s on the minimum traffic, largest difference
from the fp32 formula.
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core.fusions import _compile  # noqa: E402
from megatron.core.fusions.fused_bias_swiglu import swiglu_back  # noqa: E402


@triton.jit
def _swiglu_back_tiles(g_ptr, y_ptr, out_ptr, ffn, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
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


def triton_back(g, y, block, warps):
    ffn = g.shape[-1]
    rows = g.numel() // ffn
    out = torch.empty_like(y)
    _swiglu_back_tiles[(rows, triton.cdiv(ffn, block))](g, y, out, ffn, BLOCK=block, num_warps=warps)
    return out


def main():
    torch.manual_seed(0)
    s, b, ffn = 4096, 4, 5632
    y = torch.randn(s, b, 2 * ffn, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(s, b, ffn, device="cuda", dtype=torch.bfloat16)
    reference = swiglu_back(g.float(), y.float())
    compiled = torch.compile(_compile._fresh_copy(swiglu_back), dynamic=False)
    traffic = (y.numel() * 2 + g.numel()) * 2  # bytes: read y and g, write dy
    copy_src = torch.empty(traffic // 4, device="cuda", dtype=torch.bfloat16)
    variants = {"torch.compile (product)": lambda: compiled(g, y),
                "bf16 copy of the same bytes": lambda: copy_src.clone()}
    for block, warps in ((1024, 4), (2048, 8), (512, 4), (1024, 8)):
        variants[f"triton tiles {block}/{warps}w"] = (lambda blk, w: lambda: triton_back(g, y, blk, w))(block, warps)
    for name, fn in variants.items():
        out = fn()
        error = None if out.shape != y.shape else (out.float() - reference).abs().max().item()
        us = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
        print(json.dumps({"variant": name, "us": round(us, 1), "TB/s": round(traffic / us / 1e6, 2),
                          "max_abs_err_vs_fp32": error}), flush=True)


if __name__ == "__main__":
    main()
