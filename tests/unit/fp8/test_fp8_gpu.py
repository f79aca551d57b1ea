"""The FP8 fast path on a GPU with FP8 tensor cores (skipped elsewhere): the Triton quantization kernels
against the plain-PyTorch fallback (bit for bit), `torch._scaled_mm` against the fp32 emulation, and the
FP8 linear on the GPU against the same linear emulated on the CPU."""
import pytest
import torch

from megatron.core.fp8 import kernels
from megatron.core.fp8.kernels import E4M3, E5M2
from megatron.core.fp8.linear import fp8_linear
from megatron.core.fp8.recipe import Fp8LinearState, Fp8Recipe


def _needs_fp8_gpu():
    if not torch.cuda.is_available() or not kernels.native_fp8_device(torch.device("cuda")):
        pytest.skip("needs a GPU with FP8 tensor cores")
    if kernels._triton_kernels() is None:
        pytest.skip("needs Triton")


def _fallback(tensor, amax_, dtype, transpose):
    scale = kernels.scale_from_amax(amax_, dtype)
    q = (tensor.float() * scale).clamp_(-kernels.FP8_MAX[dtype], kernels.FP8_MAX[dtype]).to(dtype)
    return q, q.t().contiguous() if transpose else None, scale.reciprocal()


def _mismatch(name, got, want):
    got, want = got.view(torch.uint8), want.view(torch.uint8)
    bad = (got != want).nonzero()
    return f"{name}: {len(bad)} of {got.numel()} differ, first at {bad[:3].tolist()}" if len(bad) else ""


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 2048), (1000, 72), (64, 70), (3, 5), (130, 64)])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_triton_quantize_matches_the_fallback_bit_for_bit(shape, dtype):
    _needs_fp8_gpu()
    generator = torch.Generator(device="cuda").manual_seed(shape[0])
    x = (torch.randn(shape, device="cuda", generator=generator) * 3).to(torch.bfloat16)
    amax_ = kernels.amax(x)
    reference_amax = x.float().abs().max().reshape(1)
    assert torch.equal(amax_, reference_amax), (amax_, reference_amax)
    q, q_t, inv = kernels.quantize(x, amax_, dtype, transpose=True)
    rq, rq_t, rinv = _fallback(x, reference_amax, dtype, True)
    # the kernel divides exactly (IEEE); torch's CUDA reciprocal may be 1 ulp off
    assert (inv.view(torch.int32) - rinv.view(torch.int32)).abs().item() <= 1, (inv, rinv)
    problems = [_mismatch("q", q, rq), _mismatch("q^T", q_t, rq_t)]
    assert not any(problems), "; ".join(p for p in problems if p)
    recorded = torch.zeros(1, device="cuda")
    q2, _, _ = kernels.quantize(x, reference_amax / 2, dtype, amax_out=recorded)
    assert torch.equal(recorded, reference_amax)
    assert not _mismatch("saturated", q2, _fallback(x, reference_amax / 2, dtype, False)[0])


@pytest.mark.gpu
def test_native_scaled_mm_matches_the_emulation():
    _needs_fp8_gpu()
    generator = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(512, 256, device="cuda", generator=generator).to(torch.bfloat16)
    b = torch.randn(384, 256, device="cuda", generator=generator).to(torch.bfloat16)
    bias = torch.randn(384, device="cuda", generator=generator).to(torch.bfloat16)
    qa, _, ia = kernels.quantize(a, kernels.amax(a), E4M3)
    qb, _, ib = kernels.quantize(b, kernels.amax(b), E4M3)
    emulated = (qa.float() * ia) @ (qb.float() * ib).t() + bias.float()
    for fast_accum in (False, True):
        native = kernels.scaled_mm(qa, qb, ia, ib, torch.bfloat16, bias=bias, fast_accum=fast_accum).float()
        assert (native - emulated).norm() / emulated.norm() < 5e-3
    # fp32 output: what remains is the tensor cores' FP8 accumulation (1.3e-4 seen on an H200)
    full = kernels.scaled_mm(qa, qb, ia, ib, torch.float32)
    assert (full - (emulated - bias.float())).norm() / emulated.norm() < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_linear_on_gpu_matches_the_cpu_emulation(recipe):
    _needs_fp8_gpu()
    torch.manual_seed(0)
    x = torch.randn(64, 2, 256).to(torch.bfloat16)
    weight = (torch.randn(384, 256) * 0.05).to(torch.bfloat16)
    bias = torch.randn(384).to(torch.bfloat16)
    grad_out = torch.randn(64, 2, 384).to(torch.bfloat16)
    results = []
    for device in ("cpu", "cuda"):
        inputs = [t.detach().clone().to(device).requires_grad_(True) for t in (x, weight, bias)]
        state = Fp8LinearState(Fp8Recipe("hybrid", recipe=recipe))
        for _ in range(2):  # delayed scaling: the second call quantizes with the first call's amax
            for t in inputs:
                t.grad = None
            out = fp8_linear(inputs[0], inputs[1], inputs[2], state)
            out.backward(grad_out.to(device))
        results.append([out.detach().float().cpu()] + [t.grad.float().cpu() for t in inputs])
    for name, emulated, native in zip(("output", "input grad", "weight grad", "bias grad"), *results):
        error = (native - emulated).norm() / emulated.norm()
        assert error < 1e-2, f"{name}: relative difference {error:.2e}"
