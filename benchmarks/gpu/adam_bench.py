"""The optimizer step of bf16 training with fp32 main params at Llama-1B shapes, on one GPU: torch's fused
AdamW followed by `torch._foreach_copy_` into the bf16 model params (the step before the fused kernel)
against the fused AdamW + copy kernel (`megatron.core.optimizer.fused_adamw`). Not part of the product.

  python benchmarks/gpu/adam_bench.py [--steps 30] [--sweep]

Params: 16 layers of [4096, 2048], [2048, 2048], [11264, 2048], [2048, 5632] and two [2048] norms, two
[32000, 2048] embeddings and a final norm (886M elements): fp32 main params with grads and Adam state, bf16
model copies, weight decay on the matrices only. `grad_scale` is set before every step as the deferred clip
sets it: 1.0 (nothing clipped; the kernel then does not write the grads back) and 1.25 (clipped; torch writes
the grads back in both cases). Every variant runs warm-up steps, then single steps timed with CUDA events;
one JSON line per variant and grad scale: median and min ms and GB/s of the bytes the step has to move (read
param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq and the bf16 copy: 30 bytes per element,
34 with the grads written back). A first line checks one step of the kernel against torch on a few tensors;
a last one gives a device-to-device copy's GB/s as the yardstick. `--sweep` also times other launch settings
of the kernel (block size, warps, blocks per program) and its fp32-arithmetic variant.
"""
import argparse
import functools
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core.optimizer import _adamw_triton, fused_adamw  # noqa: E402

LAYER_SHAPES = [(4096, 2048), (2048, 2048), (11264, 2048), (2048, 5632), (2048,), (2048,)]
SWEEP = [  # (block, warps, blocks per program, fp64 arithmetic)
    (1024, 8, 8, False), (512, 4, 8, True), (1024, 8, 4, True), (1024, 8, 16, True), (2048, 16, 8, True),
    (1024, 4, 8, True), (2048, 8, 8, True),
]


def llama_1b_shapes(layers=16):
    """Every param shape of the model, in order."""
    return [shape for _ in range(layers) for shape in LAYER_SHAPES] + [(32000, 2048), (32000, 2048), (2048,)]


