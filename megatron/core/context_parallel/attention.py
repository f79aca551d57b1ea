"""Causal attention over a sequence split across context-parallel ranks, and document-restricted attention.

Four ways to move the data (`--cp-comm-type`, Megatron's names):
- `p2p`: ring attention. K/V blocks travel around the CP ring; each step attends the local queries to the
  block that has arrived while the next block is already in flight. The backward passes K/V around again
  together with their gradient accumulators, so the owner ends with the full dK/dV (no recomputation of
  the forward, no stored copies of other ranks' K/V).
- `all_gather`: all-gather K/V (backward: reduce-scatter of dK/dV), then attend the local queries to the
  whole sequence.
- `a2a`: Ulysses. All-to-all trades the sequence split for a head split, every rank attends its heads over
  the whole sequence, and a second all-to-all trades back.
- `a2a+p2p`: all-to-all inside the first hierarchical level, ring attention across the second.

Every variant merges partial results with the log-sum-exp rule (`kernels.merge_partial`) and computes
exactly the gradients of full causal attention: the CPU parity tests hold them to 1e-5 of one process.
Tokens are tracked by global index and document (`layout`), so `--reset-attention-mask` documents and
packed (THD) sequences work in every variant.
"""
import inspect
from contextlib import nullcontext
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core.context_parallel import comm
from megatron.core.context_parallel.kernels import BlockKernel, accumulation_dtype, merge_partial, select_kernel
from megatron.core.context_parallel.layout import SequenceLayout, allowed_mask

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")

# SDPA backends tried in this order on CUDA. On an H200 (torch 2.11, cuDNN 9.19, bf16, head dim 128,
# causal, forward+backward) cuDNN's kernel measured 1.5-1.8x faster than flash attention at all three
# benchmark shapes, GQA included (docs/performance.md). torch 2.11's own default already picks cuDNN there;
# the explicit order keeps that choice when a torch version changes its default (earlier ones preferred
# flash). A backend that cannot take the inputs (an unsupported mask, say) is skipped by SDPA itself.
_CUDA_SDPA_PRIORITY = (
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)
_SDPA_SETS_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters


def sdpa_backend_priority(query: torch.Tensor):
    """Context choosing the SDPA backend order for `query`'s device (a no-op on CPU)."""
    if not query.is_cuda or not _SDPA_SETS_PRIORITY:
        return nullcontext()
    return sdpa_kernel(list(_CUDA_SDPA_PRIORITY), set_priority=True)


class _BlockAttention(torch.autograd.Function):
    """Attention of local queries to one block of keys with the kernel's exact backward (no communication)."""

    @staticmethod
    def forward(ctx, q, k, v, kernel: BlockKernel, plan, scale, dropout_p):
        out, lse, state = kernel.forward(q, k, v, plan, scale, dropout_p)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.plan, ctx.scale, ctx.dropout_p, ctx.state = kernel, plan, scale, dropout_p, state
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(dout, q, k, v, out, lse, ctx.plan, ctx.scale, ctx.dropout_p, ctx.state)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


class _RingAttention(torch.autograd.Function):
    """Ring attention over `group`: step i attends the local queries to the K/V block of ring rank r - i.

    Forward: K/V sent to the next ring rank at every step (overlapped with that step's attention).
    Backward: K/V sent around again, and each block's fp32 dK/dV accumulator travels with it, one step
    behind, so that after the last step every rank receives the complete gradient of its own block."""

    @staticmethod
    def forward(ctx, q, k, v, kernel: BlockKernel, plans, group, scale, dropout_p):
        out = lse = None
        states, k_cur, v_cur = [], k, v
        for step, plan in enumerate(plans):
            transfer = comm.ring_send_recv([k_cur, v_cur], group) if step + 1 < len(plans) else None
            block_out, block_lse, state = kernel.forward(q, k_cur, v_cur, plan, scale, dropout_p)
            out, lse = (block_out, block_lse) if out is None else merge_partial(out, lse, block_out, block_lse)
            states.append(state)
            if transfer is not None:
                k_cur, v_cur = transfer.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.plans, ctx.group, ctx.scale, ctx.dropout_p, ctx.states = (
            kernel, plans, group, scale, dropout_p, states)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        steps = len(ctx.plans)
        acc = accumulation_dtype(q)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv_acc = torch.zeros(v.shape, dtype=acc, device=v.device)
        k_cur, v_cur, grad_transfer = k, v, None
        for step, (plan, state) in enumerate(zip(ctx.plans, ctx.states)):
            kv_transfer = comm.ring_send_recv([k_cur, v_cur], ctx.group) if step + 1 < steps else None
            dq_i, dk_i, dv_i = ctx.kernel.backward(dout, q, k_cur, v_cur, out, lse, plan, ctx.scale, ctx.dropout_p,
                                                   state)
            dq += dq_i
            if grad_transfer is not None:  # the accumulators of the block now held, from the previous rank
                dk_acc, dv_acc = grad_transfer.wait()
            if steps == 1:  # a ring of one rank: nothing travels
                dk_acc, dv_acc = dk_acc + dk_i, dv_acc + dv_i
                break
            grad_transfer = comm.ring_send_recv([dk_acc + dk_i, dv_acc + dv_i], ctx.group)
            if kv_transfer is not None:
                k_cur, v_cur = kv_transfer.wait()
        dk, dv = (dk_acc, dv_acc) if steps == 1 else grad_transfer.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[2], x.shape[3])  # [s, b, n, hn] -> [s*b, n, hn]


