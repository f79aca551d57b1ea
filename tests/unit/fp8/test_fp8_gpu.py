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


def _mismatch(name, got, want):
    """Positions whose FP8 bytes differ; a NaN matches any NaN (encodings of NaN may differ)."""
    got, want = got.cpu(), want.cpu()
    both_nan = got.float().isnan() & want.float().isnan()
    bad = ((got.view(torch.uint8) != want.view(torch.uint8)) & ~both_nan).nonzero()
    return f"{name}: {len(bad)} of {got.numel()} differ, first at {bad[:3].tolist()}" if len(bad) else ""


def _special_values(shape, generator):
    """Random values with a zero row, a NaN, an inf and a tiny value planted (when the shape has room)."""
    x = torch.randn(shape, device="cuda", generator=generator) * 3
    if x.numel() > 8:
        x.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), 1e-30], device="cuda")
        x[-1] = 0.0
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 2048), (1000, 72), (64, 70), (3, 5), (130, 64), (1, 9_000_000)])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan-inf-zero"])
def test_triton_quantize_matches_the_fallback_bit_for_bit(shape, dtype, special):
    """Triton (CUDA tensors) against the PyTorch fallback of the same functions (the CPU copy)."""
    _needs_fp8_gpu()
    generator = torch.Generator(device="cuda").manual_seed(shape[0])
    x = (_special_values(shape, generator) if special else torch.randn(shape, device="cuda", generator=generator) * 3)
    x = x.to(torch.bfloat16)
    amax_, reference_amax = kernels.amax(x), kernels.amax(x.cpu())
    torch.testing.assert_close(amax_.cpu(), reference_amax, rtol=0, atol=0, equal_nan=True)
    finite = x.float().abs().nan_to_num(0.0, posinf=0.0).max().reshape(1)  # a usable amax even with NaN / inf
    for used in (amax_, finite):
        q, q_t, inv = kernels.quantize(x, used, dtype, transpose=True)
        rq, rq_t, rinv = kernels.quantize(x.cpu(), used.cpu(), dtype, transpose=True)
        assert torch.equal(inv.cpu(), rinv), (inv, rinv)
        problems = [_mismatch("q", q, rq), _mismatch("q^T", q_t, rq_t)]
        assert not any(problems), "; ".join(p for p in problems if p)
    recorded = torch.zeros(1, device="cuda")
    q2, _, _ = kernels.quantize(x, finite / 2, dtype, amax_out=recorded)
    torch.testing.assert_close(recorded.cpu(), reference_amax, rtol=0, atol=0, equal_nan=True)
    assert not _mismatch("saturated", q2, kernels.quantize(x.cpu(), finite.cpu() / 2, dtype)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("history_len,use_max", [(1, False), (4, False), (4, True), (3, True)])
@pytest.mark.parametrize("shape", [(4096, 2048), (1000, 72), (130, 64)])
def test_triton_delayed_scaling_matches_the_fallback(history_len, use_max, shape):
    """Delayed scaling's two-kernel GPU path (scale read from the history, history updated by one program)
    against the PyTorch steps on the CPU: the same FP8 bytes, scales and histories over calls with and
    without recording, a NaN and an inf amax (neither recorded) included."""
    _needs_fp8_gpu()
    generator = torch.Generator(device="cuda").manual_seed(history_len)
    history = torch.tensor([2.0, 5.0, 1.0, 0.5][:history_len], device="cuda")
    reference_history = history.cpu()
    for step, (special, record) in enumerate([(None, True), ("nan", True), (None, False), ("inf", True),
                                              (None, True), (None, True)]):
        x = torch.randn(shape, device="cuda", generator=generator) * (step + 1)
        if special:
            x[0, 1] = float(special)
        x = x.to(torch.bfloat16)
        for dtype in (E4M3, E5M2):
            got = kernels.quantize_delayed(x, history, use_max, dtype, 1, True, record and dtype is E5M2)
            want = kernels.quantize_delayed(x.cpu(), reference_history, use_max, dtype, 1, True,
                                            record and dtype is E5M2)
            assert torch.equal(got[2].cpu(), want[2]), (step, got[2], want[2])
            problems = [_mismatch("q", got[0], want[0]), _mismatch("q^T", got[1], want[1])]
            assert not any(problems), f"step {step}: " + "; ".join(p for p in problems if p)
        assert torch.equal(history.cpu(), reference_history), (step, history, reference_history)


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
