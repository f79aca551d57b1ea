"""The Triton SSD scan and causal conv1d on CUDA, forward and every gradient, against the step-by-step
recurrence (`naive_ssd`, fp64) and, where the model branch's reference exists, `reference.ssd_chunk_scan`.
Shapes cover a sequence that is not a multiple of the chunk, one group and several, D per head and per head
dim, z, dt_bias and initial states present and absent. fp32: relative error (max abs error over max abs value)
<= 1e-4; bf16 (products in bf16, accumulation in fp32, as mamba-ssm): <= 3e-2 against the fp64 recurrence of
the same bf16 inputs (the gradients pass through several bf16 roundings of 3.9e-3 each), dA and d dt_bias (sums
over the whole sequence) included. Skipped without CUDA and Triton."""
import pytest
import torch

pytest.importorskip("triton")

from megatron.core.ssm.ops.triton_conv1d import causal_conv1d  # noqa: E402
from megatron.core.ssm.ops.triton_ssd import ssd_chunk_scan  # noqa: E402
from tests.unit.ssm.naive_ssd import make_inputs, naive_conv1d, naive_ssd  # noqa: E402

NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
# (batch, seq, heads, head dim, groups, state, chunk, D, z, dt_bias, initial states)
SHAPES = [
    (2, 256, 4, 64, 1, 64, 64, "h", False, True, False),
    (1, 300, 8, 32, 2, 128, 128, "hp", True, True, True),
    (2, 200, 6, 64, 3, 32, 64, None, True, False, True),
    (1, 129, 4, 16, 4, 16, 32, "h", False, True, True),
]


def _rel(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def _run(fn, ops, grads):
    """Outputs (y, final) and the gradients of sum(y * gy) + sum(final * gf) for every tensor operand."""
    leaves = {k: (v.detach().clone().requires_grad_() if v is not None else None) for k, v in ops.items()}
    y, fin = fn(leaves)
    ((y.double() * grads[0]).sum() + (fin.double() * grads[1]).sum()).backward()
    return [y, fin] + [leaves[k].grad for k in NAMES if leaves[k] is not None]


def _triton(ops, chunk):
    return lambda t: ssd_chunk_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk, D=t["D"], z=t["z"],
                                    dt_bias=t["dt_bias"], initial_states=t["initial_states"],
                                    return_final_states=True)


def _naive(t):
    t = {k: (v.double() if v is not None else None) for k, v in t.items()}
    return naive_ssd(t["x"], t["dt"], t["A"], t["B"], t["C"], D=t["D"], z=t["z"], dt_bias=t["dt_bias"],
                     initial_states=t["initial_states"])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=[f"l{s[1]}-g{s[4]}-q{s[6]}" for s in SHAPES])
def test_ssd_fp32_against_the_recurrence(shape):
    b, seqlen, h, p, g, n, chunk, D, z, bias, init = shape
    ops = make_inputs(b, seqlen, h, p, g, n, "cuda", torch.float32, D=D, z=z, bias=bias, init=init)
    gen = torch.Generator().manual_seed(5)
    grads = (torch.randn(b, seqlen, h, p, generator=gen).double().cuda(),
             torch.randn(b, h, p, n, generator=gen).double().cuda())
    got, want = _run(_triton(ops, chunk), ops, grads), _run(_naive, ops, grads)
    errors = {name: _rel(a, w) for name, a, w in zip(["y", "final"] + [k for k in NAMES if ops[k] is not None],
                                                     got, want)}
    assert all(e <= 1e-4 for e in errors.values()), errors


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES[:3], ids=[f"l{s[1]}-g{s[4]}-q{s[6]}" for s in SHAPES[:3]])
def test_ssd_bf16_within_bf16_noise(shape):
    b, seqlen, h, p, g, n, chunk, D, z, bias, init = shape
    ops = make_inputs(b, seqlen, h, p, g, n, "cuda", torch.bfloat16, D=D, z=z, bias=bias, init=init)
    gen = torch.Generator().manual_seed(5)
    grads = (torch.randn(b, seqlen, h, p, generator=gen).double().cuda(),
             torch.randn(b, h, p, n, generator=gen).double().cuda())
    got, want = _run(_triton(ops, chunk), ops, grads), _run(_naive, ops, grads)
    names = ["y", "final"] + [k for k in NAMES if ops[k] is not None]
    errors = {nm: _rel(a, w) for nm, a, w in zip(names, got, want)}
    assert all(e <= 3e-2 for e in errors.values()), errors


