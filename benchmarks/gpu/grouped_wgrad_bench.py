"""The MoE experts' grouped weight gradient accumulated into fp32 main_grad, on one GPU: torch's path
(`torch._grouped_mm` weight gradient in bf16, then `main_grad.add_` in fp32) against the Triton kernel that
accumulates in its epilogue (`megatron.core.transformer.moe._triton_grouped_wgrad`). Not part of the product.

  python benchmarks/gpu/grouped_wgrad_bench.py [--repeats 20] [--cases fc1-balanced,fc2-skewed] [--sweep]

Cases: N = 8192 routed rows over G = 8 experts, fc1 (K 2048, M 11264) and fc2 (K 5632, M 2048), balanced
(1024 rows each) and 4:1 skewed (no size a multiple of 64). One JSON line per case and variant: median ms
of `--repeats` calls (after 3 warm-ups, each call between two CUDA events) and TFLOP/s of 2*N*K*M:
- `torch`: `_grouped_mm` + `add_` (what the kernel replaces), and its two parts `torch gemm only` (bf16
  gradient, no accumulation) and `torch add only`;
- `triton`: the kernel with the default launch setting of its module (LAUNCH).
Each Triton line has `max_rel_err`: max |kernel - torch| / max |torch| after one call of each from the same
main_grad (torch's gradient is rounded to bf16 before its add, so ~1e-3 is expected; a wrong setting shows
as O(1)), plus the compiled kernel's registers, spills and shared memory. `--sweep` does the same for every
setting of SWEEP, one line each (a setting that does not compile prints its error).
On a machine without CUDA the script says so and exits 0.
"""
import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core.transformer.moe import _triton_grouped_wgrad as wgrad  # noqa: E402

ROWS, GROUPS = 8192, 8
SHAPES = {"fc1": (2048, 11264), "fc2": (5632, 2048)}  # (K, M)
Launch = wgrad.WgradLaunch
# (block_k, block_m, block_r, group_k, num_warps, num_stages, epilogue_split); the first is the default. The
# comments: shared memory, registers a thread and programs an SM fit, compiled for sm_90 by Triton 3.9 on CPU.
SWEEP = [
    Launch(128, 128, 64, 8, 8, 3, 4),  # 96 KiB, 112 registers, 2 an SM
    Launch(128, 128, 64, 8, 8, 3, 2),  # 96 KiB, 126, 2
    Launch(128, 128, 64, 8, 8, 3, 1),  # 96 KiB, 186, 1
    Launch(128, 128, 64, 8, 8, 4, 4),  # 128 KiB, 122, 1
    Launch(128, 128, 32, 8, 8, 4, 4),  # 64 KiB, 106, 2
    Launch(128, 128, 128, 8, 8, 2, 4),  # 128 KiB, 119, 1
    Launch(128, 128, 64, 4, 8, 3, 4),  # as the default, narrower bands
    Launch(128, 128, 64, 16, 8, 3, 4),  # as the default, one band per expert at fc1
    Launch(128, 256, 64, 8, 8, 3, 4),  # 144 KiB, 200, 1
    Launch(128, 256, 64, 8, 8, 4, 4),  # 192 KiB, 204, 1
    Launch(256, 128, 64, 8, 8, 3, 4),  # 144 KiB, 202, 1
    Launch(64, 128, 64, 8, 4, 4, 2),  # 96 KiB, 128, 2
    Launch(64, 256, 64, 8, 8, 4, 4),  # 160 KiB, 120, 1
]


