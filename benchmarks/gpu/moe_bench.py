"""MoE throughput on one GPU, not part of the product: a Mixtral-style model through `pretrain_gpt.py` against the
dense model with the same active FFN size, in the same job, and the grouped expert GEMMs against one dense GEMM of
the same total FLOPs.

  python benchmarks/gpu/moe_bench.py --out moe_bench.json            # one H200
  python benchmarks/gpu/moe_bench.py --smoke --out /tmp/moe.json      # CPU dry run (tiny shapes, gloo)

1. `pretrain_gpt.py` (one process, torchrun): 16 layers, hidden 2048, 16 heads (8 KV groups), seq 4096, micro batch
   1, bf16, RoPE/RMSNorm/SwiGLU, distributed optimizer. MoE: 8 experts of FFN 5632, top-2, dropless, grouped GEMM
   (`torch._grouped_mm`), alltoall dispatcher, fp32 router, aux loss. Dense: FFN 11264 (= top-2 x 5632). TFLOP/s/GPU
   is the framework's own log-line value (Megatron 0.13.1's `num_floating_point_operations`: for MoE layers the MLP
   term is `12 * h * moe_ffn * topk * 3/2` per token (active experts only; shared experts add `moe_shared_ffn`;
   no router term), i.e. active-parameter FLOPs), the median over the iterations after `--warmup`.
   Target: MoE >= 85% of dense.
2. Grouped GEMM: the expert fc1 ([T*k, h] x [E, h, 2*ffn]) and fc2 ([T*k, ffn] x [E, ffn, h]) products of one
   micro batch through `grouped_gemm_util.gmm` (forward + backward), balanced routing (T*k/E rows per expert) and a
   skewed one, vs one dense GEMM of the same shape totals. Target: grouped >= 90% of dense.
Output: a JSON file (and a summary on stdout).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

TFLOPS_RE = re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)")
ELAPSED_RE = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
LOSS_RE = re.compile(r"lm loss: ([0-9.E+-]+)")
MEM_RE = re.compile(r"max allocated: ([0-9.]+)")

FULL = dict(layers=16, hidden=2048, heads=16, groups=8, seq=4096, experts=8, ffn=5632, topk=2, vocab=31999, mbs=1,
            gbs=8)
SMOKE = dict(layers=2, hidden=64, heads=4, groups=2, seq=64, experts=4, ffn=96, topk=2, vocab=4095, mbs=1, gbs=2)


def _common(shape, iters, smoke):
    flags = (
        f"--num-layers {shape['layers']} --hidden-size {shape['hidden']} --num-attention-heads {shape['heads']} "
        f"--group-query-attention --num-query-groups {shape['groups']} --seq-length {shape['seq']} "
        f"--max-position-embeddings {shape['seq']} --micro-batch-size {shape['mbs']} "
        f"--global-batch-size {shape['gbs']} --vocab-size {shape['vocab']} --normalization RMSNorm --swiglu "
        "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights "
        "--mock-data --tokenizer-type NullTokenizer --hidden-dropout 0 --attention-dropout 0 --lr 1e-4 "
        "--min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 1 --eval-iters 0 --eval-interval 100000 "
        f"--log-interval 1 --log-throughput --train-iters {iters} --use-distributed-optimizer "
        "--transformer-impl local"
    ).split()
    return flags if smoke else flags + ["--bf16"]


def _moe_flags(shape):
    return (f"--num-experts {shape['experts']} --moe-router-topk {shape['topk']} --ffn-hidden-size {shape['ffn']} "
            f"--moe-ffn-hidden-size {shape['ffn']} --moe-grouped-gemm --moe-token-dispatcher-type alltoall "
            "--moe-router-dtype fp32 --moe-aux-loss-coeff 1e-2 --moe-router-load-balancing-type aux_loss").split()


def _dense_flags(shape):
    return ["--ffn-hidden-size", str(shape["ffn"] * shape["topk"])]


def _run_pretrain(name, flags, warmup, smoke, timeout, profile_out=None):
    """One `pretrain_gpt.py` run; with `profile_out` through `profile_pretrain.py`, whose kernel tables of the
    two iterations after the timed ones go to that file (the timed iterations are not profiled)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    if smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""
    script = [os.path.join(ROOT, "pretrain_gpt.py")]
    timed = int(flags[flags.index("--train-iters") + 1])  # log lines of the timed iterations (log interval 1)
    if profile_out:
        flags = list(flags)
        flags[flags.index("--train-iters") + 1] = str(timed + 3)
        flags += ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(timed + 1),
                  "--profile-step-end", str(timed + 3)]
        script = [os.path.join(ROOT, "benchmarks", "gpu", "profile_pretrain.py"), "--profile-out", profile_out, "--"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               *script, *flags]
    start = time.time()
    proc = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    log = proc.stdout
    iteration_lines = [line for line in log.splitlines() if "] iteration" in line][:timed]
    tflops = [float(m) for line in iteration_lines for m in TFLOPS_RE.findall(line)]
    elapsed = [float(m) for line in iteration_lines for m in ELAPSED_RE.findall(line)]
    losses = [float(m) for line in iteration_lines for m in LOSS_RE.findall(line)]
    steady = tflops[warmup:] or tflops
    result = {
        "name": name, "returncode": proc.returncode, "wall_s": round(time.time() - start, 1),
        "tflops_per_gpu": statistics.median(steady) if steady else None, "tflops_all": tflops,
        "ms_per_iter": statistics.median(elapsed[warmup:] or elapsed) if elapsed else None, "lm_loss": losses,
        "max_allocated_mb": max([float(m) for m in MEM_RE.findall(log)], default=None),
    }
    if proc.returncode != 0 or not tflops:
        result["log_tail"] = log[-4000:]
    return result


