"""Whether a Triton GEMM with the MLP activation in its epilogue beats cuBLAS + a separate activation kernel.
Not part of the product:

  python benchmarks/gpu/gemm_epilogue_bench.py [--quick]

GPT-1.3B's MLP (tokens 16384, hidden 2048, ffn 8192, bf16) spends ~3.6 ms per iteration in the bias-GELU
forward kernel and ~4.9 ms in its backward, both memory-bound passes over the [16384, 8192] fc1 output.
Both could ride on a GEMM: the fc1 forward GEMM can add the bias and write z and gelu(z) from its
accumulator, and the fc2 input-gradient GEMM (same shape: [16384, 2048] @ [2048, 8192]) can multiply by
gelu'(z) before it stores. That only pays if the Triton GEMM is within a few percent of cuBLAS. This script
measures, per variant, the median microseconds and TFLOP/s (GEMM FLOPs only):
- cuBLAS `torch.mm` alone, and followed by the product's compiled bias-GELU forward/backward;
- the persistent Triton GEMM (TMA descriptors) alone and with each epilogue, for several tile settings;
- cuBLAS vs cuBLASLt (`torch.backends.cuda.preferred_blas_library`) on every layer GEMM of GPT-1.3B and
  Llama-1B-s4096 (forward, input gradient, weight gradient);
- the forward and input-gradient GEMMs with the weight operand as the product passes it and transposed
  (`operand_layouts`).
One JSON line per measurement; correctness of each Triton variant against the fp32 formula is printed too.
"""
import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl
import triton.testing
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core.fusions.fused_bias_gelu import bias_gelu, bias_gelu_back  # noqa: E402

_SQRT_2_OVER_PI = 0.7978845608028654


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    in_group = GROUP_M * num_pid_n
    group = tile_id // in_group
    first_m = group * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % in_group) % size_m
    pid_n = (tile_id % in_group) // size_m
    return pid_m, pid_n


@triton.jit
def _gelu_parts(z):
    u2 = 2.0 * 0.7978845608028654 * (z + 0.044715 * z * z * z)
    s = tl.sigmoid(u2)
    return s, u2


@triton.jit
def _epilogue(acc, m0, n0, c_desc, z_desc, bias_ptr, N, EPI: tl.constexpr, BN: tl.constexpr):
    if EPI == 0:
        c_desc.store([m0, n0], acc.to(tl.bfloat16))
    elif EPI == 1:
        cols = n0 + tl.arange(0, BN)
        bias = tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        z = (acc + bias[None, :]).to(tl.bfloat16)
        z_desc.store([m0, n0], z)
        zf = z.to(tl.float32)
        s, _ = _gelu_parts(zf)
        c_desc.store([m0, n0], (zf * s).to(tl.bfloat16))
    else:
        zf = z_desc.load([m0, n0]).to(tl.float32)
        s, _ = _gelu_parts(zf)
        du = 2.0 * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * zf * zf)
        grad = s + zf * s * (1.0 - s) * du
        c_desc.store([m0, n0], (acc * grad).to(tl.bfloat16))


