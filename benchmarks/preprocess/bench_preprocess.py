"""Benchmark tools/preprocess_data.py (GPT-2 BPE, --append-eod) against Megatron-LM's published figures.

Megatron-LM 0.13.1 on a 2-core machine, `--workers 2 --append-eod`, GPT-2 BPE: 6.0 s for a 1.8 M-token
corpus (762 docs, 5.5 MB) and 16.8 s for it repeated 10 times (18 M tokens, ~1.07 M tokens/s).

Usage:
  python tools/quickstart_corpus.py --output-dir data/quickstart      # corpus + GPT-2 files
  python benchmarks/preprocess/bench_preprocess.py --input data/quickstart/shakespeare.jsonl \
      --vocab-file data/quickstart/vocab.json --merge-file data/quickstart/merges.txt

For each (repeat, workers) it reports wall seconds, CPU seconds (user+sys of the tool and its
workers), tokens and tokens/s, and checks every worker count wrote byte-identical files. On a shared
machine wall time is inflated by other load; the CPU column and the load average are printed so the
figures can be judged.
"""
import argparse
import filecmp
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MEGATRON_TOKENS_PER_S = 1.07e6


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(inp, prefix, vocab, merges, workers):
    cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", inp, "--output-prefix", prefix,
           "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
           "--workers", str(workers), "--append-eod", "--no-progress-bar"]
    cpu0, t0 = children_cpu(), time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    wall, cpu = time.perf_counter() - t0, children_cpu() - cpu0
    tokens = int(re.search(r"documents, (\d+) tokens", out).group(1))
    return wall, cpu, tokens


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--input", required=True)
    parser.add_argument("--vocab-file", required=True)
    parser.add_argument("--merge-file", required=True)
    parser.add_argument("--repeats", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench_pp_")
    print(f"load average before: {os.getloadavg()}")
    print("| corpus | workers | wall s | CPU s | tokens | tokens/s (wall) | x Megatron |")
    print("|---|---|---|---|---|---|---|")
    for repeat in args.repeats:
        inp = os.path.join(tmp, f"x{repeat}.jsonl")
        with open(args.input, "rb") as src, open(inp, "wb") as dst:
            data = src.read()
            for _ in range(repeat):
                dst.write(data)
        outputs = []
        for workers in args.workers:
            prefix = os.path.join(tmp, f"r{repeat}_w{workers}")
            wall, cpu, tokens = run_once(inp, prefix, args.vocab_file, args.merge_file, workers)
            outputs.append(prefix + "_text_document")
            rate = tokens / wall
            print(f"| x{repeat} | {workers} | {wall:.2f} | {cpu:.2f} | {tokens} | {rate / 1e6:.2f} M | "
                  f"{rate / MEGATRON_TOKENS_PER_S:.2f} |", flush=True)
        same = all(filecmp.cmp(outputs[0] + ext, o + ext, shallow=False) for o in outputs[1:] for ext in (".bin", ".idx"))
        print(f"x{repeat}: outputs byte-identical across worker counts: {same}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