def build(shapes, seed=0):
    """fp32 main params with grads, their bf16 model copies and a fused torch AdamW over two groups."""
    torch.manual_seed(seed)
    mains = [torch.empty(shape, device="cuda").normal_(0, 0.02) for shape in shapes]
    for main in mains:
        main.grad = torch.randn_like(main) * 1e-3
    models = [main.to(torch.bfloat16) for main in mains]
    decay = [main for main in mains if main.dim() > 1]
    no_decay = [main for main in mains if main.dim() == 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    return mains, models, opt


def torch_step(opt, grad_scale):
    """torch's fused AdamW, dropping the deferred clip's divisor afterwards as `_inner_step` does."""
    opt.grad_scale = grad_scale
    opt.step()
    del opt.grad_scale


def fused_step(opt, mains, models, grad_scale):
    """The product's fused path: the kernel for the large params, torch + copy for the rest."""
    opt.grad_scale = grad_scale
    written = fused_adamw.step_with_model_copy(opt, mains, models)
    del opt.grad_scale
    done = {id(main) for main in written}
    rest = [(main, model) for main, model in zip(mains, models) if id(main) not in done]
    torch._foreach_copy_([model for _, model in rest], [main for main, _ in rest])


def time_steps(fn, steps, warmup=3):
    """(median ms, min ms) of single calls of `fn`, each between two CUDA events."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) for start, end in events]
    return statistics.median(times), min(times)


def report(variant, grad_scale, timing, nbytes, **extra):
    median, fastest = timing
    print(json.dumps({"variant": variant, "grad_scale": grad_scale, "ms_median": round(median, 3),
                      "ms_min": round(fastest, 3), "gbps": round(nbytes / median / 1e6, 1), **extra}), flush=True)


def _ulp(values):
    """The spacing of the floating-point numbers at |values| (their own dtype), as fp64."""
    magnitude = values.abs()
    return (torch.nextafter(magnitude, torch.full_like(magnitude, float("inf"))) - magnitude).double().clamp_min(1e-45)


def check_against_torch(shapes, fp64_math, steps=3):
    """`steps` steps of both paths from the same state on a few tensors (the kernel with fp64 or fp32
    arithmetic): how many elements differ, and by how much."""
    ref_mains, ref_models, ref_opt = build(shapes, seed=1)
    mains, models, opt = build(shapes, seed=1)
    grad_scale = torch.tensor([1.25], device="cuda")
    launch = fused_adamw._launch_step
    fused_adamw._launch_step = lambda *args, **kwargs: launch(*args, fp64_math=fp64_math, **kwargs)
    try:
        for _ in range(steps):
            torch_step(ref_opt, grad_scale)
            torch._foreach_copy_(ref_models, ref_mains)
            fused_step(opt, mains, models, grad_scale)
    finally:
        fused_adamw._launch_step = launch
    result = {"check": f"{steps} steps vs torch fused AdamW + copy", "fp64_math": fp64_math,
              "elements": sum(m.numel() for m in mains)}
    pairs = {"param": list(zip(mains, ref_mains)), "model": list(zip(models, ref_models)),
             "exp_avg": [(opt.state[a]["exp_avg"], ref_opt.state[b]["exp_avg"]) for a, b in zip(mains, ref_mains)],
             "exp_avg_sq": [(opt.state[a]["exp_avg_sq"], ref_opt.state[b]["exp_avg_sq"])
                            for a, b in zip(mains, ref_mains)]}
    for name, tensors in pairs.items():
        result[f"{name}_differing"] = sum(int((a != b).sum()) for a, b in tensors)
        result[f"{name}_max_abs_diff"] = max(float((a.double() - b.double()).abs().max()) for a, b in tensors)
        result[f"{name}_max_ulps"] = max(float(((a.double() - b.double()).abs() / _ulp(b)).max()) for a, b in tensors)
    for side, side_models, side_mains in (("ours", models, mains), ("torch", ref_models, ref_mains)):
        result[f"{side}_model_not_rounded_main"] = _rounding_mismatches(side_models, side_mains)
    print(json.dumps(result), flush=True)


def _rounding_mismatches(models, mains, show=4):
    """How many model-copy elements are not their main param rounded to the model dtype (round to nearest
    even), and the first few: tensor index, element index, main value, model value, rounded main."""
    count, first = 0, []
    for index, (model, main) in enumerate(zip(models, mains)):
        rounded = main.to(model.dtype)
        bad = (model != rounded).flatten().nonzero().flatten()
        count += int(bad.numel())
        for element in bad[: max(0, show - len(first))].tolist():
            first.append([index, element, float(main.flatten()[element]), float(model.flatten()[element]),
                          float(rounded.flatten()[element])])
    return {"count": count, "first": first}


def yardstick(gib=4):
    """A device-to-device copy of `gib` GiB: GB/s counting read and write."""
    src = torch.empty(gib << 28, device="cuda")
    dst = torch.empty_like(src)
    timing = time_steps(lambda: dst.copy_(src), 20)
    report("yardstick: device copy", None, timing, 2 * src.numel() * 4)


def run_variants(args, mains, models, opt, numel, grad_scale):
    """Time every variant at one grad scale."""
    scale = torch.tensor([grad_scale], device="cuda")
    step_bytes = (30 + (4 if grad_scale != 1.0 else 0)) * numel
    torch_bytes = (28 + 4) * numel
    report("torch fused AdamW (step only)", grad_scale, time_steps(lambda: torch_step(opt, scale), args.steps),
           torch_bytes)
    report("foreach copy (copy only)", grad_scale,
           time_steps(lambda: torch._foreach_copy_(models, mains), args.steps), 6 * numel)
    report("torch fused AdamW + foreach copy", grad_scale, time_steps(
        lambda: (torch_step(opt, scale), torch._foreach_copy_(models, mains)), args.steps), step_bytes)
    report("fused AdamW + copy kernel", grad_scale, time_steps(
        lambda: fused_step(opt, mains, models, scale), args.steps), step_bytes,
        block=_adamw_triton._BLOCK, warps=_adamw_triton._WARPS, blocks_per_program=_adamw_triton._BLOCKS_PER_PROGRAM,
        fp64_math=_adamw_triton.FP64_MATH)
    if not args.sweep:
        return
    default_launch = fused_adamw._launch_step
    try:
        for block, warps, per_program, fp64 in SWEEP:
            fused_adamw._launch_step = functools.partial(_adamw_triton.adamw_step, block=block, num_warps=warps,
                                                         blocks_per_program=per_program, fp64_math=fp64)
            report("fused AdamW + copy kernel (sweep)", grad_scale, time_steps(
                lambda: fused_step(opt, mains, models, scale), args.steps), step_bytes, block=block, warps=warps,
                blocks_per_program=per_program, fp64_math=fp64)
    finally:
        fused_adamw._launch_step = default_launch


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--sweep", action="store_true", help="also time other launch settings of the kernel")
    args = parser.parse_args()
    shapes = llama_1b_shapes()
    numel = sum(torch.Size(shape).numel() for shape in shapes)
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "params": numel, "tensors": len(shapes),
                      "fused_tensors": sum(torch.Size(s).numel() >= fused_adamw.FUSED_COPY_MIN_NUMEL for s in shapes)}),
          flush=True)
    for fp64_math in (True, False):
        check_against_torch(llama_1b_shapes(layers=1)[:6] + [(2048, 3001)], fp64_math)
    mains, models, opt = build(shapes)
    for grad_scale in (1.0, 1.25):
        run_variants(args, mains, models, opt, numel, grad_scale)
    del mains, models, opt
    torch.cuda.empty_cache()
    yardstick()


if __name__ == "__main__":
    main()
