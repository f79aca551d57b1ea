"""Independent oracles for the Mamba-2 kernels: the SSD as a plain step-by-step recurrence and the causal
conv1d as an explicit sum over taps (no chunking, no conv library call)."""
import torch
import torch.nn.functional as F


def naive_ssd(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None, dt_softplus=True):
    """h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t ⊗ B_t; y_t = h_t C_t + D x_t, times silu(z_t); returns (y, h_l)."""
    b, seqlen, nheads, headdim = x.shape
    rep = nheads // B.shape[2]
    delta = dt + (dt_bias if dt_bias is not None else 0)
    delta = F.softplus(delta) if dt_softplus else delta
    Bh, Ch = B.repeat_interleave(rep, 2), C.repeat_interleave(rep, 2)  # [b, l, h, n]
    state = initial_states.clone() if initial_states is not None else x.new_zeros(b, nheads, headdim, B.shape[-1])
    ys = []
    for t in range(seqlen):
        decay = torch.exp(delta[:, t] * A)[:, :, None, None]  # [b, h, 1, 1]
        state = decay * state + delta[:, t, :, None, None] * x[:, t, :, :, None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    y = torch.stack(ys, 1)  # [b, l, h, p]
    if D is not None:
        y = y + x * (D[:, None] if D.dim() == 1 else D)
    if z is not None:
        y = y * F.silu(z)
    return y, state


def naive_conv1d(x, weight, bias=None, activation=None):
    """y[b, d, t] = act(bias_d + sum_k w[d, k] x[b, d, t - w + 1 + k])."""
    width = weight.shape[1]
    padded = F.pad(x, (width - 1, 0))
    y = sum(weight[None, :, k, None] * padded[:, :, k:k + x.shape[-1]] for k in range(width))
    if bias is not None:
        y = y + bias[None, :, None]
    return F.silu(y) if activation is not None else y


def make_inputs(b, seqlen, nheads, headdim, ngroups, dstate, device, dtype, D=None, z=False, bias=True,
                init=False, seed=0):
    """Random SSD operands (A < 0, moderate dt) as fp32 leaves on `device`, cast to `dtype`; D None, "h" or "hp"."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    ops = {"x": r(b, seqlen, nheads, headdim), "dt": r(b, seqlen, nheads, scale=0.5) - 1.0,
           "A": -torch.rand(nheads, generator=gen).to(device) * 4 - 0.5,
           "B": r(b, seqlen, ngroups, dstate), "C": r(b, seqlen, ngroups, dstate)}
    ops["D"] = None if D is None else r(nheads) if D == "h" else r(nheads, headdim)
    ops["z"] = r(b, seqlen, nheads, headdim) if z else None
    ops["dt_bias"] = r(nheads, scale=0.3) if bias else None
    ops["initial_states"] = r(b, nheads, headdim, dstate) if init else None
    for key in ("x", "B", "C", "z", "dt"):
        if ops[key] is not None:
            ops[key] = ops[key].to(dtype)
    return {k: (v.requires_grad_() if v is not None else None) for k, v in ops.items()}