def balanced_sizes(rows=ROWS, groups=GROUPS):
    """Equal group sizes (the remainder on the first groups)."""
    return [rows // groups + (1 if group < rows % groups else 0) for group in range(groups)]


def skewed_sizes(rows=ROWS, groups=GROUPS):
    """4:1 skew: groups alternate between weight 4 and 1, sizes rounded off any multiple of 64 by one row
    either way, the last group taking what is left."""
    weights = [4 if group % 2 == 0 else 1 for group in range(groups)]
    sizes = [rows * weight // sum(weights) + (1 if group % 2 else -1) for group, weight in enumerate(weights)]
    sizes[-1] = rows - sum(sizes[:-1])
    return sizes


def cases():
    """{name: (K, M, group sizes)}."""
    return {f"{shape}-{kind}": (*SHAPES[shape], sizes(ROWS, GROUPS))
            for shape in SHAPES for kind, sizes in (("balanced", balanced_sizes), ("skewed", skewed_sizes))}


def build(k, m, sizes, seed=0):
    """x [N, K] and dy [N, M] in bf16, int32 end offsets [G] and main_grad [G, K, M] fp32, on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = sum(sizes)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(rows, m, device="cuda", dtype=torch.bfloat16, generator=gen)
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    main_grad = torch.randn(len(sizes), k, m, device="cuda", generator=gen)
    return x, dy, offsets, main_grad


def torch_path(main_grad, x, dy, offsets):
    """What the kernel replaces: the bf16 grouped gradient [K, N] x [N, M] -> [G, K, M], then an fp32 add."""
    main_grad.add_(torch._grouped_mm(x.t(), dy, offs=offsets))


def time_ms(fn, repeats, warmup=3):
    """Median ms of single calls of `fn`, each between two CUDA events."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def report(case, variant, ms, flops, **extra):
    """One JSON line: the case, the variant, its median ms and TFLOP/s, and `extra`."""
    print(json.dumps({"case": case, "variant": variant, "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1),
                      **extra}), flush=True)


def time_torch(name, operands, repeats, flops):
    """The three torch lines of one case."""
    x, dy, offsets, main_grad = operands
    report(name, "torch", time_ms(lambda: torch_path(main_grad, x, dy, offsets), repeats), flops)
    report(name, "torch gemm only", time_ms(lambda: torch._grouped_mm(x.t(), dy, offs=offsets), repeats), flops)
    grad = torch._grouped_mm(x.t(), dy, offs=offsets)
    report(name, "torch add only", time_ms(lambda: main_grad.add_(grad), repeats), flops)


def check_and_time(name, variant, operands, launch, repeats, flops):
    """One Triton line: the setting's error against torch's path from the same main_grad, its compiled
    resources and its time."""
    x, dy, offsets, main_grad = operands
    expected, actual = main_grad.clone(), main_grad.clone()
    torch_path(expected, x, dy, offsets)
    try:
        compiled = wgrad._launch(actual, x, dy, offsets, launch)
    except Exception as error:  # a setting that does not compile or launch (shared memory, registers)
        print(json.dumps({"case": name, "variant": variant, "launch": repr(launch),
                          "error": f"{type(error).__name__}: {error}"[:300]}), flush=True)
        return
    max_rel_err = ((actual - expected).abs().max() / expected.abs().max()).item()
    ms = time_ms(lambda: wgrad._launch(main_grad, x, dy, offsets, launch), repeats)
    report(name, variant, ms, flops, max_rel_err=float(f"{max_rel_err:.2e}"), ok=max_rel_err < 1e-2,
           launch=repr(launch), regs=compiled.n_regs, spills=compiled.n_spills, shared=compiled.metadata.shared)


def sweep(name, operands, repeats, flops, settings=SWEEP):
    """One Triton line per launch setting of `settings`."""
    for launch in settings:
        check_and_time(name, "triton sweep", operands, launch, repeats, flops)


def main(argv=None) -> int:
    """Time every case of `--cases` (and the sweep); 0 also where there is no GPU."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cases", default=",".join(cases()), help="comma-separated case names")
    parser.add_argument("--sweep", action="store_true", help="also time every launch setting of SWEEP")
    args = parser.parse_args(argv)
    table = cases()
    unknown = [name for name in args.cases.split(",") if name not in table]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {list(table)}")
    if not torch.cuda.is_available():
        print("grouped_wgrad_bench: needs a CUDA GPU; nothing to do here.")
        return 0
    import triton  # optional: only the GPU run needs it

    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "triton": triton.__version__, "default": repr(wgrad.LAUNCH[torch.bfloat16])}))
    for name in args.cases.split(","):
        k, m, sizes = table[name]
        operands = build(k, m, sizes)
        flops = 2 * sum(sizes) * k * m
        print(json.dumps({"case": name, "K": k, "M": m, "sizes": sizes}), flush=True)
        time_torch(name, operands, args.repeats, flops)
        check_and_time(name, "triton", operands, wgrad.LAUNCH[torch.bfloat16], args.repeats, flops)
        if args.sweep:
            sweep(name, operands, args.repeats, flops)
        del operands
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
