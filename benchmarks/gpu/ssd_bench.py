"""Mamba-2 SSD scan forward+backward on one GPU: the Triton kernels of `megatron.core.ssm.ops.triton_ssd`
against mamba-ssm's Triton SSD (`mamba_chunk_scan_combined`) and the HBM bound of the operands.

  python benchmarks/gpu/ssd_bench.py --mamba-ssm-src .bench/mamba_ssm-2.3.2.post1 [--einops-src .bench/einops_src]
  python benchmarks/gpu/ssd_bench.py --smoke     # tiny shape; on a machine without CUDA by Triton's interpreter

Shape (issue 26): batch 8, seq 4096, 64 heads of dim 64, state 128, 8 groups, chunk 128, bf16, D per head,
dt_bias with softplus, no z (Megatron's MambaMixer passes z to the gated norm, not to the scan). mamba-ssm comes
from an unpacked sdist directory (no network, no CUDA extension): the bench puts empty package modules for
`mamba_ssm` (whose __init__ imports the CUDA extension) in sys.modules and imports only its Triton module;
einops (which that module imports) from --einops-src when it is not installed. The HBM bound: the bytes of
the inputs read and outputs written once each by the forward and once by the backward (dy in, dx, d dt, dB,
dC out), over the measured bandwidth of a 2 GiB device copy (and over 4.8 TB/s, the H200's peak).
Prints one JSON line.
"""
import argparse
import json
import os
import sys
import tarfile
import types
from pathlib import Path

if "--smoke" in sys.argv:
    try:
        import torch
        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    except ImportError:
        pass

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from megatron.core.ssm.ops.triton_ssd import ssd_chunk_scan  # noqa: E402


def _import_mamba(src, einops_src):
    """mamba_chunk_scan_combined from the sdist tree `src`, without running mamba_ssm/__init__.py."""
    src = Path(src).resolve()
    if not (src / "mamba_ssm").is_dir():  # a parent folder, or one holding the .tar.gz only
        found = sorted(src.rglob("ssd_combined.py"))
        if not found:
            for tarball in sorted(src.glob("mamba_ssm-*.tar.gz")) + sorted(src.parent.glob("mamba_ssm-*.tar.gz")):
                tarfile.open(tarball).extractall(tarball.parent)
            found = sorted(src.parent.rglob("ssd_combined.py"))
        if not found:
            raise ImportError(f"no mamba_ssm/ops/triton/ssd_combined.py under {src}: {sorted(os.listdir(src))}")
        src = found[0].parents[3]
    einops_dir = Path(einops_src).resolve() if einops_src else src.parent / "einops_src"
    try:
        import einops  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(einops_dir))
    for name in ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton", "mamba_ssm.utils"):
        module = types.ModuleType(name)
        module.__path__ = [str(src.joinpath(*name.split(".")))]
        sys.modules[name] = module
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    return mamba_chunk_scan_combined


def _operands(b, seqlen, h, p, g, n, device, dtype):
    gen = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    return {"x": r(b, seqlen, h, p).to(dtype).requires_grad_(), "dt": (r(b, seqlen, h, scale=0.5) - 2).to(dtype)
            .requires_grad_(), "A": (-torch.rand(h, generator=gen) * 15 - 1).to(device).requires_grad_(),
            "B": r(b, seqlen, g, n).to(dtype).requires_grad_(), "C": r(b, seqlen, g, n).to(dtype).requires_grad_(),
            "D": torch.ones(h, device=device).requires_grad_(), "dt_bias": r(h, scale=0.5).requires_grad_()}


