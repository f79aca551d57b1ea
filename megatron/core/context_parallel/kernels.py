"""Attention of one block of queries against one block of keys, returning the log-sum-exp, and its exact
backward given the final (merged) output and log-sum-exp.

Tensors are token-major: queries [Nq, h, hn], keys and values [Nk, g, hn] (g query groups, GQA), where a
block of n tokens of a micro-batch of b rows is flattened sequence-major (`flat = token * b + row`, a free
view of Megatron's [s, b, ...] layout). Outputs are fp32 [Nq, h, hn] with lse [Nq, h].

Why the backward takes the merged output: with partial results (o_i, lse_i) over key blocks i, the final
output is O = sum_i exp(lse_i - LSE) o_i with LSE = log sum_i exp(lse_i). The gradient of block i's scores
is P_i * (dP_i - D) with P_i = exp(S_i - LSE) and D = rowsum(dO * O): each block's backward is the ordinary
attention backward evaluated with the GLOBAL LSE and O. Flash kernels take (out, lse) as inputs to their
backward, so passing the merged ones gives exact gradients with no recomputation of the forward.

Backends:
- `math`: plain PyTorch in fp32 with an explicit [b, nq, nk] mask (CPU, fp32 on GPU, and the test oracle);
  attention dropout draws a keep-mask from the current generator and keeps it for the backward.
- `flash_varlen`: FlashAttention-2's variable-length kernels (`aten._flash_attention_forward/backward`):
  every call is a list of (query segment, key segment) pairs, causal or full, so document masks and CP
  chunk pairs cost only the blocks they need and no [s, s] mask exists. Dropout uses the kernel's Philox
  state, returned by the forward and replayed by the backward.
"""
import logging
from dataclasses import dataclass
from typing import List, Optional

import torch

from megatron.core.context_parallel.layout import TokenGroup, allowed_mask

logger = logging.getLogger(__name__)


