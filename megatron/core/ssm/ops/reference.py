"""Pure-PyTorch reference of the Mamba-2 operations: the chunked SSD scan and the causal depthwise conv1d.

These run on any device and are differentiable by autograd. They are the CPU path of `MambaMixer` and the oracle
the Triton kernels (`triton_ssd.py`, `triton_conv1d.py`, same signatures) are tested against. The math is that of
`mamba_ssm`'s `mamba_chunk_scan_combined` and `causal_conv1d_fn`; all accumulation is in fp32.
"""

import torch
import torch.nn.functional as F


def _expand_groups(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """[b, l, g, n] -> [b, l, h, n]: head `i` reads group `i // (h / g)`."""
    return t.repeat_interleave(nheads // t.shape[2], dim=2)


def _pad_time(t: torch.Tensor, pad: int) -> torch.Tensor:
    """Zero-pad dimension 1 (time) at the end by `pad` steps."""
    if pad == 0:
        return t
    widths = [0, 0] * (t.dim() - 2) + [0, pad]
    return F.pad(t, widths)


def _process_dt(dt, dt_bias, dt_softplus):
    """Δ = softplus(dt + dt_bias) in fp32 (either step optional)."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    return F.softplus(dt) if dt_softplus else dt


def _inter_chunk_scan(chunk_states, chunk_decay, initial_states):
    """S_c = exp(a_c) S_{c-1} + Ŝ_c over chunks; returns the state entering each chunk and the final state.

    chunk_states [b, c, h, p, n], chunk_decay [b, c, h] (the chunk's total log decay)."""
    b, nchunks, h, p, n = chunk_states.shape
    state = (chunk_states.new_zeros(b, h, p, n) if initial_states is None else initial_states.float())
    entering = []
    for c in range(nchunks):
        entering.append(state)
        state = torch.exp(chunk_decay[:, c])[:, :, None, None] * state + chunk_states[:, c]
    return torch.stack(entering, dim=1), state


def ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=True,
                   initial_states=None, return_final_states=False):
    """The Mamba-2 selective state-space scan, computed chunk by chunk (SSD).

    x [b, l, h, p], dt [b, l, h], A [h], B and C [b, l, g, n], D [h] or [h, p], z [b, l, h, p],
    initial_states [b, h, p, n]. Per head: S_t = exp(Δ_t A) S_{t-1} + Δ_t x_t ⊗ B_t, y_t = S_t C_t + D x_t,
    then y *= silu(z) when z is given. Returns y (dtype of x), and the final state (fp32) when asked.
    """
    b, seqlen, nheads, headdim = x.shape
    pad = (-seqlen) % chunk_size
    nchunks = (seqlen + pad) // chunk_size
    delta = _pad_time(_process_dt(dt, dt_bias, dt_softplus), pad)  # [b, L, h]
    xf = _pad_time(x.float(), pad)
    Bh = _pad_time(_expand_groups(B.float(), nheads), pad)  # [b, L, h, n]
    Ch = _pad_time(_expand_groups(C.float(), nheads), pad)
    xc = xf.reshape(b, nchunks, chunk_size, nheads, headdim)  # [b, c, q, h, p]
    Bc = Bh.reshape(b, nchunks, chunk_size, nheads, -1)  # [b, c, q, h, n]
    Cc = Ch.reshape(b, nchunks, chunk_size, nheads, -1)  # [b, c, q, h, n]
    dtc = delta.reshape(b, nchunks, chunk_size, nheads)  # [b, c, q, h]
    cs = torch.cumsum(dtc * A.float(), dim=2)  # [b, c, q, h] in-chunk cumulative log decay

    # Intra-chunk: y_t = sum_{s <= t} (C_t . B_s) exp(cs_t - cs_s) Δ_s x_s.
    diff = cs.permute(0, 1, 3, 2)[..., :, None] - cs.permute(0, 1, 3, 2)[..., None, :]  # [b, c, h, t, s]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp(diff.masked_fill(~causal, float("-inf")))
    scores = torch.einsum("bcthn,bcshn->bchts", Cc, Bc) * decay * dtc.permute(0, 1, 3, 2)[:, :, :, None, :]
    y = torch.einsum("bchts,bcshp->bcthp", scores, xc)

    # Chunk-end states, the scan across chunks, and each chunk's contribution from the state it enters with.
    to_end = torch.exp(cs[:, :, -1:, :] - cs) * dtc  # [b, c, q, h]
    chunk_states = torch.einsum("bcshn,bcsh,bcshp->bchpn", Bc, to_end, xc)
    entering, final_state = _inter_chunk_scan(chunk_states, cs[:, :, -1, :], initial_states)
    y = y + torch.einsum("bcthn,bchpn,bcth->bcthp", Cc, entering, torch.exp(cs))

    y = y.reshape(b, nchunks * chunk_size, nheads, headdim)[:, :seqlen]  # [b, l, h, p]
    if D is not None:
        Df = D.float()
        y = y + x.float() * (Df[:, None] if Df.dim() == 1 else Df)
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(x.dtype)
    return (y, final_state) if return_final_states else y


def causal_conv1d(x, weight, bias=None, activation=None):
    """Causal depthwise conv over time: y[c, t] = act(bias_c + sum_j w[c, j] x[c, t - w + 1 + j]).

    x [b, d, l], weight [d, w], bias [d]; activation None or "silu". Returns y [b, d, l] in the dtype of x."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d: activation must be None or 'silu', got {activation!r}")
    width = weight.shape[1]
    y = F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=x.shape[1])[..., : x.shape[-1]]
    return F.silu(y) if activation is not None else y
