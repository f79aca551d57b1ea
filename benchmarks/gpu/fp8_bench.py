"""FP8 GEMMs against bf16 at the GPT-1.3B / Llama-1B linear shapes, on one GPU (not part of the product).

  python benchmarks/gpu/fp8_bench.py [--tokens 16384]

Checks first that the Triton kernels match the plain-PyTorch fallback bit for bit (amax, quantized values,
transposes, scale) and that the FP8 GEMM matches the emulated one. Then, per linear shape: median ms of
the bf16 forward / dgrad / wgrad GEMMs, of the FP8 ones, and of quantizing each operand (amax + cast,
with the transposed copy the backward needs). Prints one JSON line per shape and a per-layer summary.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.gpu.collective_bench import timed  # noqa: E402
from megatron.core.fp8 import kernels  # noqa: E402
from megatron.core.fp8.kernels import E4M3, E5M2  # noqa: E402

# (name, out features, in features) of one GPT-1.3B layer's linears
SHAPES = {"gpt1.3b": [("qkv", 6144, 2048), ("proj", 2048, 2048), ("fc1", 8192, 2048), ("fc2", 2048, 8192)],
          "llama1b": [("qkv", 4096, 2048), ("proj", 2048, 2048), ("fc1", 11264, 2048), ("fc2", 2048, 5632)]}


def _fallback_quantize(tensor, amax_, dtype, transpose):
    """The PyTorch fallback of `kernels.quantize` (run on a CPU copy), back on the GPU."""
    return tuple(None if t is None else t.cuda() for t in kernels.quantize(tensor.cpu(), amax_.cpu(), dtype,
                                                                              transpose=transpose))


def check_kernels():
    generator = torch.Generator(device="cuda").manual_seed(0)
    report = {}
    for rows, cols in ((4096, 2048), (1000, 72), (3, 5)):
        x = (torch.randn(rows, cols, device="cuda", generator=generator) * 3).to(torch.bfloat16)
        amax_ = kernels.amax(x)
        ref_amax = x.float().abs().max().reshape(1)
        for dtype in (E4M3, E5M2):
            q, q_t, inv = kernels.quantize(x, amax_, dtype, transpose=True)
            rq, rq_t, rinv = _fallback_quantize(x, ref_amax, dtype, True)
            diffs = {"amax": int(not torch.equal(amax_, ref_amax)), "scale_inv_ulps": int((inv.view(torch.int32) - rinv.view(torch.int32)).abs()),
                     "q": int((q.view(torch.uint8) != rq.view(torch.uint8)).sum()),
                     "q_t": int((q_t.view(torch.uint8) != rq_t.view(torch.uint8)).sum())}
            report[f"quantize {rows}x{cols} {dtype}"] = "bit-identical" if not any(diffs.values()) else diffs
    a = torch.randn(512, 256, device="cuda", generator=generator).to(torch.bfloat16)
    b = torch.randn(384, 256, device="cuda", generator=generator).to(torch.bfloat16)
    qa, _, ia = kernels.quantize(a, kernels.amax(a), E4M3)
    qb, _, ib = kernels.quantize(b, kernels.amax(b), E4M3)
    native = kernels.scaled_mm(qa, qb, ia, ib, torch.float32)
    emulated = torch.matmul(qa.float() * ia, (qb.float() * ib).t())
    report["scaled_mm max rel diff vs emulated"] = float((native - emulated).abs().max() / emulated.abs().max())
    report["fp8 vs bf16 GEMM rel error"] = float((native - a.float() @ b.float().t()).norm() / (a.float() @ b.float().t()).norm())
    return report


def bench_shape(tokens, out_f, in_f):
    x = torch.randn(tokens, in_f, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(tokens, out_f, device="cuda", dtype=torch.bfloat16)
    main_grad = torch.zeros(out_f, in_f, device="cuda", dtype=torch.float32)
    xq, xq_t, xi = kernels.quantize(x, kernels.amax(x), E4M3, transpose=True)
    wq, wq_t, wi = kernels.quantize(w, kernels.amax(w), E4M3, transpose=True)
    gq, gq_t, gi = kernels.quantize(dy, kernels.amax(dy), E5M2, transpose=True)
    result = {
        "bf16_fwd": timed(lambda: F.linear(x, w)),
        "bf16_dgrad": timed(lambda: dy @ w),
        "bf16_wgrad_fp32": timed(lambda: torch.addmm(main_grad, dy.t(), x, out_dtype=torch.float32, out=main_grad)),
        "fp8_fwd": timed(lambda: kernels.scaled_mm(xq, wq, xi, wi, torch.bfloat16, fast_accum=True)),
        "fp8_dgrad": timed(lambda: kernels.scaled_mm(gq, wq_t, gi, wi, torch.bfloat16)),
        "fp8_wgrad_fp32": timed(lambda: main_grad.add_(kernels.scaled_mm(gq_t, xq_t, gi, xi, torch.float32))),
        "q_input_T": timed(lambda: kernels.quantize(x, kernels.amax(x), E4M3, transpose=True)),
        "q_weight_T": timed(lambda: kernels.quantize(w, kernels.amax(w), E4M3, transpose=True)),
        "q_grad_T": timed(lambda: kernels.quantize(dy, kernels.amax(dy), E5M2, transpose=True)),
        "amax_input": timed(lambda: kernels.amax(x)),
        # delayed scaling: quantize with a known amax and record the current one in the same pass
        "q_input_T_delayed": timed(lambda: kernels.quantize(x, xi, E4M3, transpose=True,
                                                            amax_out=torch.zeros(1, device="cuda"))),
    }
    return {k: round(v, 4) for k, v in result.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "checks": check_kernels()}))
    for model, shapes in SHAPES.items():
        tokens = args.tokens
        bf16 = fp8 = quant = 0.0
        for name, out_f, in_f in shapes:
            r = bench_shape(tokens, out_f, in_f)
            flops = 2 * tokens * out_f * in_f
            r["bf16_tflops_fwd"] = round(flops / r["bf16_fwd"] / 1e9, 1)
            r["fp8_tflops_fwd"] = round(flops / r["fp8_fwd"] / 1e9, 1)
            print(json.dumps({"model": model, "linear": name, "shape": [tokens, out_f, in_f], **r}))
            bf16 += r["bf16_fwd"] + r["bf16_dgrad"] + r["bf16_wgrad_fp32"]
            fp8 += r["fp8_fwd"] + r["fp8_dgrad"] + r["fp8_wgrad_fp32"]
            quant += r["q_input_T"] + r["q_weight_T"] + r["q_grad_T"]
        print(json.dumps({"model": model, "per_layer_ms": {"bf16_gemms": round(bf16, 3), "fp8_gemms": round(fp8, 3),
                                                            "fp8_quantize": round(quant, 3),
                                                            "fp8_total": round(fp8 + quant, 3)}}))


if __name__ == "__main__":
    main()
