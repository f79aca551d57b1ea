"""Triton kernels behind `fused_qkv_rope`: the fused QKV projection's output split into queries, keys and
values with rotary position embeddings applied to queries and keys, in one pass forward and one backward.

Layout of the input (Megatron's): per token, per query group, [q_1 .. q_{np/ng}, k, v] x head_dim channels,
i.e. `qkv` is [s, b, ng * (np/ng + 2) * hn]. Outputs: q [s, b, np, hn], k and v [s, b, ng, hn], contiguous.
Rotation (non-interleaved, Llama / GPT-NeoX): the first `rot` channels of each head, pairing channel i with
i + rot/2, with per-position tables cos/sin [s, rot] already rounded to the activations' dtype (what the
reference computes); channels from `rot` to hn pass unchanged. Arithmetic in fp32, one rounding per output.

The backward reads the gradients of q, k and v (any strides with a unit last stride: they come from the
attention's backward through a permute) and writes the gradient of `qkv` in its fused layout, so no
concatenation of the three gradients is needed.

Why: compiled by inductor, the rotation recomputed cos and sin for every element and the backward
concatenated the gradients in a second kernel; on an H200 at Llama-1B-s4096's shape this took ~140 us forward
and ~235 us backward per layer plus ~60 us of split copies, against ~70 us each way for the bytes moved
(docs/performance.md).

Defined only where Triton is installed, so importing this module never fails (CPU CI imports every module).
"""
import torch

from megatron.core.utils import module_available

_HAVE_TRITON = module_available("triton")
_ROWS, _WARPS = 16, 4  # tokens per program; launch settings

