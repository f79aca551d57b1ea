"""GPU benchmark: the real `pretrain_gpt.py` path against the plain-PyTorch yardstick, in one job.

Runs each config through `pretrain_gpt.py` (TFLOP/s/GPU read from the framework's own log lines after
the first, compile-including, log interval) and the models through the yardstick script (`--yardstick
PATH`, a copy of shared/bench/gpt_baseline.py), then prints one table: ours, yardstick, ratio, peak
memory, plus the derived pipeline / data / tensor-parallel efficiencies. Single-GPU jobs run side by side,
one per GPU (CUDA_VISIBLE_DEVICES); multi-GPU jobs run under torchrun on all GPUs, one at a time.

  python benchmarks/gpu/run_bench.py --yardstick .bench/gpt_baseline.py --configs gpt1.3b llama1b gpt2.7b
  python benchmarks/gpu/run_bench.py ... --configs gpt1.3b gpt1.3b:nocompile --profile gpt1.3b --extra-jobs attn

A config may carry variants after a colon (`gpt1.3b:nocompile`, `gpt1.3b-dp2:graph+ctas8`): see VARIANTS.
"""
import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Where `gpt-small-text` finds its corpus (built by examples/quickstart.sh; copy it there for a GPU job).
# Absolute (a relative BENCH_TEXT_DATA means the caller's directory; the jobs run in the repository root).
TEXT_DATA = os.path.abspath(os.environ.get("BENCH_TEXT_DATA", os.path.join(ROOT, "data", "quickstart")))
COMMON = (
    "--bf16 --mock-data --tokenizer-type NullTokenizer --hidden-dropout 0 --attention-dropout 0 "
    "--lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --eval-iters 0 --eval-interval 100000 --log-throughput"
)
MODELS = {
    "gpt1.3b": (
        "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 "
        "--max-position-embeddings 2048 --micro-batch-size 8 --vocab-size 50303",
        "--layers 24 --hidden 2048 --heads 16 --seq 2048 --mbs 8",
    ),
    "llama1b": (
        "--num-layers 16 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 "
        "--group-query-attention --num-query-groups 8 --seq-length 4096 --max-position-embeddings 4096 "
        "--micro-batch-size 4 --normalization RMSNorm --swiglu --position-embedding-type rope "
        "--disable-bias-linear --untie-embeddings-and-output-weights --vocab-size 31999",
        "--llama --layers 16 --hidden 2048 --heads 16 --kv-heads 8 --ffn 5632 --seq 4096 --mbs 4 --vocab 32000",
    ),
    "gpt2.7b": (
        "--num-layers 32 --hidden-size 2560 --num-attention-heads 20 --seq-length 4096 "
        "--max-position-embeddings 4096 --micro-batch-size 4 --vocab-size 50303",
        "--layers 32 --hidden 2560 --heads 20 --seq 4096 --mbs 4",
    ),
    # Numerics check on real text (the quickstart Shakespeare corpus, GPT-2 BPE), no yardstick.
    "gpt-small-text": (
        "--num-layers 12 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
        "--max-position-embeddings 1024 --micro-batch-size 8 --tokenizer-type GPT2BPETokenizer "
        f"--data-path {TEXT_DATA}/shakespeare_text_document --vocab-file {TEXT_DATA}/vocab.json "
        f"--merge-file {TEXT_DATA}/merges.txt --split 969,30,1",
        None,
    ),
    "tiny": (  # a CPU dry run of this script
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
        "--micro-batch-size 2 --vocab-size 4200",
        "--layers 2 --hidden 64 --heads 4 --seq 64 --mbs 2 --vocab 4200",
    ),
}
# name -> (model, gpus, extra flags, global batch size, train iters, log interval)
CONFIGS = {
    "gpt1.3b": ("gpt1.3b", 1, "", 8, 40, 5),
    "llama1b": ("llama1b", 1, "", 4, 20, 5),
    "gpt2.7b": ("gpt2.7b", 1, "", 4, 15, 5),
    "gpt1.3b-pp1-m8": ("gpt1.3b", 1, "", 64, 8, 2),
    "gpt1.3b-dp2": ("gpt1.3b", 2, "--overlap-grad-reduce", 16, 40, 5),
    "gpt1.3b-tp2-sp": ("gpt1.3b", 2, "--tensor-model-parallel-size 2 --sequence-parallel", 8, 20, 5),
    "gpt1.3b-pp2-m8": ("gpt1.3b", 2, "--pipeline-model-parallel-size 2", 64, 8, 2),
    # 13 + 11 layers: the last stage also runs the output layer and loss (about two layers' worth of work).
    "gpt1.3b-pp2-m8-split": ("gpt1.3b", 2, "--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 13",
                             64, 8, 2),
    "gpt1.3b-pp1-m16": ("gpt1.3b", 1, "", 128, 6, 2),
    "gpt1.3b-pp2-m16-split": ("gpt1.3b", 2, "--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 13",
                              128, 6, 2),
    "gpt1.3b-dp2-distopt": ("gpt1.3b", 2, "--overlap-grad-reduce --use-distributed-optimizer --overlap-param-gather",
                            16, 40, 5),
    "gpt1.3b-dp2-nocheck": ("gpt1.3b", 2, "--overlap-grad-reduce --no-check-for-nan-in-loss-and-grad", 16, 20, 5),
    "text200": ("gpt-small-text", 1, "--lr 3e-4 --lr-warmup-iters 20", 16, 200, 10),
    "text200-mbs4": ("gpt-small-text", 1, "--lr 3e-4 --lr-warmup-iters 20 --micro-batch-size 4", 16, 200, 10),
    # GPT-1.3B curves with a warm-up (the throughput configs start Adam at full lr, where the curves of
    # numerically different but correct paths drift apart within a few iterations)
    "gpt1.3b-warm100": ("gpt1.3b", 1, "--lr-warmup-iters 20", 8, 100, 10),
    "tiny": ("tiny", 1, "", 4, 6, 2),
    "tiny-pp2": ("tiny", 2, "--pipeline-model-parallel-size 2", 8, 6, 2),
}
# Variants: the optimisation plan's flags (megatron/core/optimization_plan; the run prints the plan it chose) and
# NCCL environment switches.
VARIANTS = {
    "": {},
    "nocompile": {"flags": "--compile-layers off"},
    "compile": {"flags": "--compile-layers on"},
    "tracelin": {"flags": "--compile-linears on"},  # TP linears traced into the compiled layers
    "eager": {"flags": "--compile-layers off --fusion-kernels eager"},
    "p2p": {"flags": "--tp-comm-overlap-transport p2p"},  # overlap chunks by NCCL send/recv, not copy engine
    "simple": {"NCCL_PROTO": "Simple"},  # NCCL's bandwidth protocol only (no LL / LL128)
    "ctas8": {"NCCL_MAX_CTAS": "8"},  # fewer SMs for NCCL kernels that overlap compute
    "graph": {"flags": "--enable-cuda-graph"},  # per-layer CUDA graphs
    "tpoverlap": {"flags": "--tp-comm-overlap"},  # SP all-gather / reduce-scatter pipelined with the GEMMs
    "fp8": {"flags": "--fp8-format hybrid --fp8-recipe tensorwise"},  # FP8 GEMMs, current scaling
    "fp8d": {"flags": "--fp8-format hybrid"},  # FP8 GEMMs, delayed scaling (Megatron's default recipe)
    # FP8 parameters: the distributed optimizer (also at DP=1) gathers FP8 bytes, the forward uses them as they are
    "fp8params": {"flags": "--fp8-format hybrid --fp8-recipe tensorwise --fp8-param-gather "
                           "--use-distributed-optimizer"},
    # the first and last layers keep bf16 GEMMs (Megatron's rule: not with delayed scaling)
    "fp8edges": {"flags": "--fp8-format hybrid --fp8-recipe tensorwise --first-last-layers-bf16"},
    "distopt": {"flags": "--use-distributed-optimizer"},  # the optimizer of fp8params, for a like-for-like pair
    # weight gradients returned in the model's dtype and added into main_grad by DDP's hook (what traced
    # linears do), instead of one fp32-output GEMM into main_grad
    "nogaf": {"flags": "--no-gradient-accumulation-fusion"},
}
TFLOPS_RE = re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)")
ELAPSED_RE = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
LOSS_RE = re.compile(r"lm loss: ([0-9.E+-]+)")
MEM_RE = re.compile(r"max allocated: ([0-9.]+)")
# torchrun rendezvous ports; BENCH_PORT_BASE keeps two run_bench processes on one machine apart
_PORTS = itertools.count(int(os.environ.get("BENCH_PORT_BASE", "29511")))
# kept from each job's log: progress, errors, and the optimisation plan's table (its title and rows)
KEEP_RE = re.compile(r"iteration|memory|Error|error|Traceback|warn|File \"|TFLOP|compile|optimisation plan|^  \w+ +\| ",
                     re.IGNORECASE)