def _ring(query, key, value, layout: SequenceLayout, query_ranks, peer_ranks, group, scale, dropout_p):
    """Ring attention of the tokens of `query_ranks` (sorted) against each ring peer's tokens in turn;
    `peer_ranks[i]` are the CP ranks whose tokens ring rank i holds."""
    kernel = select_kernel(query, key)
    ring_size, ring_rank = comm.group_size(group), comm.group_rank(group)
    sources = [peer_ranks[(ring_rank - step) % ring_size] for step in range(ring_size)]

    def build():
        q_group = layout.group(query_ranks)
        return [kernel.plan(q_group, layout.group(src), layout.batch) for src in sources]

    plans = layout.cached_plan(("ring", kernel.name, tuple(query_ranks), tuple(map(tuple, sources))), build)
    out = _RingAttention.apply(_flat(query), _flat(key), _flat(value), kernel, plans, group, scale, dropout_p)
    return out.view(query.shape)  # [s*b, np, hn] -> [s, b, np, hn]


def _all_gather(query, key, value, layout: SequenceLayout, cp_rank, cp_group, scale, dropout_p):
    cp_size = comm.group_size(cp_group)
    order = layout.sort_permutation(range(cp_size))
    key = comm.all_gather_along_dim(key, 0, cp_group).index_select(0, order)  # rank order -> sequence order
    value = comm.all_gather_along_dim(value, 0, cp_group).index_select(0, order)
    kernel = select_kernel(query, key)
    plan = layout.cached_plan(("all_gather", kernel.name, cp_rank), lambda: kernel.plan(
        layout.group([cp_rank]), layout.group(range(cp_size)), layout.batch))
    out = _BlockAttention.apply(_flat(query), _flat(key), _flat(value), kernel, plan, scale, dropout_p)
    return out.view(query.shape)  # [s*b, np, hn] -> [s, b, np, hn]


def document_attention(query, key, value, layout: SequenceLayout, ranks: Sequence[int], scale: float,
                       dropout_p: float) -> torch.Tensor:
    """Causal attention of the whole sequence held as `ranks`' tokens in ascending order, restricted to
    documents. CPU: SDPA with the dense mask (the reference path); CUDA: the varlen kernels (no [s, s] mask).
    Inputs [s, b, n, hn] (keys/values may have fewer groups), output [s, b, np, hn]."""
    kernel = select_kernel(query, key)
    if kernel.name == "math":
        group = layout.cached_plan(("group", tuple(ranks)), lambda: layout.group(ranks))
        mask = layout.cached_plan(("dense_mask", tuple(ranks)), lambda: allowed_mask(group, group)[:, None])
        return _sdpa(query, key, value, scale, dropout_p, mask=mask)
    plan = layout.cached_plan(("document", kernel.name, tuple(ranks)), lambda: kernel.plan(
        layout.group(ranks), layout.group(ranks), layout.batch))
    out = _BlockAttention.apply(_flat(query), _flat(key), _flat(value), kernel, plan, scale, dropout_p)
    return out.view(query.shape)  # [s*b, np, hn] -> [s, b, np, hn]


