"""Document-masked attention and long context on one GPU (not part of the product):

  python benchmarks/gpu/cp_docmask_bench.py [--out results.json] [--parts attention,pretrain,long]

Three parts, each printing one JSON line per measurement (and all of them into `--out`):

1. `attention`: GPT-1.3B-shaped attention (16 heads of 128, bf16) at sequence 8192, micro-batch 1, with 8
   documents per row (fixed random lengths): forward + backward of the document-masked path
   (`context_parallel.attention.document_attention`, FlashAttention varlen kernels) against
   `scaled_dot_product_attention` with the explicit dense [s, s] mask (what Megatron's local attention does
   with --reset-attention-mask), plus plain causal SDPA for scale. Target: >= 3x faster than the dense
   mask. The outputs and gradients of the two are compared (bf16 tolerance).
2. `pretrain`: `pretrain_gpt.py` GPT-1.3B at sequence 8192 (mock data: documents of 1-4095 tokens) with and
   without --reset-attention-mask: median step time after the first log interval. Target: within 10%.
3. `long`: `pretrain_gpt.py` GPT-1.3B at sequence 32768 on one GPU with full activation recompute:
   TFLOP/s/GPU (Megatron's formula) and step time.

Every part runs even when an earlier one failed (the failure is printed and recorded). Small warm-ups:
the attention timings use 3 warm-up and 10 timed iterations; the pretrain runs log every 2 iterations and
the first log interval (compilation) is dropped.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron.core.context_parallel import kernels  # noqa: E402
from megatron.core.context_parallel.attention import document_attention  # noqa: E402
from megatron.core.context_parallel.layout import SequenceLayout, document_keys_from_cu_seqlens  # noqa: E402
from megatron.core.transformer.dot_product_attention import sdpa_backend_priority  # noqa: E402

GPT13B = ("--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --micro-batch-size 1 --vocab-size 50303 "
          "--bf16 --mock-data --tokenizer-type NullTokenizer --hidden-dropout 0 --attention-dropout 0 --lr 1e-4 "
          "--min-lr 1e-5 --lr-decay-style cosine --eval-iters 0 --eval-interval 100000 --log-throughput "
          "--log-interval 2")
ELAPSED_RE = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
TFLOPS_RE = re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)")
RESULTS = []


def emit(record):
    """Print one measurement as a JSON line and keep it for --out."""
    RESULTS.append(record)
    print(json.dumps(record), flush=True)


def time_ms(fn, warmup=3, iters=10):
    """Median milliseconds of fn() on the GPU (CUDA events around each call; wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _document_lengths(seq, docs, generator):
    cuts = torch.sort(torch.randperm(seq - 1, generator=generator)[: docs - 1] + 1).values.tolist()
    bounds = [0, *cuts, seq]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def attention_part(seq=8192, batch=1, heads=16, head_dim=128, docs=8, device="cuda"):
    """Document-masked attention vs SDPA with the dense mask (and causal SDPA), forward + backward."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    lengths = [n for _ in range(batch) for n in _document_lengths(seq, docs, g)]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    keys = document_keys_from_cu_seqlens(cu, batch, seq, device)
    layout = SequenceLayout(seq, batch, 1, device, doc_keys=keys)
    q, k, v = (torch.randn(seq, batch, heads, head_dim, device=device, dtype=dtype, generator=None).requires_grad_()
               for _ in range(3))
    dout = torch.randn(seq, batch, heads, head_dim, device=device, dtype=dtype)
    scale = head_dim ** -0.5
    kernel = kernels.select_kernel(q.view(-1, heads, head_dim), k.view(-1, heads, head_dim))
    emit({"part": "attention", "kernel": kernel.name, "seq": seq, "batch": batch, "document_lengths": lengths})

    def documents():
        out = document_attention(q, k, v, layout, [0], scale, 0.0)
        torch.autograd.grad(out, (q, k, v), dout)
        return out

    allowed = torch.tril(torch.ones(seq, seq, dtype=torch.bool, device=device))[None] & (
        keys[:, :, None] == keys[:, None, :])
    qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [s, b, n, hn] -> [b, n, s, hn]
    do = dout.permute(1, 2, 0, 3)

    def sdpa(mask):
        def run():
            with sdpa_backend_priority(qq):
                out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale,
                                                                       is_causal=mask is None)
            torch.autograd.grad(out, (q, k, v), do)
            return out
        return run

    start = time.time()
    documents()  # builds and caches the kernel plan of this micro-batch
    if device == "cuda":
        torch.cuda.synchronize()
    emit({"part": "attention", "first_call_with_plan_ms": round((time.time() - start) * 1e3, 2)})
    doc_ms = time_ms(documents)
    dense_ms = time_ms(sdpa(allowed[:, None]))
    causal_ms = time_ms(sdpa(None))
    useful = sum(n * n / 2 for n in lengths) * heads * head_dim * 4 * 3.5  # fwd 2 GEMMs (x2 flops), bwd 2.5x fwd
    emit({"part": "attention", "document_masked_ms": round(doc_ms, 3), "dense_mask_sdpa_ms": round(dense_ms, 3),
          "causal_sdpa_ms": round(causal_ms, 3), "speedup_vs_dense_mask": round(dense_ms / doc_ms, 2),
          "target_speedup": 3.0, "document_masked_useful_tflops": round(useful / doc_ms / 1e9, 1)})
    _attention_agreement(q, k, v, dout, layout, allowed, scale)


def _attention_agreement(q, k, v, dout, layout, allowed, scale):
    out = document_attention(q, k, v, layout, [0], scale, 0.0)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [s, b, n, hn] -> [b, n, s, hn]
    ref = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=allowed[:, None], scale=scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.permute(1, 2, 0, 3))
    ref = ref.permute(2, 0, 1, 3)  # [b, n, s, hn] -> [s, b, n, hn]
    rel = lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
    emit({"part": "attention", "max_rel_diff_out": rel(out, ref),
          "max_rel_diff_grads": [rel(a, b) for a, b in zip(grads, ref_grads)]})


def _pretrain(name, flags, timeout):
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *flags.split()]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    elapsed = [float(x) for x in ELAPSED_RE.findall(proc.stdout)]
    tflops = [float(x) for x in TFLOPS_RE.findall(proc.stdout)]
    record = {"part": name, "returncode": proc.returncode, "wall_s": round(time.time() - start, 1),
              "step_ms": round(statistics.median(elapsed[1:]), 1) if len(elapsed) > 1 else None,
              "tflops_per_gpu": round(statistics.median(tflops[1:]), 1) if len(tflops) > 1 else None,
              "step_ms_all": elapsed}
    if proc.returncode != 0:
        record["tail"] = proc.stdout[-3000:]
    emit(record)
    return record


def pretrain_part(timeout):
    """Step time of GPT-1.3B at sequence 8192 with and without --reset-attention-mask."""
    base = f"{GPT13B} --seq-length 8192 --max-position-embeddings 8192 --global-batch-size 4 --train-iters 12"
    plain = _pretrain("pretrain-causal", base, timeout)
    documents = _pretrain("pretrain-reset-attention-mask", base + " --reset-attention-mask", timeout)
    if plain["step_ms"] and documents["step_ms"]:
        emit({"part": "pretrain", "step_time_ratio_documents_over_causal": round(documents["step_ms"] /
                                                                                 plain["step_ms"], 3),
              "target_ratio_at_most": 1.10})


def long_part(timeout):
    """GPT-1.3B at sequence 32768 on one GPU with full recompute."""
    flags = (f"{GPT13B} --seq-length 32768 --max-position-embeddings 32768 --global-batch-size 1 --train-iters 8 "
             "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    _pretrain("long-context-32768-full-recompute", flags, timeout)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write every measurement to this JSON file")
    parser.add_argument("--parts", default="attention,pretrain,long", help="comma-separated: attention,pretrain,long")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per pretrain_gpt.py run")
    parser.add_argument("--cpu-smoke", action="store_true", help="run the attention part tiny on the CPU (a check "
                        "of this script, not a measurement)")
    args = parser.parse_args()
    if args.cpu_smoke:
        attention_part(seq=256, heads=4, head_dim=16, docs=4, device="cpu")
        return
    if not torch.cuda.is_available():
        print("cp_docmask_bench.py needs a CUDA GPU; none is visible.", flush=True)
        sys.exit(1)
    emit({"device": torch.cuda.get_device_name(), "torch": torch.__version__})
    parts = {"attention": attention_part, "pretrain": lambda: pretrain_part(args.timeout),
             "long": lambda: long_part(args.timeout)}
    for name in args.parts.split(","):
        try:
            parts[name.strip()]()
        except Exception:  # keep going: the other parts still measure something
            emit({"part": name, "error": traceback.format_exc()[-3000:]})
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(RESULTS, handle, indent=1)
        print(f"results written to {args.out}", flush=True)


if __name__ == "__main__":
    main()