class Job:
    """One subprocess on `gpus` GPUs; its output goes to a log file."""

    def __init__(self, name, cmd, gpus, env=None, kind="cmd"):
        self.name, self.cmd, self.gpus, self.env, self.kind = name, cmd, gpus, env or {}, kind
        self.proc = self.log_path = self.start = None
        self.wall_s = None
        self.devices = []

    def launch(self, devices, log_dir):
        self.devices = devices
        self.log_path = os.path.join(log_dir, re.sub(r"[^A-Za-z0-9_.-]", "_", self.name) + ".log")
        # job device i is the i-th device this process sees: a CUDA_VISIBLE_DEVICES given to run_bench (two
        # run_bench processes side by side, one per GPU) is honoured, not replaced
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        names = [visible[d] if d < len(visible) else str(d) for d in devices]
        env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES=",".join(names))
        env.update(self.env)
        self.start = time.time()
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdout=open(self.log_path, "w"),
                                     stderr=subprocess.STDOUT)

    def poll(self):
        if self.proc.poll() is None:
            return False
        self.wall_s = round(time.time() - self.start, 1)
        return True

    def log(self):
        with open(self.log_path) as f:
            return f.read()


def ours_job(config, iters_override=None, profile_out=None):
    name, _, variant = config.partition(":")
    model, gpus, flags, gbs, iters, interval = CONFIGS[name]
    iters = iters_override or iters
    script = [os.path.join(ROOT, "pretrain_gpt.py")]
    profile = ""
    if profile_out:
        # Two profiled iterations after the last logged one, so the logged numbers stay unaffected.
        profile = f" --profile --use-pytorch-profiler --profile-step-start {iters + 1} --profile-step-end {iters + 3}"
        script = [os.path.join(ROOT, "benchmarks", "gpu", "profile_pretrain.py"), "--profile-out", profile_out, "--"]
        iters += 3
    common = COMMON if "--data-path" not in MODELS[model][0] else COMMON.replace(
        "--mock-data --tokenizer-type NullTokenizer ", "")
    args = f"{MODELS[model][0]} {common} {flags} --global-batch-size {gbs} --train-iters {iters} --log-interval {interval}"
    args += profile
    env = {}
    for part in filter(None, variant.split("+")):  # variants combine: gpt1.3b-dp2:graph+ctas8
        settings = dict(VARIANTS[part])
        args += " " + settings.pop("flags", "")
        env.update(settings)
    launcher = [sys.executable]
    if gpus > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc-per-node={gpus}", "--master-port", str(next(_PORTS))]
    cmd = launcher + script + args.split()
    if "--tensor-model-parallel-size" in flags:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # Megatron's setting for TP/SP communication ordering
    job = Job(config, cmd, gpus, env, kind="ours")
    job.interval = interval
    return job


