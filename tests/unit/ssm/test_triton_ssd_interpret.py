"""The Triton SSD and conv1d kernels run by Triton's CPU interpreter on tiny shapes (two chunks, the second
partial; two groups of two heads; D, z, dt_bias and initial states), forward and every gradient against the
step-by-step recurrence of `naive_ssd` in fp64. TRITON_INTERPRET must be set before triton is imported, so
the check runs in a subprocess. Skipped where Triton is not installed."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]

_SCRIPT = r"""
import torch
from megatron.core.ssm.ops.triton_ssd import ssd_chunk_scan
from megatron.core.ssm.ops.triton_conv1d import causal_conv1d
from tests.unit.ssm.naive_ssd import make_inputs, naive_conv1d, naive_ssd

names = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
ops = make_inputs(2, 24, 4, 16, 2, 16, "cpu", torch.float32, D="h", z=True, init=True)
ref = {k: (v.detach().double().requires_grad_() if v is not None else None) for k, v in ops.items()}
y, fin = ssd_chunk_scan(ops["x"], ops["dt"], ops["A"], ops["B"], ops["C"], 16, D=ops["D"], z=ops["z"],
                        dt_bias=ops["dt_bias"], initial_states=ops["initial_states"], return_final_states=True)
yr, finr = naive_ssd(*(ref[k] for k in names[:5]), D=ref["D"], z=ref["z"], dt_bias=ref["dt_bias"],
                     initial_states=ref["initial_states"])
gen = torch.Generator().manual_seed(1)
gy, gf = torch.randn(yr.shape, generator=gen).double(), torch.randn(finr.shape, generator=gen).double()
((y.double() * gy).sum() + (fin.double() * gf).sum()).backward()
((yr * gy).sum() + (finr * gf).sum()).backward()
pairs = [("y", y, yr), ("final", fin, finr)] + [("d" + k, ops[k].grad, ref[k].grad) for k in names]
x = torch.randn(2, 24, 20, generator=gen).transpose(1, 2).requires_grad_()  # [b, d, l], channels last
w = torch.randn(20, 4, generator=gen, requires_grad=True)
bias = torch.randn(20, generator=gen, requires_grad=True)
xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, bias))
out, outr = causal_conv1d(x, w, bias, "silu"), naive_conv1d(xr, wr, br, "silu")
g = torch.randn(outr.shape, generator=gen).double()
(out.double() * g).sum().backward()
(outr * g).sum().backward()
pairs += [("conv y", out, outr), ("conv dx", x.grad, xr.grad), ("conv dw", w.grad, wr.grad),
          ("conv db", bias.grad, br.grad)]
bad = []
for name, got, want in pairs:
    err = (got.double() - want).abs().max().item() / want.abs().max().item()
    if not err <= 1e-5:
        bad.append(f"{name}: relative error {err:.2e}")
print("\n".join(bad) if bad else "ok")
"""


def test_triton_kernels_under_the_interpreter_match_the_recurrence():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "ok", proc.stdout
