"""GPU benchmark: a DeepSeek-V3-shaped proxy and Llama-1B through `pretrain_gpt.py`, in one job (one GPU).

The proxy: 12 layers (the first dense), hidden 2048, MLA (16 heads, q LoRA 768, kv LoRA 256, qk 128 + RoPE 64,
v 128, YaRN), 16 routed experts top-4 in 4 groups (top-2 groups) + 1 shared expert (sigmoid scores, expert
bias, seq-aux loss), one MTP depth, seq 4096, bf16. Both models run one after the other on the same GPU; the
TFLOP/s/GPU is the framework's own log value (`--log-throughput`, Megatron's `num_floating_point_operations`,
MLA and MTP terms included), the median over the log intervals after the first (compile-including) one.

  python benchmarks/gpu/deepseek_bench.py [--iters 30] [--profile]   # on the H200; --profile adds kernel tables
  python benchmarks/gpu/deepseek_bench.py --smoke                   # CPU: tiny shapes, gloo, a few iterations

With --profile each model's run also writes the top GPU kernels by total time (through
`benchmarks/gpu/profile_pretrain.py`) to --out-dir, and the summary prints their first lines.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMON = ("--mock-data --tokenizer-type NullTokenizer --hidden-dropout 0 --attention-dropout 0 --lr 1e-4 "
          "--min-lr 1e-5 --lr-decay-style cosine --eval-iters 0 --eval-interval 100000 --log-throughput "
          "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
          "--untie-embeddings-and-output-weights")
DEEPSEEK = (
    "--num-layers 12 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 --seq-length 4096 "
    "--max-position-embeddings 4096 --micro-batch-size 1 --vocab-size 32000 --qk-layernorm "
    "--multi-latent-attention --q-lora-rank 768 --kv-lora-rank 256 --qk-head-dim 128 --qk-pos-emb-head-dim 64 "
    "--v-head-dim 128 --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 "
    "--mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 "
    "--num-experts 16 --moe-layer-freq ([0]*1+[1]*11) --moe-ffn-hidden-size 1408 "
    "--moe-shared-expert-intermediate-size 1408 --moe-router-topk 4 --moe-router-num-groups 4 "
    "--moe-router-group-topk 2 --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
    "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4 --moe-router-topk-scaling-factor 2.5 "
    "--moe-router-dtype fp32 --moe-grouped-gemm --moe-token-dispatcher-type alltoall"
)
LLAMA1B = (
    "--num-layers 16 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 --group-query-attention "
    "--num-query-groups 8 --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 4 --vocab-size 31999"
)
SMOKE = {  # tiny CPU shapes of the same two models
    "deepseek": ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --seq-length 64 "
                 "--max-position-embeddings 64 --micro-batch-size 2 --vocab-size 4095 --qk-layernorm "
                 "--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 "
                 "--qk-pos-emb-head-dim 8 --v-head-dim 16 --rotary-scaling-factor 4 --mtp-num-layers 1 "
                 "--num-experts 4 --moe-layer-freq ([0]*1+[1]*1) --moe-ffn-hidden-size 32 "
                 "--moe-shared-expert-intermediate-size 32 --moe-router-topk 2 --moe-router-num-groups 2 "
                 "--moe-router-group-topk 1 --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
                 "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4 "
                 "--moe-token-dispatcher-type alltoall"),
    "llama1b": ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
                "--group-query-attention --num-query-groups 2 --seq-length 64 --max-position-embeddings 64 "
                "--micro-batch-size 2 --vocab-size 4095"),
}
TFLOPS_RE = re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)")
ITER_MS_RE = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
KEEP_RE = re.compile(r"iteration .*\||Error|Traceback|memory \(MB\)")


def _command(flags, args, name):
    iters, interval = (4, 2) if args.smoke else (args.iters, args.log_interval)
    gbs = 2 if args.smoke else args.global_batch_size.get(name, 8)
    extra = f" --global-batch-size {gbs} --train-iters {iters} --log-interval {interval}"
    extra += "" if args.smoke else " --bf16"
    script = [os.path.join(ROOT, "pretrain_gpt.py")]
    if args.profile and not args.smoke:
        extra += f" --profile --use-pytorch-profiler --profile-step-start {iters + 1} --profile-step-end {iters + 3}"
        iters += 3
        extra = extra.replace(f"--train-iters {args.iters}", f"--train-iters {iters}")
        script = [os.path.join(ROOT, "benchmarks", "gpu", "profile_pretrain.py"), "--profile-out",
                  os.path.join(args.out_dir, f"profile_{name}.txt"), "--"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--master-port",
                str(29611 + len(name))]
    return launcher + script + f"{flags} {COMMON}{extra} {args.extra_flags}".split()


def _run(name, flags, args):
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if args.smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""
    log_path = os.path.join(args.out_dir, f"{name}.log")
    with open(log_path, "w") as log:
        proc = subprocess.run(_command(flags, args, name), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=args.timeout)
    text = open(log_path).read()
    tflops = [float(v) for v in TFLOPS_RE.findall(text)][1:]
    iter_ms = [float(v) for v in ITER_MS_RE.findall(text)][1:]
    kept = [line for line in text.splitlines() if KEEP_RE.search(line)]
    return dict(name=name, rc=proc.returncode, tflops=statistics.median(tflops) if tflops else None,
                iter_ms=statistics.median(iter_ms) if iter_ms else None, tail="\n".join(kept[-6:]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the commands run)")
    parser.add_argument("--profile", action="store_true", help="write the top GPU kernels of each model")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--log-interval", type=int, default=5)
    parser.add_argument("--out-dir", default=os.environ.get("OUT", os.path.join(ROOT, "benchmarks", "gpu",
                                                                                  "results")))
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--only", choices=["deepseek", "llama1b"], default=None)
    parser.add_argument("--extra-flags", default="",
                        help="more pretrain_gpt.py flags for every run, e.g. --extra-flags='--enable-cuda-graph'")
    args = parser.parse_args(argv)
    args.global_batch_size = {"deepseek": 8, "llama1b": 8}
    os.makedirs(args.out_dir, exist_ok=True)
    models = SMOKE if args.smoke else {"deepseek": DEEPSEEK, "llama1b": LLAMA1B}
    results = [_run(name, flags, args) for name, flags in models.items() if args.only in (None, name)]
    print(f"{'model':10s} {'rc':>3s} {'TFLOP/s/GPU':>12s} {'ms/iter':>9s}")
    for r in results:
        tflops = f"{r['tflops']:.1f}" if r["tflops"] is not None else "-"
        iter_ms = f"{r['iter_ms']:.0f}" if r["iter_ms"] is not None else "-"
        print(f"{r['name']:10s} {r['rc']:3d} {tflops:>12s} {iter_ms:>9s}")
    for r in results:
        print(f"--- {r['name']} (log {os.path.join(args.out_dir, r['name'] + '.log')})\n{r['tail']}")
        profile = os.path.join(args.out_dir, f"profile_{r['name']}.txt")
        if os.path.exists(profile):
            print("".join(open(profile).readlines()[:30]))
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