def yardstick_job(path, model, steps=12):
    return Job(f"yardstick:{model}", [sys.executable, path, "--compile", "--steps", str(steps)]
               + MODELS[model][1].split(), 1, kind="yard")


def run_jobs(jobs, num_gpus, log_dir, deadline):
    """Start jobs in order as GPUs free up (a job never overtakes an earlier one that waits for GPUs)."""
    pending, running, free = list(jobs), [], list(range(num_gpus))
    while pending or running:
        for job in list(running):
            if job.poll():
                running.remove(job)
                free.extend(job.devices)
                print(f"[bench] done {job.name} rc={job.proc.returncode} in {job.wall_s}s", flush=True)
        while pending and len(free) >= pending[0].gpus:
            job = pending.pop(0)
            devices, free = free[: job.gpus], free[job.gpus:]
            job.launch(devices, log_dir)
            running.append(job)
            print(f"[bench] start {job.name} on GPUs {devices}", flush=True)
        if time.time() > deadline:
            for job in running:
                job.proc.kill()
            print(f"[bench] deadline: killed {[j.name for j in running]}, skipped {[j.name for j in pending]}")
            break
        time.sleep(1)


def parse_ours(job):
    log = job.log()
    tflops = [float(v) for v in TFLOPS_RE.findall(log)]
    elapsed = [float(v) for v in ELAPSED_RE.findall(log)]
    mem = [float(v) for v in MEM_RE.findall(log)]
    steady_ms = statistics.median(elapsed[1:]) if len(elapsed) > 1 else None
    compile_s = (elapsed[0] - steady_ms) * job.interval / 1000 if steady_ms else None
    return {
        "rc": job.proc.returncode if job.proc else None, "wall_s": job.wall_s,
        "tflops": round(statistics.median(tflops[1:]), 1) if len(tflops) > 1 else None,
        "tflops_all": tflops, "step_ms": round(steady_ms, 1) if steady_ms else None,
        "first_interval_extra_s": round(compile_s, 1) if compile_s else None,
        "losses": [float(v) for v in LOSS_RE.findall(log)],
        "peak_mem_gb": round(max(mem) / 1024, 1) if mem else None,
    }


