"""bf16 error of the SSD scan's outputs and gradients against the fp64 recurrence (`tests/unit/ssm/naive_ssd`,
on the same bf16 inputs), for this project's Triton kernels and, beside them, mamba-ssm's Triton SSD: the bf16
noise level of the algorithm at the shapes of `tests/unit/ssm/test_triton_ssd_gpu.py`. One GPU; prints JSON.

  python benchmarks/gpu/ssd_precision.py --mamba-ssm-src .bench/mamba_ssm-2.3.2.post1
"""
import argparse
import json
import os
import sys

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tests.unit.ssm.test_triton_ssd_gpu as T  # noqa: E402
from tests.unit.ssm.naive_ssd import make_inputs  # noqa: E402


def _mamba(fn, chunk):
    def run(t):
        D = t["D"]
        return fn(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk, D=D, z=t["z"], dt_bias=t["dt_bias"],
                  initial_states=t["initial_states"], dt_softplus=True, return_final_states=True)
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mamba-ssm-src", default=None)
    args = parser.parse_args()
    mamba = None
    if args.mamba_ssm_src:
        import ssd_bench
        mamba = ssd_bench._import_mamba(args.mamba_ssm_src, None)
    for shape in T.SHAPES[:3]:
        b, seqlen, h, p, g, n, chunk, D, z, bias, init = shape
        if D == "hp":
            continue  # mamba-ssm takes D per head only; the test shape with D per head dim is left out
        ops = make_inputs(b, seqlen, h, p, g, n, "cuda", torch.bfloat16, D=D, z=z, bias=bias, init=init)
        gen = torch.Generator().manual_seed(5)
        grads = (torch.randn(b, seqlen, h, p, generator=gen).double().cuda(),
                 torch.randn(b, h, p, n, generator=gen).double().cuda())
        want = T._run(T._naive, ops, grads)
        names = ["y", "final"] + [k for k in T.NAMES if ops[k] is not None]
        row = {"shape": f"l{seqlen}-g{g}-q{chunk}"}
        for tag, fn in (("ours", T._triton(ops, chunk)), ("mamba_ssm", _mamba(mamba, chunk) if mamba else None)):
            if fn is None:
                continue
            try:
                got = T._run(fn, ops, grads)
                row[tag] = {nm: round(T._rel(a, w), 5) for nm, a, w in zip(names, got, want)}
            except Exception as error:
                row[tag] = f"failed: {type(error).__name__}: {error}"[:300]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