@pytest.mark.gpu
def test_ssd_matches_the_pytorch_reference_when_present():
    reference = pytest.importorskip("megatron.core.ssm.ops.reference")
    ops = make_inputs(2, 300, 8, 64, 2, 64, "cuda", torch.float32, D="h", z=True, init=True)
    gen = torch.Generator().manual_seed(5)
    grads = (torch.randn(2, 300, 8, 64, generator=gen).double().cuda(),
             torch.randn(2, 8, 64, 64, generator=gen).double().cuda())

    def ref(t):
        return reference.ssd_chunk_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], 128, D=t["D"], z=t["z"],
                                        dt_bias=t["dt_bias"], initial_states=t["initial_states"],
                                        return_final_states=True)
    for a, w in zip(_run(_triton(ops, 128), ops, grads), _run(ref, ops, grads)):
        assert _rel(a, w) <= 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation,bias", [("silu", True), (None, False)])
def test_causal_conv1d_against_the_tap_sum(dtype, activation, bias):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(3, 1000, 200, generator=gen).cuda()  # [b, l, d]: the kernel reads a channels-last view
    x = base.to(dtype).transpose(1, 2).requires_grad_()  # [b, d, l]
    w = torch.randn(200, 4, generator=gen).cuda().to(dtype).requires_grad_()
    b = torch.randn(200, generator=gen).cuda().to(dtype).requires_grad_() if bias else None
    y = causal_conv1d(x, w, b, activation)
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, w, b)]
    yr = naive_conv1d(*leaves, activation)
    g = torch.randn(yr.shape, generator=gen).cuda().double()
    (y.double() * g).sum().backward()
    (yr * g).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    pairs = [(y, yr), (x.grad, leaves[0].grad), (w.grad, leaves[1].grad)]
    if bias:
        pairs.append((b.grad, leaves[2].grad))
    assert all(_rel(a, r) <= tol for a, r in pairs), [_rel(a, r) for a, r in pairs]


@pytest.mark.gpu
def test_ssd_reads_strided_views_of_one_projection():
    """x, B, C and dt as views into one [b, l, h*p + 2*g*n + h] tensor (MambaMixer's in_proj output)."""
    b, seqlen, h, p, g, n = 2, 200, 4, 32, 2, 32
    gen = torch.Generator().manual_seed(3)
    proj = torch.randn(b, seqlen, h * p + 2 * g * n + h, generator=gen).cuda().requires_grad_()
    A = (-torch.rand(h, generator=gen) * 4 - 0.5).cuda()
    D = torch.randn(h, generator=gen).cuda()

    def split(t):
        x = t[..., :h * p].unflatten(-1, (h, p))  # [b, l, h, p] view
        B = t[..., h * p:h * p + g * n].unflatten(-1, (g, n))  # [b, l, g, n] view
        C = t[..., h * p + g * n:h * p + 2 * g * n].unflatten(-1, (g, n))
        return x, t[..., -h:] - 1.0, B, C

    gy = torch.randn(b, seqlen, h, p, generator=gen).cuda()
    x, dt, B, C = split(proj)
    y = ssd_chunk_scan(x, dt, A, B, C, 64, D=D)
    (y * gy).sum().backward()
    ref = proj.detach().double().requires_grad_()
    x, dt, B, C = split(ref)
    yr, _ = naive_ssd(x, dt, A.double(), B, C, D=D.double())
    (yr * gy.double()).sum().backward()
    assert _rel(y, yr) <= 1e-4 and _rel(proj.grad, ref.grad) <= 1e-4, (_rel(y, yr), _rel(proj.grad, ref.grad))
