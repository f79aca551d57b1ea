"""RoPE variants at the Llama-1B-s4096 shapes (q [4096, 4, 16, 128] contiguous, k a strided view of the
fused QKV output), forward and forward+backward, on one GPU (not part of the product).

  python benchmarks/gpu/rope_bench.py

Variants: the plain path (`CudaCompiled`: one compilation per argument signature, sizes constant; the
product's where the fused kernels below do not apply);
the same with every size symbolic (the product before 2026-11-30 evening); and cos/sin computed once per
call outside the compiled kernel (the kernel reads two small tables instead of evaluating cos/sin for
every element); and the fused split + rotation kernels (`fusions.fused_qkv_rope`, the product's path for
self-attention on CUDA since the eleventh session, 2026-11-30). Prints one JSON line per variant with median
microseconds and the largest difference from the eager function.
"""
import json
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import triton.testing  # noqa: E402

from megatron.core.fusions import _compile, fused_qkv_rope  # noqa: E402
from megatron.core.transformer import rope_utils  # noqa: E402


def rotate_with_tables(t, cos_, sin_):
    rot_dim = cos_.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    t_rot = (t_rot * cos_) + (rope_utils._rotate_half(t_rot, False) * sin_)
    return torch.cat((t_rot, t_pass), dim=-1)


def fused_variant(qkv, freqs, per_group, hn, reference):
    """The product since the eleventh session (2026-11-30): split + rotation of q and k (and the copy of v)
    as one Triton kernel each way (`fusions.fused_qkv_rope`), from the fused projection's output."""
    config = types.SimpleNamespace(rotary_interleaved=False)

    def forward():
        # [s, b, ng, (np/ng+2)*hn] -> [s, b, ng*(np/ng+2)*hn], the projection's output
        return fused_qkv_rope.try_fused_qkv_rope(qkv.view(*qkv.shape[:2], -1), freqs, per_group, hn, config)

    def forward_backward():
        outs = forward()
        torch.autograd.backward(outs[:2], (grad_q, grad_k))

    outs = forward()
    grad_q, grad_k = torch.ones_like(outs[0]), torch.ones_like(outs[1])
    diff = max(float((o - r).detach().abs().max()) for o, r in zip(outs[:2], reference))
    with torch.no_grad():
        fwd_us = triton.testing.do_bench(forward, warmup=10, rep=100) * 1000
    both_us = triton.testing.do_bench(forward_backward, warmup=10, rep=100, grad_to_none=[qkv]) * 1000
    print(json.dumps({"variant": "fused split + rotation kernels (q, k and v)", "fwd_us": round(fwd_us, 1),
                      "fwd_bwd_us": round(both_us, 1), "max_diff_vs_eager": diff}), flush=True)


def main():
    torch.manual_seed(0)
    s, b, groups, per_group, hn = 4096, 4, 8, 2, 128
    qkv = torch.randn(s, b, groups, (per_group + 2) * hn, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hn, 2, device="cuda", dtype=torch.float32) / hn))
    angles = torch.outer(torch.arange(s, device="cuda", dtype=torch.float32), inv_freq)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :]  # [s, 1, 1, hn]

    def operands():
        q, k, _ = torch.split(qkv, [per_group * hn, hn, hn], dim=-1)
        return q.reshape(s, b, groups * per_group, hn), k  # q copied to [s, b, np, hn]; k a strided view

    symbolic = torch.compile(_compile._fresh_copy(rope_utils._apply_rotary_pos_emb_bshd), dynamic=True)
    tables = torch.compile(rotate_with_tables, dynamic=False)
    tables_dynamic = torch.compile(rotate_with_tables, dynamic=True)

    def run_tables(fn):
        def apply(t):
            cos_, sin_ = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
            return fn(t, cos_, sin_)
        return apply

    variants = {
        "plain path (specialised per signature)": lambda t: rope_utils._apply_rotary_pos_emb_bshd_fused(t, freqs, False, 1.0),
        "all sizes symbolic": lambda t: symbolic(t, freqs, False, 1.0),
        "cos/sin tables, static": run_tables(tables),
        "cos/sin tables, dynamic": run_tables(tables_dynamic),
    }
    q, k = operands()
    reference = [rope_utils._apply_rotary_pos_emb_bshd(x, freqs) for x in (q, k)]
    fused_variant(qkv, freqs, per_group, hn, reference)
    for name, fn in variants.items():
        def forward():
            q_, k_ = operands()
            return fn(q_), fn(k_)

        def forward_backward():
            out_q, out_k = forward()
            torch.autograd.backward((out_q, out_k), (grad_q, grad_k))

        outs = forward()
        grad_q, grad_k = torch.ones_like(outs[0]), torch.ones_like(outs[1])
        diff = max(float((o - r).detach().abs().max()) for o, r in zip(outs, reference))
        with torch.no_grad():
            fwd_us = triton.testing.do_bench(forward, warmup=10, rep=100) * 1000
        both_us = triton.testing.do_bench(forward_backward, warmup=10, rep=100, grad_to_none=[qkv]) * 1000
        print(json.dumps({"variant": name, "fwd_us": round(fwd_us, 1), "fwd_bwd_us": round(both_us, 1),
                          "max_diff_vs_eager": diff}), flush=True)


if __name__ == "__main__":
    main()
