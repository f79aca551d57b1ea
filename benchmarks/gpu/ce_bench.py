"""The fused cross-entropy's chunk kernels compiled with specialised shapes (the product's `CudaCompiled`)
against the same functions compiled with every size symbolic, at the GPT-1.3B and Llama-1B logits shapes,
on one GPU (not part of the product).

  python benchmarks/gpu/ce_bench.py

Prints one JSON line per (shape, variant): median ms of forward (loss and stored gradient) and backward
(in-place scaling), and the largest loss / gradient difference from the specialised variant.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import triton.testing  # noqa: E402

from megatron.core.fusions import fused_cross_entropy as ce  # noqa: E402
from megatron.core.fusions import _compile  # noqa: E402

SHAPES = {"gpt1.3b": (2048, 8, 50304), "llama1b": (4096, 4, 32000)}
KERNELS = ("_max", "_scale", "_sums", "_grad")
ORIGINAL = {name: getattr(ce, name).fn for name in KERNELS}  # the plain chunk functions


def _use(dynamic):
    """Fresh compiled chunk functions: specialised per argument signature (the product's `CudaCompiled`) or
    one compilation with every size symbolic (`dynamic`: the product before 2026-11-30 evening)."""
    for name in KERNELS:
        fn = ORIGINAL[name]
        setattr(ce, name, torch.compile(_compile._fresh_copy(fn), dynamic=True) if dynamic else _compile.CudaCompiled(fn))


def _against_reference(logits, target, loss, grad):
    """Largest loss and gradient differences from the fp32 formula (softmax - onehot), and where the worst
    gradient element sits (row, column, that row's target, chunk)."""
    vocab = logits.shape[-1]
    logits_2d, target_1d = logits.reshape(-1, vocab), target.reshape(-1)  # [s, b, V] -> [s*b, V]
    rows = torch.arange(logits_2d.shape[0], device=logits.device)
    log_probs = torch.log_softmax(logits_2d.float(), dim=-1)
    ref_loss = -log_probs[rows, target_1d]
    ref_grad = log_probs.exp_()
    ref_grad[rows, target_1d] -= 1.0
    diff = (grad.reshape(-1, vocab).float() - ref_grad).abs_()
    flat = int(diff.argmax())
    row, col = divmod(flat, vocab)
    return {"loss_vs_fp32": float((loss.reshape(-1) - ref_loss).abs().max()), "grad_vs_fp32": float(diff.max()),
            "worst_at": [row, col, int(target_1d[row]), row // ce._chunk_rows(vocab)]}


def main():
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    group = dist.new_group([0])
    torch.manual_seed(0)
    for model, (s, b, vocab) in SHAPES.items():
        logits = (torch.randn(s, b, vocab, device="cuda") * 3).to(torch.bfloat16).requires_grad_()
        target = torch.randint(0, vocab, (s, b), device="cuda")
        results = {}
        for variant in ("specialised", "all dynamic"):
            _use(variant == "all dynamic")

            def forward():
                return ce.fused_vocab_parallel_cross_entropy(logits, target, tp_group=group)

            loss = forward()
            loss.sum().backward()
            results[variant] = (loss.detach(), logits.grad.clone())
            logits.grad = None
            worst = _against_reference(logits.detach(), target, *results[variant])
            fwd_ms = triton.testing.do_bench(forward, warmup=5, rep=50)
            both_ms = triton.testing.do_bench(lambda: forward().sum().backward(), warmup=5, rep=50,
                                              grad_to_none=[logits])
            ref_loss, ref_grad = results["specialised"]
            print(json.dumps({"model": model, "variant": variant, "fwd_ms": round(fwd_ms, 3),
                              "bwd_ms": round(both_ms - fwd_ms, 3),
                              "loss_diff": float((loss - ref_loss).abs().max()),
                              "grad_diff": float((results[variant][1].float() - ref_grad.float()).abs().max()),
                              **worst}),
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
