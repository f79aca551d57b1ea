"""GPU benchmark: a ~1B hybrid Mamba model (Mamba + attention + MLP layers) trained through `pretrain_mamba.py`.

Runs the real entry script (bf16, mock data, one GPU), reads the per-iteration time and the framework's own
TFLOP/s from Megatron's log lines, and recomputes TFLOP/s here with Megatron's hybrid formula (`training.py`,
`is_hybrid_model`) from the logged time as a cross-check. Iterations after the first `--skip` are averaged.
Prints one JSON line (and writes it to `--out`).

  python benchmarks/gpu/mamba_bench.py                 # H200: hybrid ~1B, seq 4096, bf16
  python benchmarks/gpu/mamba_bench.py --smoke         # CPU: a tiny model, three iterations (checks the script)
  python benchmarks/gpu/mamba_bench.py --ssm-impl torch # force the PyTorch reference ops (A/B against Triton)

`--ssm-impl torch|triton` trains through a copy of `mamba_stack_spec` whose mixers get that `ssm_impl`
(`--spec benchmarks.gpu.mamba_bench torch_stack_spec`); the default `auto` uses Megatron's spec path.
"""
import argparse
import copy
import json
import os
import re
import statistics
import subprocess
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPECS = {"auto": "--spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec",
         "torch": "--spec benchmarks.gpu.mamba_bench torch_stack_spec",
         "triton": "--spec benchmarks.gpu.mamba_bench triton_stack_spec"}
# ~0.96B parameters: 28 layers = 14 Mamba, 3 attention (GQA 16/8 heads), 11 MLP (ffn 4H), hidden 2048, vocab 32k.
MODEL_1B = dict(num_layers=28, hidden=2048, heads=16, groups_q=8, ffn=8192, attn_ratio=0.1, mlp_ratio=0.4,
                state=128, head_dim=64, mamba_groups=8, vocab=32000, seq=4096, mbs=2)
MODEL_SMOKE = dict(num_layers=4, hidden=64, heads=4, groups_q=2, ffn=256, attn_ratio=0.25, mlp_ratio=0.25,
                   state=16, head_dim=16, mamba_groups=2, vocab=4096, seq=64, mbs=2)


def _stack_spec_with_impl(impl):
    """`mamba_stack_spec` whose Mamba mixers run the `impl` ops ("torch" or "triton")."""
    spec = copy.deepcopy(mamba_stack_spec)
    mixer = spec.submodules.mamba_layer.submodules.mixer
    mixer.params = dict(mixer.params or {}, ssm_impl=impl)
    return spec


torch_stack_spec = _stack_spec_with_impl("torch")
triton_stack_spec = _stack_spec_with_impl("triton")
ITER_RE = re.compile(r" iteration +(\d+)/ *\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+) \|"
                     r"(?: throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+) \|)?")


def flags(m, iters, smoke, impl="auto"):
    """The pretrain_mamba.py command line of model `m`."""
    out = (f"--num-layers {m['num_layers']} --hidden-size {m['hidden']} --num-attention-heads {m['heads']} "
           f"--group-query-attention --num-query-groups {m['groups_q']} --ffn-hidden-size {m['ffn']} "
           f"--hybrid-attention-ratio {m['attn_ratio']} --hybrid-mlp-ratio {m['mlp_ratio']} --is-hybrid-model "
           f"--mamba-state-dim {m['state']} --mamba-head-dim {m['head_dim']} --mamba-num-groups {m['mamba_groups']} "
           f"{SPECS[impl]} --normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights "
           f"--position-embedding-type none --seq-length {m['seq']} --max-position-embeddings {m['seq']} "
           f"--micro-batch-size {m['mbs']} --global-batch-size {m['mbs']} --train-iters {iters} "
           f"--lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 1 --bf16 --mock-data "
           f"--tokenizer-type NullTokenizer --vocab-size {m['vocab']} --hidden-dropout 0 --attention-dropout 0 "
           "--log-interval 1 --log-throughput --eval-iters 0 --eval-interval 100000")
    if smoke:
        out += " --distributed-backend gloo --no-gradient-accumulation-fusion"
    return out.split()


def hybrid_flops(m, batch):
    """Megatron's hybrid-model FLOPs of one iteration (3 x forward), independent of the framework's copy."""
    b, s, h = batch, m["seq"], m["hidden"]
    n_att, n_mlp = round(m["num_layers"] * m["attn_ratio"]), round(m["num_layers"] * m["mlp_ratio"])
    n_mamba = m["num_layers"] - n_att - n_mlp
    attn = 4 * b * s * h * 1 * (h + h * (m["groups_q"] / m["heads"]) + s / 2)
    mlp = 4 * (m["ffn"] / h) * b * s * h * h
    d_in = 2 * h
    nheads = d_in // m["head_dim"]
    mamba = (2 * b * s * h * (2 * d_in + 2 * m["mamba_groups"] * m["state"] + nheads) + 7 * b * s * d_in * m["state"]
             + 2 * b * s * d_in * h)
    vocab = -(-m["vocab"] // 128) * 128  # padded as --make-vocab-size-divisible-by 128 does at TP=1
    return 3 * (n_att * attn + n_mlp * mlp + n_mamba * mamba + 2 * b * s * h * vocab)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU")
    parser.add_argument("--iters", type=int, default=None, help="training iterations (default 12, smoke 3)")
    parser.add_argument("--skip", type=int, default=None, help="warm-up iterations left out (default 3, smoke 1)")
    parser.add_argument("--mbs", type=int, default=None, help="micro batch size")
    parser.add_argument("--ssm-impl", choices=sorted(SPECS), default="auto", help="SSD scan / conv1d ops")
    parser.add_argument("--out", default=None, help="also write the JSON result here")
    args = parser.parse_args(argv)
    model = dict(MODEL_SMOKE if args.smoke else MODEL_1B)
    if args.mbs:
        model["mbs"] = args.mbs
    iters = args.iters or (3 if args.smoke else 12)
    skip = args.skip if args.skip is not None else (1 if args.smoke else 3)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_mamba.py"), *flags(model, iters, args.smoke, args.ssm_impl)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rows = [(int(i), float(ms), float(tf) if tf else None) for i, ms, tf in ITER_RE.findall(proc.stdout)]
    if proc.returncode != 0 or len(rows) < iters:
        sys.stdout.write(proc.stdout[-6000:])
        raise SystemExit(f"pretrain_mamba.py failed (exit {proc.returncode}, {len(rows)} of {iters} iterations)")
    kept = rows[skip:] or rows[-1:]
    ms = statistics.median(r[1] for r in kept)
    logged = [r[2] for r in kept if r[2] is not None]
    result = {"model": "hybrid-1b" if not args.smoke else "hybrid-smoke", "ssm_impl": args.ssm_impl, "layers": model["num_layers"],
              "hidden": model["hidden"], "seq": model["seq"], "mbs": model["mbs"], "iters": iters,
              "median_iter_ms": ms, "tokens_per_s": model["mbs"] * model["seq"] / (ms / 1000),
              "tflops_logged": statistics.median(logged) if logged else None,
              "tflops_formula": hybrid_flops(model, model["mbs"]) / (ms / 1000) / 1e12,
              "peak_memory_line": next((line.strip() for line in proc.stdout.splitlines() if "memory (MB)" in line),
                                       None)}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