@triton.jit
def _persistent_gemm(a_desc, b_desc, c_desc, z_desc, bias_ptr, M, N, K,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                     NUM_SMS: tl.constexpr, B_NK: tl.constexpr, EPI: tl.constexpr, WS: tl.constexpr,
                     SUBTILE: tl.constexpr):
    """C [M, N] = A [M, K] @ B, B given as [N, K] (B_NK, a Linear weight) or [K, N]; epilogue EPI."""
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    num_tiles = num_pid_m * num_pid_n
    for tile_id in tl.range(start, num_tiles, NUM_SMS, flatten=True, warp_specialize=WS):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        m0 = pid_m * BM
        n0 = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([m0, ki * BK])
            if B_NK:
                b = b_desc.load([n0, ki * BK])
                acc = tl.dot(a, b.T, acc)
            else:
                b = b_desc.load([ki * BK, n0])
                acc = tl.dot(a, b, acc)
        if SUBTILE:
            halves = tl.reshape(acc, (BM, 2, BN // 2))
            halves = tl.permute(halves, (0, 2, 1))
            left, right = tl.split(halves)
            _epilogue(left, m0, n0, c_desc, z_desc, bias_ptr, N, EPI, BN // 2)
            _epilogue(right, m0, n0 + BN // 2, c_desc, z_desc, bias_ptr, N, EPI, BN // 2)
        else:
            _epilogue(acc, m0, n0, c_desc, z_desc, bias_ptr, N, EPI, BN)


def triton_gemm(a, b, b_nk, epi, cfg, c=None, z=None, bias=None):
    """Launch the persistent GEMM; returns a closure that runs it (descriptors built once)."""
    BM, BN, BK, stages, warps, ws, subtile = cfg
    M, K = a.shape
    N = b.shape[0] if b_nk else b.shape[1]
    c = torch.empty(M, N, device=a.device, dtype=torch.bfloat16) if c is None else c
    if z is None:
        z = torch.empty(M, N, device=a.device, dtype=torch.bfloat16)
    epi_bn = BN // 2 if subtile else BN
    a_desc = TensorDescriptor.from_tensor(a, [BM, BK])
    b_desc = TensorDescriptor.from_tensor(b, [BN, BK] if b_nk else [BK, BN])
    c_desc = TensorDescriptor.from_tensor(c, [BM, epi_bn])
    z_desc = TensorDescriptor.from_tensor(z, [BM, epi_bn])
    bias = torch.zeros(N, device=a.device, dtype=torch.bfloat16) if bias is None else bias
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    grid = (min(sms, triton.cdiv(M, BM) * triton.cdiv(N, BN)),)

    def run():
        _persistent_gemm[grid](a_desc, b_desc, c_desc, z_desc, bias, M, N, K, BM=BM, BN=BN, BK=BK, GROUP_M=8,
                               NUM_SMS=sms, B_NK=b_nk, EPI=epi, WS=ws, SUBTILE=subtile,
                               num_stages=stages, num_warps=warps)
        return c
    return run, c, z


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median") * 1e3


def emit(**row):
    print(json.dumps(row), flush=True)


CONFIGS = [
    (128, 256, 64, 3, 8, False, True),
    (128, 256, 64, 4, 8, False, True),
    (128, 256, 64, 3, 8, True, True),
    (128, 128, 64, 4, 8, False, False),
    (128, 128, 64, 4, 4, True, False),
    (128, 256, 64, 3, 8, False, False),
]


def gelu_mlp(quick):
    M, K, N = 16384, 2048, 8192
    flops = 2 * M * N * K
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02   # fc1 weight [out, in]
    b1 = torch.randn(N, device="cuda", dtype=torch.bfloat16) * 0.1
    dy = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) * 0.02   # fc2 weight [out, in]
    fwd_gelu = torch.compile(bias_gelu, dynamic=False)
    bwd_gelu = torch.compile(bias_gelu_back, dynamic=False)
    y_ref = torch.mm(x, w1.t())
    z_ref = (y_ref.float() + b1.float())
    post_ref = z_ref * torch.sigmoid(2 * _SQRT_2_OVER_PI * (z_ref + 0.044715 * z_ref ** 3))
    dpost_ref = torch.mm(dy, w2)
    us = bench(lambda: torch.mm(x, w1.t()))
    emit(case="fc1 fwd", variant="cublas mm", us=round(us, 1), tflops=round(flops / us / 1e6, 1))
    us = bench(lambda: fwd_gelu(b1, torch.mm(x, w1.t())))
    emit(case="fc1 fwd", variant="cublas mm + compiled bias_gelu", us=round(us, 1))
    us = bench(lambda: torch.mm(dy, w2))
    emit(case="fc2 dgrad", variant="cublas mm", us=round(us, 1), tflops=round(flops / us / 1e6, 1))
    z_bf = z_ref.to(torch.bfloat16)
    y_bf = y_ref
    us = bench(lambda: bwd_gelu(torch.mm(dy, w2), b1, y_bf))
    emit(case="fc2 dgrad", variant="cublas mm + compiled bias_gelu_back", us=round(us, 1))
    dz_ref = bias_gelu_back(dpost_ref.float(), b1.float(), y_ref.float())
    for cfg in CONFIGS[:2] if quick else CONFIGS:
        for case, epi, a, b, b_nk in (("fc1 fwd", 0, x, w1, True), ("fc1 fwd", 1, x, w1, True),
                                      ("fc2 dgrad", 0, dy, w2, False), ("fc2 dgrad", 2, dy, w2, False)):
            try:
                run, c, z = triton_gemm(a, b, b_nk, epi, cfg, z=z_bf.clone() if epi == 2 else None, bias=b1)
                run()
                torch.cuda.synchronize()
            except Exception as exc:  # a tile setting the compiler rejects is reported, not fatal
                emit(case=case, variant=f"triton epi{epi}", cfg=cfg, error=repr(exc)[:300])
                continue
            ref = {("fc1 fwd", 0): y_ref.float(), ("fc1 fwd", 1): post_ref, ("fc2 dgrad", 0): dpost_ref.float(),
                   ("fc2 dgrad", 2): dz_ref}[(case, epi)]
            err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
            us = bench(run)
            emit(case=case, variant=f"triton epi{epi}", cfg=cfg, us=round(us, 1),
                 tflops=round(flops / us / 1e6, 1), rel_err=round(err, 5))


def layer_shapes():
    """(name, M, N, K) of every layer GEMM: forward y = x W^T, input grad dx = dy W, weight grad dW = dy^T x."""
    shapes = []
    for model, t, h, outs in (("gpt1.3b", 16384, 2048, {"qkv": 6144, "proj": 2048, "fc1": 8192, "fc2": 2048}),
                              ("llama1b", 16384, 2048, {"qkv": 4096, "proj": 2048, "fc1": 11264, "fc2": 2048})):
        ins = {"qkv": h, "proj": h, "fc1": h, "fc2": outs["fc1"] // (2 if model == "llama1b" else 1)}
        for name, out in outs.items():
            k = ins[name]
            shapes += [(f"{model} {name} fwd", t, out, k), (f"{model} {name} dgrad", t, k, out),
                       (f"{model} {name} wgrad", out, k, t)]
    return shapes


def blas_libraries():
    for name, m, n, k in layer_shapes():
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        row = {"case": name, "mnk": [m, n, k]}
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            us = bench(lambda: torch.mm(a, b))
            row[lib] = {"us": round(us, 1), "tflops": round(2 * m * n * k / us / 1e6, 1)}
        torch.backends.cuda.preferred_blas_library("cublas")
        emit(**row)


def operand_layouts():
    """Each layer GEMM with its operands as the product lays them out and the other way round (a transposed,
    contiguous copy of the weight): forward x [t, in] @ W^T with W [out, in] (`F.linear`) against x @ W^T
    stored [in, out]; input gradient dy [t, out] @ W against dy @ (a copy [in, out] of W, read transposed).
    Activations randn, weights randn * 0.02, output gradients randn * 1e-3 (a GEMM's power draw, hence its
    clock, depends on the data)."""
    for name, m, n, k in layer_shapes():
        if name.endswith("wgrad"):
            continue
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * (1e-3 if name.endswith("dgrad") else 1.0)
        if name.endswith("fwd"):
            weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02          # [out, in]
            variants = {"product: x @ W.t()": weight.t(), "W stored [in, out]": weight.t().contiguous()}
        else:
            weight = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) * 0.02          # [out, in]
            variants = {"product: dy @ W": weight, "dy @ copy(W.t()).t()": weight.t().contiguous().t()}
        row = {"case": name, "mnk": [m, n, k]}
        for label, b in variants.items():
            us = bench(lambda: torch.mm(a, b))
            row[label] = {"us": round(us, 1), "tflops": round(2 * m * n * k / us / 1e6, 1)}
        if not name.endswith("fwd"):
            us = bench(lambda: weight.t().contiguous())
            row["transposed copy of W"] = {"us": round(us, 1)}
        emit(**row)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="two tile settings only")
    parser.add_argument("--only", choices=["gelu", "blas", "layouts"], default=None)
    args = parser.parse_args()
    emit(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    if args.only in (None, "gelu"):
        gelu_mlp(args.quick)
    if args.only in (None, "blas"):
        blas_libraries()
    if args.only in (None, "layouts"):
        operand_layouts()


if __name__ == "__main__":
    main()
