"""SDPA backend micro-benchmark at the benchmark models' attention shapes (fwd+bwd, bf16, causal).

Inputs are laid out as the model produces them ([s, b, n, hn] permuted to [b, n, s, hn]), so the numbers
include any layout copy a backend needs. Prints one JSON line per (shape, variant).

  python benchmarks/gpu/attn_bench.py
"""
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core.transformer.dot_product_attention import sdpa_backend_priority

SHAPES = {  # name: (batch, heads, kv heads, seq, head dim)
    "gpt1.3b": (8, 16, 16, 2048, 128),
    "llama1b": (4, 16, 8, 4096, 128),
    "gpt2.7b": (4, 20, 20, 4096, 128),
}
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _inputs(b, nq, nkv, s, d):
    q = torch.randn(s, b, nq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(s, b, nkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(s, b, nkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return q, k, v


def _step(q, k, v, expand):
    qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [s, b, n, d] -> [b, n, s, d]
    gqa = qq.shape[1] != kk.shape[1]
    if gqa and expand:
        rep = qq.shape[1] // kk.shape[1]
        kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
        gqa = False
    out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=gqa)
    out.sum().backward()


def _time(fn, iters=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main():
    for name, (b, nq, nkv, s, d) in SHAPES.items():
        q, k, v = _inputs(b, nq, nkv, s, d)
        flops = 4 * b * nq * s * s * d / 2 * 3.5  # causal fwd (2 matmuls) + bwd (5 matmuls)
        for backend_name, backend in list(BACKENDS.items()) + [("default", None), ("ours", "ours")]:
            for expand in ([False, True] if nq != nkv else [False]):
                label = backend_name + ("+expand-kv" if expand else "")
                try:
                    if backend is None:
                        ms = _time(lambda: _step(q, k, v, expand))
                    elif backend == "ours":
                        with sdpa_backend_priority(q):
                            ms = _time(lambda: _step(q, k, v, expand))
                    else:
                        with sdpa_kernel([backend]):
                            ms = _time(lambda: _step(q, k, v, expand))
                    print(json.dumps({"shape": name, "variant": label, "ms": round(ms, 3),
                                      "tflops": round(flops / ms / 1e9, 1)}), flush=True)
                except RuntimeError as error:
                    print(json.dumps({"shape": name, "variant": label, "error": str(error)[:160]}), flush=True)


if __name__ == "__main__":
    main()