if _HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _tables(cos_ptr, sin_ptr, pos, row_mask, ROT: tl.constexpr, HALF_P2: tl.constexpr):
        """cos/sin of the first and second half of the rotated channels at positions `pos` ([rows]), fp32."""
        cols = tl.arange(0, HALF_P2)
        mask = row_mask[:, None] & (cols[None, :] < ROT // 2)
        first = pos[:, None] * ROT + cols[None, :]
        second = first + ROT // 2
        c1 = tl.load(cos_ptr + first, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + second, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + first, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + second, mask=mask, other=0.0).to(tl.float32)
        return c1, c2, s1, s2

    @triton.jit
    def _copy_channels(src_ptr, src_base, dst_ptr, dst_base, row_mask, FIRST: tl.constexpr, COUNT: tl.constexpr,
                       COUNT_P2: tl.constexpr):
        """Copy channels [FIRST, FIRST + COUNT) of each row (bases: [rows] element offsets of channel 0)."""
        cols = tl.arange(0, COUNT_P2)
        mask = row_mask[:, None] & (cols[None, :] < COUNT)
        values = tl.load(src_ptr + src_base[:, None] + FIRST + cols[None, :], mask=mask, other=0.0)
        tl.store(dst_ptr + dst_base[:, None] + FIRST + cols[None, :], values.to(dst_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _qkv_rope_forward_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, tokens, batch, groups,
                                 HPG: tl.constexpr, HN: tl.constexpr, ROT: tl.constexpr, HALF_P2: tl.constexpr,
                                 HN_P2: tl.constexpr, PASS_P2: tl.constexpr, ROWS: tl.constexpr):
        t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # tokens t = s_index * batch + b_index
        g = tl.program_id(1)
        row_mask = t < tokens
        c1, c2, s1, s2 = _tables(cos_ptr, sin_ptr, t // batch, row_mask, ROT, HALF_P2)
        cols = tl.arange(0, HALF_P2)
        mask = row_mask[:, None] & (cols[None, :] < ROT // 2)
        group_base = t * groups * (HPG + 2) * HN + g * (HPG + 2) * HN  # [rows]
        for j in tl.static_range(HPG + 1):  # the group's query heads, then its key head
            src = group_base + j * HN
            if j < HPG:
                dst_ptr = q_ptr
                dst = t * groups * HPG * HN + (g * HPG + j) * HN
            else:
                dst_ptr = k_ptr
                dst = t * groups * HN + g * HN
            x1 = tl.load(qkv_ptr + src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(qkv_ptr + src[:, None] + ROT // 2 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            out_type = dst_ptr.dtype.element_ty
            tl.store(dst_ptr + dst[:, None] + cols[None, :], (x1 * c1 - x2 * s1).to(out_type), mask=mask)
            tl.store(dst_ptr + dst[:, None] + ROT // 2 + cols[None, :], (x2 * c2 + x1 * s2).to(out_type), mask=mask)
            if ROT < HN:
                _copy_channels(qkv_ptr, src, dst_ptr, dst, row_mask, ROT, HN - ROT, PASS_P2)
        _copy_channels(qkv_ptr, group_base + (HPG + 1) * HN, v_ptr, t * groups * HN + g * HN, row_mask, 0, HN, HN_P2)

    @triton.jit
    def _qkv_rope_backward_kernel(dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, out_ptr, tokens, batch, groups,
                                  dq_s, dq_b, dq_h, dk_s, dk_b, dk_h, dv_s, dv_b, dv_h,
                                  HPG: tl.constexpr, HN: tl.constexpr, ROT: tl.constexpr, HALF_P2: tl.constexpr,
                                  HN_P2: tl.constexpr, PASS_P2: tl.constexpr, ROWS: tl.constexpr):
        t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        g = tl.program_id(1)
        row_mask = t < tokens
        pos = t // batch
        b_index = t % batch
        c1, c2, s1, s2 = _tables(cos_ptr, sin_ptr, pos, row_mask, ROT, HALF_P2)
        cols = tl.arange(0, HALF_P2)
        mask = row_mask[:, None] & (cols[None, :] < ROT // 2)
        group_base = t * groups * (HPG + 2) * HN + g * (HPG + 2) * HN
        for j in tl.static_range(HPG + 1):
            dst = group_base + j * HN
            if j < HPG:
                src_ptr = dq_ptr
                src = pos * dq_s + b_index * dq_b + (g * HPG + j) * dq_h
            else:
                src_ptr = dk_ptr
                src = pos * dk_s + b_index * dk_b + g * dk_h
            d1 = tl.load(src_ptr + src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            d2 = tl.load(src_ptr + src[:, None] + ROT // 2 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            out_type = out_ptr.dtype.element_ty
            tl.store(out_ptr + dst[:, None] + cols[None, :], (d1 * c1 + d2 * s2).to(out_type), mask=mask)
            tl.store(out_ptr + dst[:, None] + ROT // 2 + cols[None, :], (d2 * c2 - d1 * s1).to(out_type), mask=mask)
            if ROT < HN:
                _copy_channels(src_ptr, src, out_ptr, dst, row_mask, ROT, HN - ROT, PASS_P2)
        v_src = pos * dv_s + b_index * dv_b + g * dv_h
        _copy_channels(dv_ptr, v_src, out_ptr, group_base + (HPG + 1) * HN, row_mask, 0, HN, HN_P2)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def usable(qkv: torch.Tensor, cos: torch.Tensor, heads_per_group: int, head_dim: int) -> bool:
    """Whether the kernels take these operands: a contiguous CUDA `qkv` [s, b, ng * (np/ng + 2) * hn] of a
    floating dtype and contiguous tables [s, rot] of the same dtype, rot even and at most hn."""
    if not (_HAVE_TRITON and qkv.is_cuda and qkv.dim() == 3 and qkv.is_contiguous() and qkv.numel() > 0):
        return False
    if qkv.dtype not in (torch.bfloat16, torch.float16, torch.float32) or cos.dtype != qkv.dtype:
        return False
    group_width = (heads_per_group + 2) * head_dim
    rot = cos.shape[-1] if cos.dim() == 2 else -1
    return (qkv.shape[-1] % group_width == 0 and cos.is_contiguous() and cos.device == qkv.device
            and cos.shape[0] == qkv.shape[0] and 0 < rot <= head_dim and rot % 2 == 0)


def _constants(heads_per_group: int, head_dim: int, rot: int) -> dict:
    return dict(HPG=heads_per_group, HN=head_dim, ROT=rot, HALF_P2=_next_pow2(rot // 2), HN_P2=_next_pow2(head_dim),
                PASS_P2=_next_pow2(max(1, head_dim - rot)), ROWS=_ROWS, num_warps=_WARPS)


def forward(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads_per_group: int, head_dim: int):
    """(q [s, b, np, hn], k [s, b, ng, hn], v [s, b, ng, hn]) from `qkv`; `usable` first."""
    s, b, width = qkv.shape
    groups = width // ((heads_per_group + 2) * head_dim)
    q = qkv.new_empty(s, b, groups * heads_per_group, head_dim)
    k = qkv.new_empty(s, b, groups, head_dim)
    v = torch.empty_like(k)
    grid = (triton.cdiv(s * b, _ROWS), groups)
    _qkv_rope_forward_kernel[grid](qkv, cos, sin, q, k, v, s * b, b, groups,
                                   **_constants(heads_per_group, head_dim, cos.shape[-1]))
    return q, k, v


def backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             heads_per_group: int) -> torch.Tensor:
    """The gradient of `qkv` [s, b, ng * (np/ng + 2) * hn] from those of q, k and v (unit last strides)."""
    s, b, groups, head_dim = dk.shape
    out = dq.new_empty(s, b, groups * (heads_per_group + 2) * head_dim)
    grid = (triton.cdiv(s * b, _ROWS), groups)
    strides = [stride for grad in (dq, dk, dv) for stride in grad.stride()[:3]]
    _qkv_rope_backward_kernel[grid](dq, dk, dv, cos, sin, out, s * b, b, groups, *strides,
                                    **_constants(heads_per_group, head_dim, cos.shape[-1]))
    return out
