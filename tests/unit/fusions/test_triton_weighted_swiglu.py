"""The experts' one-pass weighted SwiGLU backward (`_triton_swiglu.weighted_swiglu_back`) against the eager
formula: in Triton's interpreter on CPU (fp32, several column blocks per row and a partial last one; skipped
where Triton is not installed) and on CUDA in bf16 (skipped without a GPU)."""
import os
import subprocess
import sys

import pytest
import torch

from megatron.core.fusions import _triton_swiglu
from megatron.core.transformer.moe import experts
from tests.harness import repo_root

ROOT = repo_root()


def _operands(rows, ffn, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    y = (torch.randn(rows, 2 * ffn, generator=gen) * 2).to(device=device, dtype=dtype)
    g = torch.randn(rows, ffn, generator=gen).to(device=device, dtype=dtype)
    weights = torch.rand(rows, 1, generator=gen).to(device)
    return g, y, weights


_SCRIPT = """
import torch
from megatron.core.fusions import _triton_swiglu
from megatron.core.transformer.moe import experts
from tests.unit.fusions.test_triton_weighted_swiglu import _operands

g, y, weights = _operands(5, 40, torch.float32)
got_y, got_w = _triton_swiglu.weighted_swiglu_back(g, y, weights, block=16, num_warps=1)
want_y, want_w = experts._weighted_swiglu_backward(g, y, weights)
torch.testing.assert_close(got_y, want_y, rtol=1e-6, atol=1e-6)
torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
assert got_w.shape == weights.shape and got_w.dtype == weights.dtype
print("ok")
"""


def test_interpreted_kernel_matches_the_formula():
    """Five rows of 40 columns in blocks of 16 (three per row, the last partial), in a fresh process with
    TRITON_INTERPRET=1 set before Triton is imported (the kernel calls Triton's own jitted helpers)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


@pytest.mark.gpu
def test_cuda_kernel_matches_the_formula_in_bf16_and_is_used_by_the_experts(monkeypatch):
    if not _triton_swiglu._HAVE_TRITON:
        pytest.skip("needs Triton")
    g, y, weights = _operands(8192, 5632, torch.bfloat16, device="cuda")
    assert _triton_swiglu.weighted_usable(g, y, weights)
    got_y, got_w = _triton_swiglu.weighted_swiglu_back(g, y, weights)
    want_y, want_w = experts._weighted_swiglu_backward(g.float(), y.float(), weights)
    assert ((got_y.float() - want_y).norm() / want_y.norm()).item() < 5e-3  # one bf16 rounding
    torch.testing.assert_close(got_w, want_w, rtol=1e-4, atol=1e-4)
    calls = []
    monkeypatch.setattr(_triton_swiglu, "weighted_swiglu_back", lambda *args: calls.append(1) or
                        experts._weighted_swiglu_backward_fused(*args))
    x = y.clone().requires_grad_()
    experts.weighted_swiglu(x, weights).backward(g)
    assert calls == [1]