def _time(fn, iters, warmup):
    """Median milliseconds of fn() over `iters` runs after `warmup` (CUDA events; wall clock on CPU)."""
    import time
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _copy_bandwidth():
    """Bytes per second of a 2 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = _time(lambda: dst.copy_(src), 10, 3)
    return 2 * src.numel() * 2 / (ms * 1e-3)


def _hbm_bytes(ops):
    """Bytes of the operands read and results written by a forward and a backward (each once)."""
    size = {k: v.numel() * v.element_size() for k, v in ops.items()}
    fwd = sum(size.values()) + size["x"]  # read every input, write y
    bwd = 2 * sum(size.values()) + size["x"]  # read dy and the inputs, write every gradient
    return fwd + bwd


def _step(fn, ops, dy, chunk):
    def run():
        for v in ops.values():
            v.grad = None
        y = fn(ops["x"], ops["dt"], ops["A"], ops["B"], ops["C"], chunk, D=ops["D"], dt_bias=ops["dt_bias"],
               dt_softplus=True)
        y.backward(dy)
        return y
    return run


def _bf16_accurate():
    """Whether the current launch table keeps every bf16 case of the GPU kernel test within its bound (the
    2026-12-03 H200 jobs: dx_db / dc at 8 warps gave d dt 0.27 of its max at the l200-g3 shape, Triton 3.6)."""
    import tests.unit.ssm.test_triton_ssd_gpu as kernel_test
    for shape in kernel_test.SHAPES[:3]:
        try:
            kernel_test.test_ssd_bf16_within_bf16_noise(shape)
        except AssertionError:
            return False
    return True


def _sweep(ours, ops, dy, chunk, iters):
    """For each kernel in triton_ssd.LAUNCH, the fwd+bwd milliseconds of each (num_warps, num_stages); keeps
    the fastest setting of each kernel that stays bf16-accurate (`_bf16_accurate`) before moving to the next."""
    from megatron.core.ssm.ops import triton_ssd
    found = {}
    for kernel in list(triton_ssd.LAUNCH):
        times = {}
        for setting in [(w, st) for w in (4, 8) for st in (1, 2)]:
            triton_ssd.LAUNCH[kernel] = setting
            try:
                if not _bf16_accurate():
                    times[setting] = float("inf")
                    print(f"{kernel} {setting}: bf16 gradients outside the test bound, not a candidate",
                          file=sys.stderr)
                    continue
                times[setting] = _time(ours, iters, 2)
            except Exception as err:  # an out-of-resources launch: skip the setting
                times[setting] = float("inf")
                print(f"{kernel} {setting}: {type(err).__name__}", file=sys.stderr)
        best = min(times, key=times.get)
        triton_ssd.LAUNCH[kernel] = best
        found[kernel] = {"best": list(best), "ms": {f"{w}w{st}s": round(t, 3) for (w, st), t in times.items()}}
    return found


def _profile(ours):
    """Milliseconds per CUDA kernel of one fwd+bwd (torch.profiler), largest first."""
    from torch.profiler import ProfilerActivity, profile
    ours()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ours()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 1e3) for e in prof.key_averages() if e.device_time_total > 0]
    return {name[:60]: round(ms, 3) for name, ms in sorted(rows, key=lambda r: -r[1])[:12]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mamba-ssm-src", default=None, help="unpacked mamba-ssm sdist directory")
    ap.add_argument("--einops-src", default=None, help="directory holding the einops package")
    ap.add_argument("--smoke", action="store_true", help="tiny shape, a few iterations")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="time each kernel's (num_warps, num_stages) options first")
    ap.add_argument("--profile", action="store_true", help="also report the time of each kernel of one fwd+bwd")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if args.smoke:
        shape, chunk, iters, warmup = (1, 48, 4, 16, 2, 16), 16, 1, 0
    else:
        shape, chunk, iters, warmup = (8, 4096, 64, 64, 8, 128), 128, args.iters, 3
    dtype = torch.bfloat16 if cuda else torch.float32
    ops = _operands(*shape, device, dtype)
    dy = torch.randn(ops["x"].shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    result = {"shape": dict(zip(("batch", "seq", "heads", "head_dim", "groups", "state"), shape)),
              "chunk": chunk, "dtype": str(dtype).replace("torch.", ""), "device": torch.cuda.get_device_name()
              if cuda else "cpu (interpreter)"}
    ours = _step(ssd_chunk_scan, ops, dy, chunk)
    if args.sweep and cuda:
        result["sweep"] = _sweep(ours, ops, dy, chunk, 5)
    result["ours_fwd_bwd_ms"] = _time(ours, iters, warmup)
    if args.profile and cuda:
        result["ours_kernels_ms"] = _profile(ours)
    fwd = lambda: ssd_chunk_scan(ops["x"], ops["dt"], ops["A"], ops["B"], ops["C"], chunk, D=ops["D"],  # noqa: E731
                                 dt_bias=ops["dt_bias"], dt_softplus=True)
    with torch.no_grad():
        result["ours_fwd_ms"] = _time(fwd, iters, warmup)
    y_ours = ours().detach().float()
    grads_ours = {k: v.grad.detach().float() for k, v in ops.items()}
    if args.mamba_ssm_src and cuda:
        try:
            mamba = _step(_import_mamba(args.mamba_ssm_src, args.einops_src), ops, dy, chunk)
        except ImportError as err:
            mamba, result["mamba_ssm_error"] = None, f"{type(err).__name__}: {err}"
    if args.mamba_ssm_src and cuda and mamba is not None:
        result["mamba_ssm_fwd_bwd_ms"] = _time(mamba, iters, warmup)
        y_m = mamba().detach().float()
        scale = lambda t: t.abs().max().item()  # noqa: E731
        result["rel_diff_vs_mamba_ssm"] = {"y": (y_ours - y_m).abs().max().item() / scale(y_m), **{
            "d" + k: (grads_ours[k] - v.grad.float()).abs().max().item() / scale(v.grad) for k, v in ops.items()}}
        result["speedup_vs_mamba_ssm"] = result["mamba_ssm_fwd_bwd_ms"] / result["ours_fwd_bwd_ms"]
    if cuda:
        nbytes, bw = _hbm_bytes(ops), _copy_bandwidth()
        result.update(hbm_bytes=nbytes, copy_bandwidth_tb_s=bw / 1e12, hbm_bound_ms=nbytes / bw * 1e3,
                      hbm_bound_peak_ms=nbytes / 4.8e12 * 1e3)
        result["ours_over_hbm_bound"] = result["ours_fwd_bwd_ms"] / result["hbm_bound_ms"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
