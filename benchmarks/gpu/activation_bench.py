"""The MLP activations' kernels on one GPU, not part of the product:

  python benchmarks/gpu/activation_bench.py

SwiGLU backward at the Llama-1B-s4096 shape (y [4096, 4, 11264] = [gate, up], grad [4096, 4, 5632], bf16):
`torch.compile` of `swiglu_back` (what a compiled layer generated before 2026-11-30 evening: one pointwise
kernel per output element of the concatenated [d gate, d up], each reading gate and up); the product's Triton
kernel (`_triton_swiglu`) and candidate tile settings of the same kernel. Bias-GELU forward and backward at
GPT-1.3B's fc1 output ([2048, 8, 8192] bf16 + bias), compiled, with tanh (the formula before 2026-11-30
evening) and with the product's sigmoid form. A bf16 copy moving the same bytes as each minimum traffic is
the memory-speed yardstick. One JSON line per variant: median microseconds, TB/s on the minimum traffic,
largest difference from the fp32 formula. (Ran as `swiglu_bench.py`, SwiGLU rows only, at 20:18.) The MoE
experts' weighted SwiGLU backward ([8192, 2 x 5632]): the compiled pair against the one-pass kernel.
"""
import json
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core.fusions import _compile  # noqa: E402
from megatron.core.fusions import _triton_swiglu  # noqa: E402
from megatron.core.fusions.fused_bias_gelu import bias_gelu, bias_gelu_back  # noqa: E402
from megatron.core.fusions.fused_bias_swiglu import swiglu_back  # noqa: E402


def tanh_gelu(bias, y):
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def tanh_gelu_back(g, bias, y):
    x = bias + y
    tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
    return ff * g


def report(name, fn, traffic, reference):
    out = fn()
    error = None if reference is None else (out.float() - reference).abs().max().item()
    us = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
    print(json.dumps({"variant": name, "us": round(us, 1), "TB/s": round(traffic / us / 1e6, 2),
                      "max_abs_err_vs_fp32": error}), flush=True)


def copy_of(traffic):
    source = torch.empty(traffic // 4, device="cuda", dtype=torch.bfloat16)  # read + write = traffic bytes
    return lambda: source.clone()


def swiglu_variants():
    s, b, ffn = 4096, 4, 5632
    y = torch.randn(s, b, 2 * ffn, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(s, b, ffn, device="cuda", dtype=torch.bfloat16)
    reference = swiglu_back(g.float(), y.float())
    compiled = torch.compile(_compile._fresh_copy(swiglu_back), dynamic=False)
    traffic = (y.numel() * 2 + g.numel()) * 2  # bytes: read y and g, write dy
    report("swiglu back: torch.compile", lambda: compiled(g, y), traffic, reference)
    report("swiglu back: product (_triton_swiglu)", lambda: _triton_swiglu.swiglu_back(g, y), traffic, reference)
    for block, warps in ((2048, 8), (512, 4)):
        report(f"swiglu back: Triton, {block} columns / {warps} warps",
               lambda: _triton_swiglu.swiglu_back(g, y, block, warps), traffic, reference)
    report("swiglu back: bf16 copy of the same bytes", copy_of(traffic), traffic, None)


def weighted_swiglu_variants():
    """The MoE experts' weighted SwiGLU backward at the MoE benchmark's shape: compiled pair vs one-pass kernel
    (the first output, d y, is compared; d w is checked by tests/unit/fusions/test_triton_weighted_swiglu.py)."""
    from megatron.core.transformer.moe import experts

    rows, ffn = 8192, 5632
    y = torch.randn(rows, 2 * ffn, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(rows, ffn, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(rows, 1, device="cuda")
    reference = experts._weighted_swiglu_backward(g.float(), y.float(), w)[0]
    traffic = (y.numel() * 2 + g.numel()) * 2 + rows * 8  # read y and g, write dy; w and d w
    report("weighted swiglu back: compiled (two kernels)", lambda: experts._weighted_swiglu_backward_fused(g, y, w)[0],
           traffic, reference)
    for block, warps in ((1024, 4), (2048, 8), (1024, 8)):
        report(f"weighted swiglu back: one-pass Triton, {block} columns / {warps} warps",
               lambda: _triton_swiglu.weighted_swiglu_back(g, y, w, block, warps)[0], traffic, reference)


def gelu_variants():
    y = torch.randn(2048, 8, 8192, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(8192, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(y)
    forward_ref = tanh_gelu(bias.float(), y.float())
    backward_ref = tanh_gelu_back(g.float(), bias.float(), y.float())
    forward_bytes, backward_bytes = y.numel() * 4, y.numel() * 6
    for name, fwd, bwd in (("tanh", tanh_gelu, tanh_gelu_back), ("sigmoid (product)", bias_gelu, bias_gelu_back)):
        fwd_c = torch.compile(_compile._fresh_copy(fwd), dynamic=False)
        bwd_c = torch.compile(_compile._fresh_copy(bwd), dynamic=False)
        report(f"gelu forward: {name}", lambda: fwd_c(bias, y), forward_bytes, forward_ref)
        report(f"gelu backward: {name}", lambda: bwd_c(g, bias, y), backward_bytes, backward_ref)
    report("gelu forward: bf16 copy of the same bytes", copy_of(forward_bytes), forward_bytes, None)
    report("gelu backward: bf16 copy of the same bytes", copy_of(backward_bytes), backward_bytes, None)


def main():
    torch.manual_seed(0)
    swiglu_variants()
    weighted_swiglu_variants()
    gelu_variants()


if __name__ == "__main__":
    main()