def parse_yardstick(job):
    for line in job.log().splitlines()[::-1]:
        if line.startswith("{"):
            return json.loads(line)
    return {"error": job.log()[-1500:]}


def derived(results):
    """Pipeline bubble / efficiency, DP scaling and TP+SP fraction from the measured rows."""
    t = {name: r["ours"].get("tflops") for name, r in results.items() if r.get("ours")}
    out = {}
    for name, value in t.items():
        found = re.match(r"gpt1\.3b-pp2-m(\d+)", name)
        if found and value and t.get(f"gpt1.3b-pp1-m{found.group(1)}"):
            p, m = 2, int(found.group(1))
            out[f"{name}_ideal_efficiency"] = round(1 - (p - 1) / (m + p - 1), 3)
            out[f"{name}_efficiency_vs_pp1"] = round(value / t[f"gpt1.3b-pp1-m{m}"], 3)
    for name, value in t.items():  # variants too: each against the plain 1-GPU run of the same job
        one_gpu = t.get("gpt1.3b:graph" if "graph" in name.partition(":")[2] else "gpt1.3b")
        if value and one_gpu and name.startswith("gpt1.3b-dp2"):
            out[f"{name}_scaling_efficiency"] = round(value / one_gpu, 3)
        if value and one_gpu and name.startswith("gpt1.3b-tp2-sp"):
            out[f"{name}_fraction_of_tp1_per_gpu"] = round(value / one_gpu, 3)
    return out


def trimmed(text, keep_tail=40):
    lines = text.splitlines()
    kept = [line for line in lines[:-keep_tail] if KEEP_RE.search(line)][-80:]
    return "\n".join(kept + lines[-keep_tail:])


