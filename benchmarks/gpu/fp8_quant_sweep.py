"""Tile sizes and warps of the FP8 Triton kernels (quantize with transposed copy, amax) at the GPT-1.3B /
Llama-1B activation shapes, on one GPU (not part of the product; picks the launch settings `_triton.py` uses).

  python benchmarks/gpu/fp8_quant_sweep.py

Prints one JSON line per (kernel, shape, setting): median microseconds (L2 flushed between runs by
`triton.testing.do_bench`) and the achieved bandwidth, bytes read + written over time.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import triton  # noqa: E402
import triton.testing  # noqa: E402

from megatron.core.fp8 import _triton  # noqa: E402
from megatron.core.fp8.kernels import E4M3  # noqa: E402

SHAPES = [(16384, 2048), (16384, 5632), (16384, 6144), (16384, 8192), (16384, 11264), (2048, 2048), (8192, 2048)]
TILES = [(64, 64, 4), (64, 64, 8), (64, 128, 4), (64, 128, 8), (128, 64, 4), (128, 64, 8), (128, 128, 4),
         (128, 128, 8), (128, 128, 16), (32, 128, 4), (128, 32, 4), (256, 64, 8), (64, 256, 8), (256, 128, 16)]
AMAX = [(4096, 4, 2048), (4096, 8, 2048), (8192, 8, 1024), (8192, 16, 1024), (2048, 4, 4096), (16384, 16, 512),
        (4096, 8, 4096), (8192, 8, 2048)]


def _quantize_launch(x, amax_, tile, transpose, amax_out):
    block_m, block_n, warps = tile
    rows, cols = x.shape
    q = torch.empty_like(x, dtype=E4M3)
    q_t = torch.empty((cols, rows), dtype=E4M3, device=x.device)
    scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n))
    partials = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=x.device)

    def launch():
        _triton._quantize_kernel[grid](x, amax_, q, q_t, scale_inv, partials, rows, cols, 448.0, 1.0,
                                       WRITE_T=transpose, AMAX_OUT=amax_out, BLOCK_M=block_m, BLOCK_N=block_n,
                                       num_warps=warps)
    return launch, (q, q_t)


def _amax_launch(x, setting):
    block, warps, max_programs = setting
    n = x.numel()
    programs = min(triton.cdiv(n, block), max_programs)
    partials = torch.empty(programs, dtype=torch.float32, device=x.device)

    def launch():
        _triton._amax_kernel[(programs,)](x, partials, n, BLOCK=block, num_warps=warps)
    return launch, partials


def main():
    torch.manual_seed(0)
    for rows, cols in SHAPES:
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        amax_ = x.float().abs().max().reshape(1)
        reference = None
        for transpose, amax_out in ((True, False), (True, True), (False, False)):
            moved = x.numel() * 2 + x.numel() * (2 if transpose else 1)
            for tile in TILES:
                launch, outputs = _quantize_launch(x, amax_, tile, transpose, amax_out)
                try:
                    us = triton.testing.do_bench(launch, warmup=10, rep=50) * 1000
                except Exception as error:  # a setting that does not compile (registers, shared memory)
                    print(json.dumps({"kernel": "quantize", "shape": [rows, cols], "tile": tile, "error": str(error)[:120]}))
                    continue
                if transpose and not amax_out:
                    got = (outputs[0].view(torch.uint8).clone(), outputs[1].view(torch.uint8).clone())
                    reference = reference or got
                    same = torch.equal(got[0], reference[0]) and torch.equal(got[1], reference[1])
                else:
                    same = None
                print(json.dumps({"kernel": "quantize", "shape": [rows, cols], "transpose": transpose,
                                  "amax_out": amax_out, "tile": tile, "us": round(us, 1),
                                  "TB/s": round(moved / us / 1e6, 2), "same": same}), flush=True)
        for setting in AMAX:
            launch, partials = _amax_launch(x, setting)
            us = triton.testing.do_bench(launch, warmup=10, rep=50) * 1000
            ok = bool(partials.amax().reshape(1).eq(amax_).all())
            print(json.dumps({"kernel": "amax", "shape": [rows, cols], "setting": setting, "us": round(us, 1),
                              "TB/s": round(x.numel() * 2 / us / 1e6, 2), "correct": ok}), flush=True)
        copy_us = triton.testing.do_bench(lambda: x.clone(), warmup=10, rep=50) * 1000
        print(json.dumps({"kernel": "clone (bandwidth reference)", "shape": [rows, cols], "us": round(copy_us, 1),
                          "TB/s": round(x.numel() * 4 / copy_us / 1e6, 2)}), flush=True)


if __name__ == "__main__":
    main()