def merge_partial(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Online-softmax merge of a block's (out [N, h, hn], lse [N, h]) into the running pair (fp32).

    Rows with no allowed key so far have lse = -inf and out = 0; they stay well defined (no NaN)."""
    new_lse = torch.logaddexp(lse, block_lse)
    finite = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    keep, add = torch.exp(lse - finite), torch.exp(block_lse - finite)
    return out * keep[..., None] + block_out * add[..., None], new_lse


def accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32, or the inputs' dtype when wider (fp64 tests stay exact)."""
    return torch.promote_types(x.dtype, torch.float32)


def _expand_groups(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[N, g, hn] -> [N, h, hn]: query head i reads group i // (h / g) (Megatron's grouped layout)."""
    groups = x.shape[1]
    if groups == heads:
        return x
    return x.repeat_interleave(heads // groups, dim=1)


def _sum_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[N, h, hn] -> [N, g, hn]: the gradient of `_expand_groups`."""
    n, heads, hn = x.shape
    if groups == heads:
        return x
    return x.view(n, groups, heads // groups, hn).sum(dim=2)  # [N, h, hn] -> [N, g, h/g, hn] -> [N, g, hn]


@dataclass
class MathPlan:
    """Math-backend plan: which (query, key) pairs are allowed."""

    allowed: torch.Tensor
    """[b or 1, nq, nk] bool."""

    batch: int
    """Rows of the micro-batch (b)."""


def _scores(q, k, plan: MathPlan, scale):
    b, acc = plan.batch, accumulation_dtype(q)
    heads = q.shape[1]
    q4 = q.to(acc).view(-1, b, heads, q.shape[-1])  # [nq*b, h, hn] -> [nq, b, h, hn]
    k4 = _expand_groups(k, heads).to(acc).view(-1, b, heads, k.shape[-1])  # [nk*b, g, hn] -> [nk, b, h, hn]
    scores = torch.einsum("qbhd,kbhd->bhqk", q4, k4) * scale
    return scores.masked_fill(~plan.allowed[:, None], float("-inf")), q4, k4


def math_forward(q, k, v, plan: MathPlan, scale: float, dropout_p: float = 0.0):
    """(out [Nq, h, hn], lse [Nq, h] (fp32, or fp64 for fp64 inputs), keep-mask or None) of one block pair."""
    b, heads, acc = plan.batch, q.shape[1], accumulation_dtype(q)
    scores, _, _ = _scores(q, k, plan, scale)
    lse = torch.logsumexp(scores, dim=-1)  # [b, h, nq]
    probs = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    keep = None
    if dropout_p > 0.0:
        keep = torch.rand_like(probs) >= dropout_p
        probs = probs * keep / (1.0 - dropout_p)
    v4 = _expand_groups(v, heads).to(acc).view(-1, b, heads, v.shape[-1])  # [nk*b, g, hn] -> [nk, b, h, hn]
    out = torch.einsum("bhqk,kbhd->qbhd", probs, v4).reshape(-1, heads, v.shape[-1])  # [nq, b, h, hn] -> [Nq, h, hn]
    return out, lse.permute(2, 0, 1).reshape(-1, heads), keep  # [b, h, nq] -> [nq, b, h] -> [Nq, h]


def math_backward(dout, q, k, v, out, lse, plan: MathPlan, scale: float, dropout_p: float, keep):
    """(dq, dk, dv) (fp32 or fp64) of one block pair given the merged output and lse of the queries."""
    b, heads, groups, acc = plan.batch, q.shape[1], k.shape[1], accumulation_dtype(q)
    scores, q4, k4 = _scores(q, k, plan, scale)
    lse4 = lse.view(-1, b, heads).permute(1, 2, 0)  # [Nq, h] -> [nq, b, h] -> [b, h, nq]
    probs = torch.exp(scores - torch.where(torch.isneginf(lse4), 0.0, lse4)[..., None])
    do4 = dout.to(acc).view(-1, b, heads, dout.shape[-1])  # [Nq, h, hn] -> [nq, b, h, hn]
    v4 = _expand_groups(v, heads).to(acc).view(-1, b, heads, v.shape[-1])  # [nk*b, g, hn] -> [nk, b, h, hn]
    dropped = probs if keep is None else probs * keep / (1.0 - dropout_p)
    dv4 = torch.einsum("bhqk,qbhd->kbhd", dropped, do4)
    dprobs = torch.einsum("qbhd,kbhd->bhqk", do4, v4)
    if keep is not None:
        dprobs = dprobs * keep / (1.0 - dropout_p)
    delta = (do4 * out.to(acc).view(do4.shape)).sum(-1).permute(1, 2, 0)  # [nq, b, h] -> [b, h, nq]
    dscores = probs * (dprobs - delta[..., None])
    dq4 = torch.einsum("bhqk,kbhd->qbhd", dscores, k4) * scale
    dk4 = torch.einsum("bhqk,qbhd->kbhd", dscores, q4) * scale
    flat = lambda x: x.reshape(-1, heads, x.shape[-1])  # [n, b, h, hn] -> [N, h, hn]
    return flat(dq4), _sum_groups(flat(dk4), groups), _sum_groups(flat(dv4), groups)


@dataclass
class VarlenCall:
    """One variable-length kernel call: query segment i attends to key segment i (causal or full)."""

    q_index: torch.Tensor
    """[Tq] flat indices of the queries, segment after segment."""

    k_index: torch.Tensor
    """[Tk] flat indices of the keys (a key may appear in several segments)."""

    cu_q: torch.Tensor
    """int32 [segments + 1] prefix sums of the query segment lengths."""

    cu_k: torch.Tensor
    """int32 [segments + 1] prefix sums of the key segment lengths."""

    max_q: int
    """Longest query segment."""

    max_k: int
    """Longest key segment."""

    causal: bool
    """Causal within each segment (query and key segments are then the same tokens)."""

    in_order: bool = False
    """The query and key indices are both 0, 1, ..., T-1: the call reads and writes the tensors as they
    are (no gather of the inputs, no scatter of the outputs)."""


def _segment_keys(group: TokenGroup, select: torch.Tensor, batch: int):
    """(flat indices, segment keys) of the selected tokens of every row, row by row, in token order."""
    tokens = torch.nonzero(select).view(-1)  # [m, 1] -> [m]
    rows = torch.arange(batch, device=tokens.device)
    flat = (tokens[None, :] * batch + rows[:, None]).reshape(-1)  # [b, m] -> [b*m], row-major
    if group.doc is None:
        keys = rows[:, None].expand(batch, tokens.numel()).reshape(-1)  # one segment per row
    else:
        keys = group.doc[:, tokens].reshape(-1)  # [b, m] -> [b*m]
    return flat, keys


def _varlen_pieces(query: TokenGroup, key: TokenGroup, q_select, k_select, batch: int):
    """Matched (query flat indices, key flat indices, query lengths, key lengths) of one chunk pair."""
    q_flat, q_keys = _segment_keys(query, q_select, batch)
    k_flat, k_keys = _segment_keys(key, k_select, batch)
    q_uniq, q_counts = torch.unique_consecutive(q_keys, return_counts=True)
    k_uniq, k_counts = torch.unique_consecutive(k_keys, return_counts=True)
    q_common, k_common = torch.isin(q_uniq, k_uniq), torch.isin(k_uniq, q_uniq)
    q_keep = torch.repeat_interleave(q_common, q_counts)
    k_keep = torch.repeat_interleave(k_common, k_counts)
    return q_flat[q_keep], k_flat[k_keep], q_counts[q_common], k_counts[k_common]


def _varlen_call(pieces: List, causal: bool) -> Optional[VarlenCall]:
    pieces = [p for p in pieces if p[2].numel() > 0]
    if not pieces:
        return None
    q_index, k_index, q_lens, k_lens = (torch.cat(parts) for parts in zip(*pieces))
    zero = q_lens.new_zeros(1)
    cu_q = torch.cat([zero, torch.cumsum(q_lens, 0)]).to(torch.int32)
    cu_k = torch.cat([zero, torch.cumsum(k_lens, 0)]).to(torch.int32)
    max_q, max_k = torch.stack([q_lens.max(), k_lens.max()]).tolist()
    in_order = bool(torch.equal(q_index, torch.arange(q_index.numel(), device=q_index.device))
                    and torch.equal(k_index, q_index))
    return VarlenCall(q_index, k_index, cu_q, cu_k, int(max_q), int(max_k), causal, in_order)


def _covers(call: VarlenCall, q: torch.Tensor, k: torch.Tensor) -> bool:
    """The one call of a block pair reads every query and key in place (see `VarlenCall.in_order`)."""
    return call.in_order and call.q_index.numel() == q.shape[0] == k.shape[0]


def varlen_plan(query: TokenGroup, key: TokenGroup, batch: int) -> List[VarlenCall]:
    """The kernel calls covering causal, document-restricted attention of `query` to `key`.

    The same token set attends causally in one call (one segment per row and document). Otherwise, for each
    query chunk a: a full call against the key chunks before it, and a causal call against chunk a itself
    when the keys hold it (CP chunk order is causal order inside every document)."""
    if query.ranks == key.ranks:
        everything = torch.ones_like(query.index, dtype=torch.bool)
        return [c for c in [_varlen_call([_varlen_pieces(query, key, everything, everything, batch)], True)] if c]
    full, diagonal = [], []
    for chunk in query.chunk_values:
        q_select = query.chunk == chunk
        if any(c < chunk for c in key.chunk_values):
            full.append(_varlen_pieces(query, key, q_select, key.chunk < chunk, batch))
        if chunk in key.chunk_values:
            diagonal.append(_varlen_pieces(query, key, q_select, key.chunk == chunk, batch))
    calls = [_varlen_call(full, False), _varlen_call(diagonal, True)]
    return [c for c in calls if c is not None]


def _flash_varlen_forward(q, k, v, call: VarlenCall, scale: float, dropout_p: float):
    """FlashAttention-2 varlen forward: (out [T, h, hn], lse [h, T], rng state, unused, debug mask)."""
    return torch.ops.aten._flash_attention_forward(q, k, v, call.cu_q, call.cu_k, call.max_q, call.max_k, dropout_p,
                                                   call.causal, False, scale=scale)


def _flash_varlen_backward(dout, q, k, v, out, lse, call: VarlenCall, scale: float, dropout_p: float, rng_state,
                           unused):
    """FlashAttention-2 varlen backward: (dq, dk, dv) given the (merged) out and lse [h, T]."""
    return torch.ops.aten._flash_attention_backward(dout, q, k, v, out, lse, call.cu_q, call.cu_k, call.max_q,
                                                    call.max_k, dropout_p, call.causal, rng_state, unused, scale=scale)


def varlen_forward(q, k, v, calls: List[VarlenCall], scale: float, dropout_p: float = 0.0):
    """(out, lse, [Philox states]) of one block pair through FlashAttention's varlen kernel, merged over calls."""
    out, lse, states, acc = None, None, [], accumulation_dtype(q)
    if len(calls) == 1 and _covers(calls[0], q, k):  # e.g. packed documents without CP: no gather/scatter
        part, part_lse, rng_state, unused, _ = _flash_varlen_forward(q, k, v, calls[0], scale, dropout_p)
        return part.to(acc), part_lse.t(), [(rng_state, unused)]  # lse [h, T] -> [T, h] (a view)
    for call in calls:
        part, part_lse, rng_state, unused, _ = _flash_varlen_forward(
            q.index_select(0, call.q_index), k.index_select(0, call.k_index), v.index_select(0, call.k_index),
            call, scale, dropout_p)
        block_out = q.new_zeros(q.shape, dtype=acc).index_copy_(0, call.q_index, part.to(acc))
        block_lse = q.new_full(q.shape[:2], float("-inf"), dtype=acc)
        block_lse.index_copy_(0, call.q_index, part_lse.t().to(acc))  # [h, T] -> [T, h]
        out, lse = (block_out, block_lse) if out is None else merge_partial(out, lse, block_out, block_lse)
        states.append((rng_state, unused))
    if out is None:  # no allowed pair at all
        out = q.new_zeros(q.shape, dtype=acc)
        lse = q.new_full(q.shape[:2], float("-inf"), dtype=acc)
    return out, lse, states


def varlen_backward(dout, q, k, v, out, lse, calls: List[VarlenCall], scale: float, dropout_p: float, states):
    """(dq, dk, dv) of one block pair given the merged output and lse, through the varlen kernel: fp32, or
    the inputs' dtype when one in-order call covers the block (the kernel rounds to it either way)."""
    acc = accumulation_dtype(q)
    if len(calls) == 1 and _covers(calls[0], q, k):  # gradients in the inputs' dtype; callers accumulate in fp32
        rng_state, unused = states[0]
        dq, dk, dv = _flash_varlen_backward(dout, q, k, v, out, lse.t().contiguous(),  # [T, h] -> [h, T]
                                            calls[0], scale, dropout_p, rng_state, unused)[:3]
        return dq, dk, dv
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for call, (rng_state, unused) in zip(calls, states):
        rows = call.q_index
        grads = _flash_varlen_backward(
            dout.index_select(0, rows), q.index_select(0, rows), k.index_select(0, call.k_index),
            v.index_select(0, call.k_index), out.index_select(0, rows),
            lse.index_select(0, rows).t().contiguous(),  # [T, h] -> [h, T]
            call, scale, dropout_p, rng_state, unused)
        dq.index_add_(0, rows, grads[0].to(acc))
        dk.index_add_(0, call.k_index, grads[1].to(acc))
        dv.index_add_(0, call.k_index, grads[2].to(acc))
    return dq, dk, dv


class BlockKernel:
    """The backend used for one block pair: `plan`, `forward`, `backward` with a common signature."""

    def __init__(self, name: str):
        self.name = name

    def plan(self, query: TokenGroup, key: TokenGroup, batch: int):
        """Backend-specific description of the allowed (query, key) pairs."""
        if self.name == "math":
            return MathPlan(allowed_mask(query, key), batch)
        return varlen_plan(query, key, batch)

    def forward(self, q, k, v, plan, scale, dropout_p):
        """(out fp32, lse fp32, state for the backward)."""
        if self.name == "math":
            return math_forward(q, k, v, plan, scale, dropout_p)
        return varlen_forward(q, k, v, plan, scale, dropout_p)

    def backward(self, dout, q, k, v, out, lse, plan, scale, dropout_p, state):
        """(dq, dk, dv) given the merged out (in q's dtype) and lse: fp32 (see `varlen_backward`)."""
        if self.name == "math":
            return math_backward(dout, q, k, v, out, lse, plan, scale, dropout_p, state)
        return varlen_backward(dout, q, k, v, out, lse, plan, scale, dropout_p, state)


_PROBED = {}


def _probe_flash_varlen(device, dtype, head_dim: int, heads: int, groups: int) -> Optional[str]:
    """None when the varlen kernels reproduce the math backend on a small problem, else the reason."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    n, b = 64, 2
    make = lambda g: (torch.randn(n * b, g, head_dim, generator=generator) * 0.5).to(device=device, dtype=dtype)
    q, k, v, dout = make(heads), make(groups), make(groups), make(heads)
    index = torch.arange(n, device=device)
    doc = torch.arange(n, device=device)[None, :] // 24 + 10 * torch.arange(b, device=device)[:, None]  # [b, n]
    group = TokenGroup(index=index, chunk=index // (n // 2), chunk_values=(0, 1), doc=doc, ranks=(0,))
    # causal (same tokens) and full (later queries, earlier keys) calls, documents crossing the halves
    halves = [TokenGroup(index=index[part], chunk=index[part] // (n // 2), chunk_values=(c,), doc=doc[:, part],
                         ranks=(c,)) for c, part in enumerate((slice(0, n // 2), slice(n // 2, n)))]
    for query, key, rows in ((group, group, slice(None)), (halves[1], halves[0], slice(n * b // 2, None))):
        reason = _compare_with_math(q[rows], k, v, dout[rows], query, key, b, dtype, head_dim)
        if reason is not None:
            return reason
    return None


def _compare_with_math(q, k, v, dout, query, key, b, dtype, head_dim):
    if key is not query:
        k, v = k[: k.shape[0] // 2], v[: v.shape[0] // 2]
    try:
        outs = []
        for name in ("math", "flash_varlen"):
            kernel = BlockKernel(name)
            plan = kernel.plan(query, key, b)
            out, lse, state = kernel.forward(q, k, v, plan, head_dim ** -0.5, 0.0)
            grads = kernel.backward(dout, q, k, v, out.to(dtype), lse, plan, head_dim ** -0.5, 0.0, state)
            outs.append([out, *grads])
    except (RuntimeError, NotImplementedError, TypeError) as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    for name, ref, got in zip(("out", "dq", "dk", "dv"), outs[0], outs[1]):
        err = (ref - got).abs().max().item() / max(ref.abs().max().item(), 1e-6)
        if not err < 0.05:
            return f"{name} differs from the math backend by {err:.3f} (relative)"
    return None


def select_kernel(q: torch.Tensor, k: torch.Tensor) -> BlockKernel:
    """`flash_varlen` on CUDA for half-precision inputs whose kernels pass a one-time check, else `math`.

    The check (once per device, dtype, head dim and head/group counts) compares the varlen kernels with the
    math backend on a small problem; a failure is logged once with its reason."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return BlockKernel("math")
    key = (q.device, q.dtype, q.shape[-1], q.shape[-2], k.shape[-2])  # [..., heads, head dim]
    if key not in _PROBED:
        reason = _probe_flash_varlen(*key)
        if reason is not None:
            logger.warning("context-parallel / document-masked attention falls back to the math path on %s "
                           "(%s, head dim %d): the FlashAttention varlen kernels failed a check: %s",
                           q.device, q.dtype, q.shape[-1], reason)
        _PROBED[key] = "math" if reason else "flash_varlen"
    return BlockKernel(_PROBED[key])


__all__ = [
    "BlockKernel",
    "accumulation_dtype",
    "MathPlan",
    "VarlenCall",
    "math_backward",
    "math_forward",
    "merge_partial",
    "select_kernel",
    "varlen_backward",
    "varlen_forward",
    "varlen_plan",
]