def _sdpa(query, key, value, scale, dropout_p, mask: Optional[torch.Tensor] = None):
    """SDPA over [s, b, n, hn] inputs (causal when no mask is given); output [s, b, np, hn]."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, hn] -> [b, n, s, hn]
    with sdpa_backend_priority(q):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=mask is None,
                                             scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.permute(2, 0, 1, 3)  # [b, np, s, hn] -> [s, b, np, hn]


def _heads_divisible(key, value, heads: int, parts: int):
    """K/V with their groups expanded to all heads when the groups cannot be split `parts` ways."""
    if key.shape[2] % parts == 0:
        return key, value
    rep = heads // key.shape[2]
    return key.repeat_interleave(rep, dim=2), value.repeat_interleave(rep, dim=2)


def _a2a_members(a2a_group, cp_group):
    """CP ranks of the members of `a2a_group`, in its rank order."""
    cp_ranks = comm.group_ranks(cp_group)
    return [cp_ranks.index(g) for g in comm.group_ranks(a2a_group)]


def _a2a(query, key, value, layout: SequenceLayout, a2a_group, cp_group, scale, dropout_p, ring_group=None):
    """Ulysses: all-to-all over `a2a_group`, attention over the gathered tokens (ring attention across
    `ring_group` for a2a+p2p), all-to-all back."""
    parts = comm.group_size(a2a_group)
    if query.shape[2] % parts != 0:
        raise ValueError(f"cp_comm_type a2a: the {query.shape[2]} attention heads of this tensor-parallel rank "
                         f"cannot be split over {parts} context-parallel ranks: choose heads / TP divisible by it.")
    key, value = _heads_divisible(key, value, query.shape[2], parts)
    members = _a2a_members(a2a_group, cp_group)
    order = layout.sort_permutation(members)
    gathered = [comm.all_to_all_seq_to_heads(t, a2a_group).index_select(0, order) for t in (query, key, value)]
    if ring_group is None:
        if layout.doc_keys is None:
            out = _sdpa(*gathered, scale, dropout_p)
        else:
            out = document_attention(*gathered, layout, members, scale, dropout_p)
    else:
        out = _ring(*gathered, layout, members, _ring_peer_sets(members, ring_group, cp_group, parts), ring_group,
                    scale, dropout_p)
    out = out.index_select(0, torch.argsort(order))  # sequence order -> rank order
    return comm.all_to_all_heads_to_seq(out, a2a_group)


def _ring_peer_sets(members, ring_group, cp_group, parts):
    """For every rank of `ring_group`, the CP ranks of its first-level (all-to-all) group."""
    cp_ranks = comm.group_ranks(cp_group)
    sets = []
    for global_rank in comm.group_ranks(ring_group):
        cp_rank = cp_ranks.index(global_rank)
        base = cp_rank - cp_rank % parts
        sets.append(list(range(base, base + parts)))
    if sorted(members) not in sets:
        raise ValueError(f"a2a+p2p: the all-to-all group (CP ranks {members}) is not a block of {parts} "
                         "consecutive CP ranks: build the groups with initialize_model_parallel("
                         "hierarchical_context_parallel_sizes=...).")
    return sets


def context_parallel_attention(query, key, value, layout: SequenceLayout, cp_comm_type: str, cp_group,
                               hierarchical_groups=None, scale: float = 1.0, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal (and document-restricted) attention of this CP rank's queries over the whole sequence.

    query [s/cp, b, np, hn], key/value [s/cp, b, ng, hn] in Megatron's load-balanced chunk order; returns
    [s/cp, b, np, hn] in the query's dtype. `hierarchical_groups` ([a2a group, p2p group]) is needed by
    'a2a+p2p'."""
    cp_rank = comm.group_rank(cp_group)
    if cp_comm_type == "p2p":
        return _ring(query, key, value, layout, [cp_rank], [[r] for r in range(comm.group_size(cp_group))],
                     cp_group, scale, dropout_p)
    if cp_comm_type == "all_gather":
        return _all_gather(query, key, value, layout, cp_rank, cp_group, scale, dropout_p)
    if cp_comm_type == "a2a":
        return _a2a(query, key, value, layout, cp_group, cp_group, scale, dropout_p)
    if cp_comm_type == "a2a+p2p":
        if not hierarchical_groups or len(hierarchical_groups) != 2:
            raise ValueError("cp_comm_type 'a2a+p2p' needs two hierarchical context-parallel groups "
                             "(--hierarchical-context-parallel-sizes with two sizes).")
        return _a2a(query, key, value, layout, hierarchical_groups[0], cp_group, scale, dropout_p,
                    ring_group=hierarchical_groups[1])
    raise ValueError(f"cp_comm_type ({cp_comm_type!r}) must be one of {', '.join(CP_COMM_TYPES)}.")


__all__ = ["CP_COMM_TYPES", "context_parallel_attention", "document_attention", "sdpa_backend_priority"]
