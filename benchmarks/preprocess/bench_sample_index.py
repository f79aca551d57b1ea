"""Time `helpers.build_sample_idx` and `helpers.build_blending_indices` against Megatron's C++ loops.

Both loops are re-implemented here in C from the spec (compiled with the system C compiler at run
time, -O3; int32 sample index as Megatron picks for these sizes) so they run at compiled speed; when no
compiler is present only the numpy paths are timed. Every output is checked equal to the C loop's.
Usage: python benchmarks/preprocess/bench_sample_index.py [--docs N] [--blend-size N]
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


def best_of(n, fn):
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t)
    return best, result


def ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p)


def bench_sample_idx(lib, docs, epochs, seq_length):
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 4096, size=docs, dtype=np.int32)
    doc_idx = np.tile(np.arange(docs, dtype=np.int32), epochs)
    rng.shuffle(doc_idx)
    tokens = int(sizes.sum())
    t_np, ours = best_of(5, lambda: helpers.build_sample_idx(sizes, doc_idx, seq_length, epochs, tokens, True, 1))
    line = f"| sample index, {docs:,} docs x {epochs} epochs ({len(ours) - 1:,} samples) | {t_np:.3f} s |"
    if lib is None:
        print(line + " no C compiler |")
        return
    out = np.zeros((len(ours), 2), dtype=np.int32)
    t_c, _ = best_of(5, lambda: lib.sample_idx(ptr(sizes), ptr(doc_idx), ctypes.c_int64(len(doc_idx)),
                                                ctypes.c_int32(seq_length), ctypes.c_int64(len(ours) - 1),
                                                ctypes.c_int32(1), ptr(out)))
    print(f"{line} {t_c:.3f} s | {np.array_equal(out, ours)} |", flush=True)


def bench_blending(lib, name, weights, size):
    weights = np.asarray(weights, dtype=np.float64)
    weights /= weights.sum()
    ours_index, ours_sample = np.zeros(size, np.int16), np.zeros(size, np.int64)
    t_np, _ = best_of(1, lambda: helpers.build_blending_indices(ours_index, ours_sample, weights, len(weights), size))
    line = f"| blending, {name}, {size:,} samples | {t_np:.3f} s |"
    if lib is None:
        print(line + " no C compiler |")
        return
    index, sample, counts = np.zeros(size, np.int16), np.zeros(size, np.int64), np.zeros(len(weights), np.int64)
    t_c, _ = best_of(3, lambda: lib.blending(ptr(index), ptr(sample), ptr(weights), ctypes.c_int32(len(weights)),
                                              ctypes.c_int64(size), ptr(counts)))
    same = np.array_equal(index, ours_index) and np.array_equal(sample, ours_sample)
    print(f"{line} {t_c:.3f} s | {same} |", flush=True)


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--docs", type=int, default=1_000_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--blend-size", type=int, default=10_000_000)
    args = parser.parse_args()
    lib = compile_loops()
    print(f"load average: {os.getloadavg()}")
    print("| case | numpy | C loop (Megatron's algorithm, -O3) | equal |")
    print("|---|---|---|---|")
    bench_sample_idx(lib, args.docs, args.epochs, args.seq_length)
    bench_sample_idx(lib, args.docs // 10, args.epochs, args.seq_length)
    rng = np.random.default_rng(0)
    for name, weights in [("weights 0.5/0.3/0.2", [0.5, 0.3, 0.2]), ("weights 0.7/0.3", [0.7, 0.3]),
                          ("8 equal weights", [1.0] * 8), ("3 random weights", rng.random(3)),
                          ("10 random weights", rng.random(10))]:
        bench_blending(lib, name, weights, args.blend_size)
    print(f"load average: {os.getloadavg()}")


if __name__ == "__main__":
    main()
