"""The reference SSD scan and causal conv1d against a naive step-by-step recurrence written here."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.ssm import ops
from megatron.core.ssm.ops import reference


def _naive_ssd(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial=None):
    """S_t = exp(Δ_t A_h) S_{t-1} + Δ_t x_t B_t^T; y_t = S_t C_t + D x_t; y *= silu(z) (float64, one step at a time)."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    if dt_bias is not None:
        dt = dt + dt_bias.double()
    delta = F.softplus(dt)
    state = torch.zeros(b, h, p, n, dtype=torch.float64) if initial is None else initial.double()
    states = [state[:, head] for head in range(h)]
    ys = []
    for t in range(l):
        y_heads = []
        for head in range(h):
            grp = head // (h // g)
            dA = torch.exp(delta[:, t, head] * A[head])[:, None, None]
            states[head] = dA * states[head] + (delta[:, t, head][:, None, None]
                                                * x[:, t, head, :, None] * B[:, t, grp, None, :])
            y_heads.append(torch.einsum("bpn,bn->bp", states[head], C[:, t, grp]))
        ys.append(torch.stack(y_heads, dim=1))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + x * (D.double()[:, None] if D.dim() == 1 else D.double())
    if z is not None:
        y = y * F.silu(z.double())
    return y, torch.stack(states, dim=1)


def _inputs(b, l, h, p, g, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(x=r(b, l, h, p), dt=r(b, l, h) - 1.0, A=-torch.rand(h, generator=gen) * 2 - 0.1,
                B=r(b, l, g, n), C=r(b, l, g, n))


@pytest.mark.parametrize("l,chunk,h,g,d_hdim", [(16, 4, 2, 1, False), (13, 4, 4, 2, True), (7, 8, 4, 4, False),
                                                 (9, 1, 2, 2, False)])
def test_ssd_chunk_scan_equals_the_sequential_recurrence(l, chunk, h, g, d_hdim):
    b, p, n = 2, 3, 5
    inp = _inputs(b, l, h, p, g, n)
    gen = torch.Generator().manual_seed(1)
    D = torch.randn(h, p, generator=gen) if d_hdim else torch.randn(h, generator=gen)
    z = torch.randn(b, l, h, p, generator=gen)
    dt_bias = torch.randn(h, generator=gen) * 0.5
    initial = torch.randn(b, h, p, n, generator=gen)
    y, final = reference.ssd_chunk_scan(**inp, chunk_size=chunk, D=D, z=z, dt_bias=dt_bias,
                                        initial_states=initial, return_final_states=True)
    y_ref, final_ref = _naive_ssd(**inp, D=D, z=z, dt_bias=dt_bias, initial=initial)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final.double(), final_ref, rtol=1e-5, atol=1e-5)
    y_plain = reference.ssd_chunk_scan(**inp, chunk_size=chunk)
    torch.testing.assert_close(y_plain.double(), _naive_ssd(**inp)[0], rtol=1e-5, atol=1e-5)


def test_ssd_chunk_scan_gradients_equal_the_recurrence():
    inp = _inputs(1, 10, 2, 2, 1, 3, seed=3)
    for t in inp.values():
        t.requires_grad_(True)
    reference.ssd_chunk_scan(**inp, chunk_size=4).pow(2).sum().backward()
    got = [inp[k].grad.clone() for k in inp]
    for t in inp.values():
        t.grad = None
    _naive_ssd(**inp)[0].pow(2).sum().backward()
    for k, g in zip(inp, got):
        torch.testing.assert_close(g.double(), inp[k].grad.double(), rtol=1e-4, atol=1e-5, msg=k)


def test_causal_conv1d_equals_a_loop():
    gen = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(2, 3, 9, generator=gen), torch.randn(3, 4, generator=gen), torch.randn(3, generator=gen)
    expected = torch.zeros(2, 3, 9)
    for t in range(9):
        for j in range(4):
            src = t - 3 + j
            if src >= 0:
                expected[:, :, t] += w[:, j] * x[:, :, src]
    expected += bias[:, None]
    torch.testing.assert_close(reference.causal_conv1d(x, w, bias), expected)
    torch.testing.assert_close(ops.causal_conv1d(x, w, bias, activation="silu", impl="auto"), F.silu(expected))
    with pytest.raises(ValueError, match="activation"):
        reference.causal_conv1d(x, w, activation="gelu")


def test_impl_choice_is_explicit():
    x = torch.zeros(1)
    assert ops.resolve_impl("torch", x, "triton_ssd") is reference
    assert ops.resolve_impl("auto", x, "triton_ssd") is reference  # CPU tensor
    with pytest.raises(ValueError, match="impl"):
        ops.resolve_impl("cuda", x, "triton_ssd")


def test_kernel_module_without_triton_counts_as_unavailable(monkeypatch):
    import pytest

    from megatron.core.ssm import ops
    from megatron.core.ssm.ops import triton_ssd

    monkeypatch.setattr(triton_ssd, "_HAVE_TRITON", False)
    monkeypatch.setattr(ops, "_TRITON_MODULES", {})
    assert ops._triton_module("triton_ssd") is None
    with pytest.raises(ValueError, match="impl='triton'"):
        ops.resolve_impl("triton", torch.zeros(1), "triton_ssd")
    assert ops.resolve_impl("auto", torch.zeros(1), "triton_ssd") is ops.reference
