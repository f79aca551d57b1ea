"""Benchmark tools/preprocess_data.py (GPT-2 BPE, --append-eod) against Megatron-LM's published figures.

Megatron-LM 0.13.1 on a 2-core machine, `--workers 2 --append-eod`, GPT-2 BPE: 6.0 s for a 1.8 M-token
corpus (762 docs, 5.5 MB) and 16.8 s for it repeated 10 times (18 M tokens, ~1.07 M tokens/s).

Usage:
  python tools/quickstart_corpus.py --output-dir data/quickstart      # corpus + GPT-2 files
  python benchmarks/preprocess/bench_preprocess.py --input data/quickstart/shakespeare.jsonl \
      --vocab-file data/quickstart/vocab.json --merge-file data/quickstart/merges.txt \
      [--repeats 10] [--workers 1 2] [--runs 5] [--baseline old/preprocess_data.py]

Each configuration runs `--runs` times after one warm-up; with `--baseline` (an older copy of the tool)
the baseline and the current tool alternate run by run. Reported per configuration: wall seconds
(min / median / max of whole-process times), median CPU seconds (user+sys of the tool and its workers),
the CPU seconds other processes used during the run (from /proc/stat: 0 on an idle machine; the
load average would count this benchmark itself), the median wall time of the quiet runs (other
processes used < 0.5 CPU-s) and tokens/s at the median wall time. Every output
is compared byte for byte with the first one written for that corpus (any worker count, either tool).
"""
import argparse
import filecmp
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MEGATRON_TOKENS_PER_S = 1.07e6
# A run counts as quiet when other processes used less CPU than this meanwhile.
QUIET_CPU_S = 0.5


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def busy_cpu() -> float:
    """CPU seconds all processes of the machine have used (Linux /proc/stat), or 0 elsewhere."""
    try:
        with open("/proc/stat") as stream:
            fields = [int(x) for x in stream.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def wait_for_idle(seconds: float, timeout: float) -> None:
    """Return once other processes used < 5% of one CPU over `seconds` (or after `timeout`)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        busy0 = busy_cpu()
        time.sleep(seconds)
        if busy_cpu() - busy0 < 0.05 * seconds:
            return


def run_once(tool, inp, prefix, vocab, merges, workers):
    """(wall s, CPU s of the tool, CPU s used by other processes meanwhile, tokens)."""
    cmd = [sys.executable, tool, "--input", inp, "--output-prefix", prefix,
           "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
           "--workers", str(workers), "--append-eod", "--no-progress-bar"]
    cpu0, busy0, t0 = children_cpu(), busy_cpu(), time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    wall, cpu = time.perf_counter() - t0, children_cpu() - cpu0
    others = max(0.0, busy_cpu() - busy0 - cpu)
    tokens = int(re.search(r"documents, (\d+) tokens", out).group(1))
    return wall, cpu, others, tokens


def same_files(a: str, b: str) -> bool:
    return all(filecmp.cmp(a + ext, b + ext, shallow=False) for ext in (".bin", ".idx"))


def bench_corpus(args, tools, inp, tmp, repeat):
    """All (tool, workers) configurations on one corpus, runs alternated; prints one row each."""
    configs = [(name, tool, w) for w in args.workers for name, tool in tools]
    times = {c: [] for c in configs}
    reference, identical = None, True
    for run in range(args.runs + 1):
        for config in configs:
            name, tool, workers = config
            prefix = os.path.join(tmp, f"r{repeat}_{name}_w{workers}")
            if args.wait_idle:
                wait_for_idle(args.pause, args.wait_idle)
            else:
                time.sleep(args.pause)  # let the load average and the caches settle between runs
            wall, cpu, others, tokens = run_once(tool, inp, prefix, args.vocab_file, args.merge_file, workers)
            out = prefix + "_text_document"
            reference = reference or out
            identical &= same_files(reference, out)
            if args.verbose:
                print(f"  {name} w{workers} run {run}: {wall:.2f} s wall, {cpu:.2f} CPU-s, others {others:.2f} CPU-s",
                      flush=True)
            if run > 0:  # run 0 is the warm-up
                times[config].append((wall, cpu, others, tokens))
    for (name, _, workers), rows in times.items():
        walls = sorted(r[0] for r in rows)
        median = statistics.median(walls)
        rate = rows[0][3] / median
        quiet = [r[0] for r in rows if r[2] < QUIET_CPU_S]
        quiet_text = f"{statistics.median(quiet):.2f} ({len(quiet)})" if quiet else "- (0)"
        print(f"| x{repeat} | {name} | {workers} | {walls[0]:.2f} / {median:.2f} / {walls[-1]:.2f} | {quiet_text} | "
              f"{statistics.median(r[1] for r in rows):.2f} | {statistics.median(r[2] for r in rows):.2f} | "
              f"{rows[0][3]} | {rate / 1e6:.2f} M | {rate / MEGATRON_TOKENS_PER_S:.2f} |", flush=True)
    print(f"x{repeat}: outputs byte-identical across tools and worker counts: {identical}")


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--input", required=True)
    parser.add_argument("--vocab-file", required=True)
    parser.add_argument("--merge-file", required=True)
    parser.add_argument("--repeats", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--runs", type=int, default=5, help="counted runs per configuration (after a warm-up)")
    parser.add_argument("--baseline", default=None, help="an older preprocess_data.py to alternate with")
    parser.add_argument("--pause", type=float, default=2.0, help="seconds of idle before each run")
    parser.add_argument("--verbose", action="store_true", help="print every run")
    parser.add_argument("--wait-idle", type=float, default=0.0,
                        help="before each run wait (up to this many seconds) for --pause seconds without other jobs")
    args = parser.parse_args()
    tools = [("current", os.path.join(ROOT, "tools", "preprocess_data.py"))]
    if args.baseline:
        tools.insert(0, ("baseline", os.path.abspath(args.baseline)))
    tmp = tempfile.mkdtemp(prefix="bench_pp_")
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}")
    print("| corpus | tool | workers | wall s min / median / max | median wall s of quiet runs (count) "
          "| CPU s (median) | other jobs' CPU s during a run (median) | tokens | tokens/s (median wall) | x Megatron |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for repeat in args.repeats:
        inp = os.path.join(tmp, f"x{repeat}.jsonl")
        with open(args.input, "rb") as src, open(inp, "wb") as dst:
            data = src.read()
            for _ in range(repeat):
                dst.write(data)
        bench_corpus(args, tools, inp, tmp, repeat)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