def build_jobs(args):
    """Single-GPU jobs first (two at a time), then multi-GPU jobs, then the `--late` configs and tests."""
    single, multi, late = [], [], []
    for config in args.configs + args.late:
        profile_out = os.path.join(args.out, f"profile_{config.replace(':', '_').replace('+', '_')}.txt") if config in args.profile else None
        job = ours_job(config, profile_out=profile_out)
        (late if config in args.late else single if job.gpus == 1 else multi).append(job)
        model = CONFIGS[config.partition(":")[0]][0]
        if args.yardstick and MODELS[model][1] and f"yardstick:{model}" not in [j.name for j in single + late]:
            (late if config in args.late else single).append(yardstick_job(args.yardstick, model))
    for extra in args.extra_jobs:
        if extra == "attn":
            single.append(Job("attn_bench", [sys.executable, os.path.join(ROOT, "benchmarks/gpu/attn_bench.py")], 1))
        elif extra == "gputests":
            late.append(Job("gpu_tests", [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                          "tests/unit/fusions", "tests/unit/models/test_models_gpu.py",
                                          "tests/unit/test_deferred_checks.py"], 1))
            # Its own job (one GPU): the ranks of its CPU tests are spawned processes without a GPU (tests/harness).
            late.append(Job("gpu_tests_tp", [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                             "tests/unit/tensor_parallel"], 1))
        elif extra in ("graphtests", "graphtests-tp", "graphtests-fp8"):  # --enable-cuda-graph against eager runs
            only = {"graphtests-tp": ["-k", "tp2"], "graphtests-fp8": ["-k", "fp8"]}.get(extra, [])
            late.append(Job("graph_tests", [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-s",
                                            "tests/functional/test_cuda_graph_gpu.py"] + only, 2))
        elif extra == "gputests2":  # the NCCL parity tests, on 2 GPUs
            late.append(Job("gpu_tests_2", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-s",
                                            "tests/parity/test_tp_nccl_gpu.py", "tests/parity/test_dp_nccl.py",
                                            "tests/parity/test_pp_nccl_gpu.py"], 2))
        elif extra == "fp8":  # FP8 kernels against their fallbacks, and the FP8 GEMMs against bf16
            late.append(Job("fp8_tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                          "tests/unit/fp8"], 1))
            late.append(Job("fp8_bench", [sys.executable, os.path.join(ROOT, "benchmarks/gpu/fp8_bench.py")], 1))
        elif extra == "kernels":  # fused pieces compiled with specialised vs symbolic shapes (one GPU each)
            for script in ("ce_bench.py", "rope_bench.py"):
                late.append(Job(script[:-3], [sys.executable, os.path.join(ROOT, "benchmarks/gpu", script)], 1))
        elif extra == "activations":  # SwiGLU backward (compiled vs Triton), bias-GELU with tanh vs sigmoid
            script = os.path.join(ROOT, "benchmarks/gpu/activation_bench.py")
            late.append(Job("activation_bench", [sys.executable, script], 1))
        elif extra == "adam":  # the fused AdamW step with the bf16 parameter copy: GPU test, then its timing
            late.append(Job("adam_tests", [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                                           "tests/unit/optimizer/test_fused_adamw_gpu.py"], 1))
            late.append(Job("adam_bench", [sys.executable, os.path.join(ROOT, "benchmarks/gpu/adam_bench.py")], 1))
        elif extra == "contention":  # GEMM slow-down under SP transfers, NCCL vs copy engine (2 GPUs)
            late.append(Job("tp_contention", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                              os.path.join(ROOT, "benchmarks/gpu/tp_contention_bench.py")], 2))
    return single + multi + late


def report(jobs, args):
    results = {}
    for job in jobs:
        if job.kind == "ours":
            model = CONFIGS[job.name.partition(":")[0]][0]
            results[job.name] = {"ours": parse_ours(job) if job.proc else {}, "model": model}
        elif job.kind == "yard" and job.proc:
            results[job.name] = {"yardstick": parse_yardstick(job)}
    summary = {"results": results, "derived": derived(results), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(args.out, "bench_logs.txt"), "w") as f:
        for job in jobs:
            if job.proc:
                f.write(f"\n===== {job.name} rc={job.proc.returncode} wall={job.wall_s}s\n{trimmed(job.log())}\n")
    print(f"\n{'config':24s} {'ours':>7s} {'yard':>7s} {'ratio':>6s} {'peakGB':>7s} {'yardGB':>7s} {'step ms':>8s} "
          f"{'1st+s':>6s} rc")
    for name, r in results.items():
        if "ours" not in r:
            continue
        o, y = r["ours"], results.get(f"yardstick:{r['model']}", {}).get("yardstick", {})
        ratio = o["tflops"] / y["tflops"] if o.get("tflops") and y.get("tflops") else float("nan")
        print(f"{name:24s} {str(o.get('tflops')):>7s} {str(y.get('tflops')):>7s} {ratio:6.3f} "
              f"{str(o.get('peak_mem_gb')):>7s} {str(y.get('peak_mem_gb')):>7s} {str(o.get('step_ms')):>8s} "
              f"{str(o.get('first_interval_extra_s')):>6s} {o.get('rc')}")
    print(json.dumps(summary["derived"]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--yardstick", default=None, help="path of a copy of gpt_baseline.py (omit: no yardstick)")
    parser.add_argument("--configs", nargs="*", default=["gpt1.3b"])
    parser.add_argument("--extra-jobs", nargs="*", default=[], help="attn, gputests, gputests2, graphtests, graphtests-tp, graphtests-fp8, contention, fp8, kernels, activations, adam")
    parser.add_argument("--late", nargs="*", default=[], help="configs to run after all the others")
    parser.add_argument("--profile", nargs="*", default=[], help="configs whose run also writes a profile table")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible)")
    parser.add_argument("--budget-s", type=float, default=540, help="kill what still runs after this long")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)  # before any job runs: the results must have somewhere to go
    if args.gpus is None:
        args.gpus = int(subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                                       capture_output=True, text=True).stdout.strip() or 1)
    jobs = build_jobs(args)
    if any(job.gpus > args.gpus for job in jobs):
        raise SystemExit(f"a job needs more than the {args.gpus} GPUs available")
    with tempfile.TemporaryDirectory() as log_dir:
        run_jobs(jobs, args.gpus, log_dir, time.time() + args.budget_s)
        report(jobs, args)


if __name__ == "__main__":
    main()