def _time(fn, device, repeats):
    import torch

    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def _gemm_case(tokens, k_dim, n_dim, sizes, device, dtype, repeats):
    """(grouped s, dense s, FLOPs) of forward + backward: [T, K] x [E, K, N] grouped by `sizes` vs [T, K] x [K, N]."""
    import torch

    from megatron.core.transformer.moe import grouped_gemm_util as gg

    a = torch.randn(tokens, k_dim, device=device, dtype=dtype, requires_grad=True)
    b = (torch.randn(len(sizes), k_dim, n_dim, device=device, dtype=dtype) * 0.02).requires_grad_()
    w = (torch.randn(k_dim, n_dim, device=device, dtype=dtype) * 0.02).requires_grad_()
    grad = torch.randn(tokens, n_dim, device=device, dtype=dtype)
    host_sizes = torch.tensor(sizes)

    def grouped():
        gg.gmm(a, b, host_sizes).backward(grad)

    def dense():
        (a @ w).backward(grad)

    flops = 3 * 2 * tokens * k_dim * n_dim  # forward + 2 backward GEMMs
    return _time(grouped, device, repeats), _time(dense, device, repeats), flops


def _skewed(total, experts):
    """Row counts per expert with a 4:1 spread (multiples of 8), summing to `total`."""
    weights = [4 - 3 * i / max(1, experts - 1) for i in range(experts)]
    sizes = [int(total * w / sum(weights)) // 8 * 8 for w in weights]
    sizes[0] += total - sum(sizes)
    return sizes


def gemm_bench(shape, smoke, repeats):
    """Grouped vs dense GEMM rows for fc1 and fc2, balanced and skewed routing."""
    import torch

    device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    tokens = shape["seq"] * shape["mbs"] * shape["topk"]
    experts, hidden, ffn = shape["experts"], shape["hidden"], shape["ffn"]
    rows = []
    for routing, sizes in (("balanced", [tokens // experts] * experts), ("skewed", _skewed(tokens, experts))):
        for name, k_dim, n_dim in (("fc1", hidden, 2 * ffn), ("fc2", ffn, hidden)):
            grouped_s, dense_s, flops = _gemm_case(tokens, k_dim, n_dim, sizes, device, dtype, repeats)
            rows.append({"gemm": name, "routing": routing, "rows_per_expert": sizes, "shape": [tokens, k_dim, n_dim],
                         "grouped_tflops": flops / grouped_s / 1e12, "dense_tflops": flops / dense_s / 1e12,
                         "ratio": dense_s / grouped_s})
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    native = device.type == "cuda" and gg.torch_grouped_mm_supported(device, dtype)
    return {"device": str(device), "dtype": str(dtype), "torch_grouped_mm": native, "rows": rows}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (gloo), a dry run")
    parser.add_argument("--iters", type=int, default=None, help="training iterations per run (default 12; smoke 3)")
    parser.add_argument("--warmup", type=int, default=None, help="log lines skipped (default 4; smoke 1)")
    parser.add_argument("--runs", nargs="*", default=["moe", "dense"], choices=["moe", "dense"],
                        help="pretrain_gpt.py runs (none: only the GEMM comparison)")
    parser.add_argument("--skip-gemm", action="store_true", help="no GEMM comparison")
    parser.add_argument("--out", default="moe_bench.json", help="JSON output file")
    parser.add_argument("--extra-flags", default="",
                        help="more pretrain_gpt.py flags for every run, e.g. --extra-flags='--manual-gc'")
    parser.add_argument("--profile", action="store_true",
                        help="also write kernel tables of each run (profile_<run>.txt beside --out)")
    args = parser.parse_args(argv)
    shape = SMOKE if args.smoke else FULL
    iters = args.iters or (3 if args.smoke else 12)
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 4)
    result = {"shape": shape, "iters": iters, "warmup": warmup, "smoke": args.smoke, "extra_flags": args.extra_flags,
              "flops_formula": "Megatron 0.13.1 num_floating_point_operations (active experts: moe_ffn * topk; "
                               "shared experts; no router term)"}
    result["gemm"] = {"rows": []} if args.skip_gemm else gemm_bench(shape, args.smoke, 3 if args.smoke else 20)
    for row in result["gemm"]["rows"]:
        print(f"gemm {row['gemm']} {row['routing']:8s} grouped {row['grouped_tflops']:7.1f} TFLOP/s  dense "
              f"{row['dense_tflops']:7.1f} TFLOP/s  ratio {row['ratio']:.3f}", flush=True)
    timeout = 600 if args.smoke else 1800
    common = _common(shape, iters, args.smoke)
    for name in args.runs:
        flags = common + (_moe_flags(shape) if name == "moe" else _dense_flags(shape)) + args.extra_flags.split()
        profile_out = (os.path.join(os.path.dirname(os.path.abspath(args.out)), f"profile_{name}.txt")
                       if args.profile else None)
        result[name] = _run_pretrain(name, flags, warmup, args.smoke, timeout, profile_out)
        with open(args.out, "w") as f:  # partial results survive a later timeout
            json.dump(result, f, indent=2)
        print(f"pretrain_gpt.py {name}: {result[name]['tflops_per_gpu']} TFLOP/s/GPU, "
              f"{result[name]['ms_per_iter']} ms/iter, rc {result[name]['returncode']}", flush=True)
    if "moe" in result and "dense" in result:
        moe, dense = result["moe"]["tflops_per_gpu"], result["dense"]["tflops_per_gpu"]
        result["moe_over_dense"] = moe / dense if moe and dense else None
        print(f"pretrain_gpt.py: MoE {moe} TFLOP/s/GPU, dense {dense} TFLOP/s/GPU, ratio {result['moe_over_dense']}",
              flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
