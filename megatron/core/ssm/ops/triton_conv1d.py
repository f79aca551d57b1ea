"""Triton kernels of the causal depthwise conv1d of Mamba (`causal_conv1d`), forward and backward.

Same signature and math as `reference.causal_conv1d` (the `causal_conv1d` package's `causal_conv1d_fn`):
y[b, d, t] = act(bias_d + sum_k w[d, k] x[b, d, t - (w - 1) + k]), act None or silu. x may have any strides
(Megatron passes a channels-last view [b, d, l] of the in_proj output). One program handles a [channels, time]
tile; the backward recomputes the pre-activation at the w shifts it needs (the input tile is reread from
cache), so no activation is stored; dweight and dbias are summed from per-tile partials. Arithmetic in fp32.
Defined only where Triton is installed, so importing this module never fails.
"""
import torch

from megatron.core.utils import module_available

_HAVE_TRITON = module_available("triton")
_BLOCK_D, _BLOCK_T = 64, 64

if _HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _pre(x_ptr, w_ptr, bias_ptr, b, d, t, dim, seqlen, s_xb, s_xd, s_xl, HAS_BIAS: tl.constexpr,
             W: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr):
        """Pre-activation [BD, BT] at channels d and times t (zero where t is past the end)."""
        dm = d < dim
        if HAS_BIAS:
            acc = tl.load(bias_ptr + d, mask=dm, other=0.0).to(tl.float32)[:, None] + tl.zeros(
                [BD, BT], dtype=tl.float32)
        else:
            acc = tl.zeros([BD, BT], dtype=tl.float32)
        for k in tl.static_range(W):
            src = t - (W - 1) + k
            xv = tl.load(x_ptr + b * s_xb + d[:, None] * s_xd + src[None, :].to(tl.int64) * s_xl,
                         mask=dm[:, None] & (src[None, :] >= 0) & (src[None, :] < seqlen), other=0.0)
            acc += tl.load(w_ptr + d * W + k, mask=dm, other=0.0).to(tl.float32)[:, None] * xv.to(tl.float32)
        return acc

    @triton.jit
    def _conv_fwd(x_ptr, w_ptr, bias_ptr, y_ptr, dim, seqlen, s_xb, s_xd, s_xl, s_yb, s_yd, s_yl,
                  HAS_BIAS: tl.constexpr, SILU: tl.constexpr, W: tl.constexpr, BD: tl.constexpr,
                  BT: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BD + tl.arange(0, BD)
        t = tl.program_id(2) * BT + tl.arange(0, BT)
        acc = _pre(x_ptr, w_ptr, bias_ptr, b, d, t, dim, seqlen, s_xb, s_xd, s_xl, HAS_BIAS, W, BD, BT)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(y_ptr + b * s_yb + d[:, None] * s_yd + t[None, :].to(tl.int64) * s_yl,
                 acc.to(y_ptr.dtype.element_ty), mask=(d[:, None] < dim) & (t[None, :] < seqlen))

    @triton.jit
    def _conv_bwd(x_ptr, w_ptr, bias_ptr, dy_ptr, dx_ptr, dw_ptr, db_ptr, dim, seqlen, s_xb, s_xd, s_xl,
                  s_gb, s_gd, s_gl, s_ob, s_od, s_ol, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, W: tl.constexpr,
                  BD: tl.constexpr, BT: tl.constexpr):
        """dx of one tile (from the gradients at t .. t + w - 1), and this tile's partial dweight, dbias."""
        b = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BD + tl.arange(0, BD)
        t = tl.program_id(2) * BT + tl.arange(0, BT)
        dm = d < dim
        dx = tl.zeros([BD, BT], dtype=tl.float32)
        part = (b * tl.num_programs(2) + tl.program_id(2)) * dim  # row of this tile's partial sums
        for s in tl.static_range(W):
            tt = t + s
            tm = dm[:, None] & (tt[None, :] < seqlen)
            gp = tl.load(dy_ptr + b * s_gb + d[:, None] * s_gd + tt[None, :].to(tl.int64) * s_gl, mask=tm,
                         other=0.0).to(tl.float32)
            if SILU:
                pre = _pre(x_ptr, w_ptr, bias_ptr, b, d, tt, dim, seqlen, s_xb, s_xd, s_xl, HAS_BIAS, W, BD, BT)
                sig = tl.sigmoid(pre)
                gp = gp * sig * (1 + pre * (1 - sig))
            dx += tl.load(w_ptr + d * W + (W - 1 - s), mask=dm, other=0.0).to(tl.float32)[:, None] * gp
            if s == 0:
                tl.store(db_ptr + part + d, tl.sum(gp, 1), mask=dm)
                for k in tl.static_range(W):
                    src = t - (W - 1) + k
                    xv = tl.load(x_ptr + b * s_xb + d[:, None] * s_xd + src[None, :].to(tl.int64) * s_xl,
                                 mask=dm[:, None] & (src[None, :] >= 0) & (src[None, :] < seqlen), other=0.0)
                    tl.store(dw_ptr + (part + d) * W + k, tl.sum(gp * xv.to(tl.float32), 1), mask=dm)
        tl.store(dx_ptr + b * s_ob + d[:, None] * s_od + t[None, :].to(tl.int64) * s_ol,
                 dx.to(dx_ptr.dtype.element_ty), mask=dm[:, None] & (t[None, :] < seqlen))


def _grid(x):
    return (x.shape[0], triton.cdiv(x.shape[1], _BLOCK_D), triton.cdiv(x.shape[2], _BLOCK_T))


class _CausalConv1d(torch.autograd.Function):
    """The conv over the Triton kernels."""

    @staticmethod
    def forward(ctx, x, weight, bias, silu):
        y = torch.empty_like(x)
        _conv_fwd[_grid(x)](x, weight, bias if bias is not None else weight, y, x.shape[1], x.shape[2],
                            *x.stride(), *y.stride(), HAS_BIAS=bias is not None, SILU=silu, W=weight.shape[1],
                            BD=_BLOCK_D, BT=_BLOCK_T)
        ctx.save_for_backward(x, weight, bias)
        ctx.silu = silu
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias = ctx.saved_tensors
        grid = _grid(x)
        dx = torch.empty_like(x)
        dw = torch.empty(x.shape[0] * grid[2], x.shape[1], weight.shape[1], device=x.device, dtype=torch.float32)
        db = torch.empty(x.shape[0] * grid[2], x.shape[1], device=x.device, dtype=torch.float32)
        _conv_bwd[grid](x, weight, bias if bias is not None else weight, dy, dx, dw, db, x.shape[1], x.shape[2],
                        *x.stride(), *dy.stride(), *dx.stride(), HAS_BIAS=bias is not None, SILU=ctx.silu,
                        W=weight.shape[1],
                        BD=_BLOCK_D, BT=_BLOCK_T)
        dbias = db.sum(0).to(bias.dtype) if bias is not None else None
        return dx, dw.sum(0).to(weight.dtype), dbias, None


def causal_conv1d(x, weight, bias=None, activation=None):
    """Causal depthwise conv1d on CUDA tensors by the Triton kernels (see `reference.causal_conv1d`).

    x [b, d, l] (any strides), weight [d, w], bias [d] or None, activation None or "silu" ("swish").
    Returns y [b, d, l] in the dtype of x, differentiable in x, weight and bias."""
    problems = []
    if not _HAVE_TRITON:
        problems.append("triton is not installed; use the reference implementation")
    if activation not in (None, "silu", "swish"):
        problems.append(f"activation={activation!r}: must be None or 'silu'")
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        problems.append(f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: must be [b, d, l] and [d, w]")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        problems.append(f"bias {tuple(bias.shape)}: must be [d]")
    if problems:
        raise ValueError("causal_conv1d (Triton): " + "; ".join(problems))
    return _CausalConv1d.apply(x, weight.contiguous(), bias, activation is not None)
