"""Time `helpers.build_sample_idx` and `helpers.build_blending_indices` against Megatron's C++ loops.

Both loops are re-implemented here in C from the spec (compiled with the system C compiler at run
time, -O3; int32 sample index as Megatron picks for these sizes) so they run at compiled speed; when no
compiler is present only the numpy paths are timed. Every output is checked equal to the C loop's.
Usage: python benchmarks/preprocess/bench_sample_index.py [--docs N] [--blend-size N] [--rounds N]
"""
import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from megatron.core.datasets import helpers  # noqa: E402

C_LOOPS = r"""
#include <stdint.h>
void sample_idx(const int32_t* sizes, const int32_t* doc_idx, int64_t n_doc_idx, int32_t seq_length,
                int64_t num_samples, int32_t extra, int32_t* out) {
  int64_t sample = 0, pos = 0; int32_t offset = 0;
  out[0] = 0; out[1] = 0; ++sample;
  while (sample <= num_samples) {
    int32_t remaining = seq_length + extra;
    while (remaining != 0) {
      int32_t doc_length = sizes[doc_idx[pos]] - offset;
      remaining -= doc_length;
      if (remaining <= 0) { offset += remaining + doc_length - extra; remaining = 0; }
      else {
        if (pos == n_doc_idx - 1) { offset = sizes[doc_idx[pos]] - extra; break; }
        ++pos; offset = 0;
      }
    }
    out[2 * sample] = (int32_t)pos; out[2 * sample + 1] = offset; ++sample;
  }
}
void blending(int16_t* dataset_index, int64_t* dataset_sample_index, const double* weights,
              int32_t num_datasets, int64_t size, int64_t* counts) {
  for (int32_t d = 0; d < num_datasets; ++d) counts[d] = 0;
  for (int64_t i = 0; i < size; ++i) {
    double t = i > 1 ? (double)i : 1.0;
    int32_t best = 0; double best_error = weights[0] * t - (double)counts[0];
    for (int32_t d = 1; d < num_datasets; ++d) {
      double error = weights[d] * t - (double)counts[d];
      if (error > best_error) { best_error = error; best = d; }
    }
    dataset_index[i] = (int16_t)best; dataset_sample_index[i] = counts[best]; counts[best] += 1;
  }
}
"""


def compile_loops():
    tmp = tempfile.mkdtemp()
    src, lib = os.path.join(tmp, "loops.c"), os.path.join(tmp, "loops.so")
    with open(src, "w") as f:
        f.write(C_LOOPS)
    try:
        subprocess.run(["cc", "-O3", "-shared", "-fPIC", src, "-o", lib], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return ctypes.CDLL(lib)


def interleaved(rounds, fns):
    """Run the functions in turn `rounds` times; per function (best wall s, median wall s, best CPU s)
    and its last result. CPU time (this process) is less disturbed by other jobs on a shared machine."""
    walls, cpus, results = [[] for _ in fns], [[] for _ in fns], [None] * len(fns)
    for _ in range(rounds):
        for k, fn in enumerate(fns):
            w, c = time.perf_counter(), time.process_time()
            results[k] = fn()
            walls[k].append(time.perf_counter() - w)
            cpus[k].append(time.process_time() - c)
    return [(min(w), float(np.median(w)), min(c)) for w, c in zip(walls, cpus)], results


def fmt(t):
    return f"{t[0]:.4f} / {t[1]:.4f} / {t[2]:.4f} s"


def ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p)


def bench_sample_idx(lib, docs, epochs, seq_length, rounds):
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 4096, size=docs, dtype=np.int32)
    doc_idx = np.tile(np.arange(docs, dtype=np.int32), epochs)
    rng.shuffle(doc_idx)
    tokens = int(sizes.sum())
    ours = lambda: helpers.build_sample_idx(sizes, doc_idx, seq_length, epochs, tokens, True, 1)  # noqa: E731
    samples = (epochs * tokens - 1) // seq_length
    name = f"| sample index, {docs:,} docs x {epochs} epochs ({samples:,} samples)"
    if lib is None:
        (t_np,), _ = interleaved(rounds, [ours])
        print(f"{name} | {fmt(t_np)} | no C compiler | | |")
        return
    out = np.zeros((samples + 1, 2), dtype=np.int32)
    c_loop = lambda: lib.sample_idx(ptr(sizes), ptr(doc_idx), ctypes.c_int64(len(doc_idx)),  # noqa: E731
                                    ctypes.c_int32(seq_length), ctypes.c_int64(samples), ctypes.c_int32(1), ptr(out))
    (t_np, t_c), (result, _) = interleaved(rounds, [ours, c_loop])
    print(f"{name} | {fmt(t_np)} | {fmt(t_c)} | {t_np[0] / t_c[0]:.2f} / {t_np[2] / t_c[2]:.2f} | "
          f"{np.array_equal(out, result)} |", flush=True)


def bench_blending(lib, name, weights, size, rounds):
    weights = np.asarray(weights, dtype=np.float64)
    weights /= weights.sum()
    ours_index, ours_sample = np.zeros(size, np.int16), np.zeros(size, np.int64)
    ours = lambda: helpers.build_blending_indices(ours_index, ours_sample, weights, len(weights), size)  # noqa: E731
    line = f"| blending, {name}, {size:,} samples"
    if lib is None:
        (t_np,), _ = interleaved(rounds, [ours])
        print(f"{line} | {fmt(t_np)} | no C compiler | | |")
        return
    index, sample, counts = np.zeros(size, np.int16), np.zeros(size, np.int64), np.zeros(len(weights), np.int64)
    c_loop = lambda: lib.blending(ptr(index), ptr(sample), ptr(weights), ctypes.c_int32(len(weights)),  # noqa: E731
                                  ctypes.c_int64(size), ptr(counts))
    (t_np, t_c), _ = interleaved(rounds, [ours, c_loop])
    same = np.array_equal(index, ours_index) and np.array_equal(sample, ours_sample)
    print(f"{line} | {fmt(t_np)} | {fmt(t_c)} | {t_np[0] / t_c[0]:.2f} / {t_np[2] / t_c[2]:.2f} | {same} |", flush=True)


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--docs", type=int, default=1_000_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--blend-size", type=int, default=10_000_000)
    parser.add_argument("--rounds", type=int, default=15, help="interleaved runs of each function")
    parser.add_argument("--skip-blending", action="store_true")
    args = parser.parse_args()
    lib = compile_loops()
    print(f"load average: {os.getloadavg()}")
    print("| case | numpy: best wall / median wall / best CPU | C loop (Megatron's algorithm, -O3): same | "
          "ratio best wall / best CPU | equal |")
    print("|---|---|---|---|---|")
    bench_sample_idx(lib, args.docs, args.epochs, args.seq_length, args.rounds)
    bench_sample_idx(lib, args.docs // 10, args.epochs, args.seq_length, args.rounds)
    rng = np.random.default_rng(0)
    cases = [("weights 0.5/0.3/0.2", [0.5, 0.3, 0.2]), ("weights 0.7/0.3", [0.7, 0.3]), ("8 equal weights", [1.0] * 8),
             ("3 random weights", rng.random(3)), ("10 random weights", rng.random(10)),
             ("50 random weights", rng.random(50))]
    for name, weights in [] if args.skip_blending else cases:
        bench_blending(lib, name, weights, args.blend_size, max(3, args.rounds // 5))
    print(f"load average: {os.getloadavg()}")


if __name__ == "__main__":
    main()
