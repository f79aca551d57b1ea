"""Core attention of BERT-style encoders under a key-padding mask without a dense mask on the GPU.

A padding mask [b, 1, 1, s] (True = masked key) leaves each row's real tokens attending to each other. On
CUDA in fp16/bf16 `PaddingVarlenAttention` gathers the real tokens of all rows into one packed tensor and runs
FlashAttention-2's variable-length kernel (one full, non-causal segment per row), so no mask is built and no
key block of padding is computed; padded query rows get zeros (nothing downstream reads them: keys they
would feed are masked, the MLP is per token, the LM loss and the pooler read real tokens only). Elsewhere
(CPU, fp32, an additive bias, other mask shapes) it is `TECompatibleDotProductAttention` unchanged.

The packing plan (token indices, cumulative lengths, longest row) needs the mask's values on the host once per
forward: it is cached for the mask tensor the encoder passes to all its layers.
"""
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch

from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import TECompatibleDotProductAttention
from megatron.core.transformer.enums import AttnMaskType


@dataclass
class PaddingPlan:
    """Where the real tokens of a [b, s] batch sit in the flattened row-major [b * s] order."""

    index: torch.Tensor
    """[T] flat (row * s + position) indices of the real tokens, row after row."""

    cu_seqlens: torch.Tensor
    """int32 [b + 1] prefix sums of the rows' real-token counts."""

    max_seqlen: int
    """The longest row (real tokens)."""

    total: int
    """b * s."""


def padding_plan(attention_mask: torch.Tensor) -> PaddingPlan:
    """Plan of a boolean key mask [b, 1, 1, s] (True = masked)."""
    real = ~attention_mask[:, 0, 0, :]  # [b, 1, 1, s] -> [b, s]
    lengths = real.sum(dim=1)
    cu_seqlens = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32)
    return PaddingPlan(torch.nonzero(real.reshape(-1)).view(-1), cu_seqlens, int(lengths.max().item()),
                       real.numel())


def flash_varlen_forward(q, k, v, plan: PaddingPlan, scale: float, dropout_p: float):
    """(out [T, n, hn], lse, rng state, unused) of FlashAttention-2's varlen kernel, full attention per row."""
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, plan.cu_seqlens, plan.cu_seqlens, plan.max_seqlen, plan.max_seqlen, dropout_p, False, False,
        scale=scale)
    return out, lse, rng_state, unused


def flash_varlen_backward(dout, q, k, v, out, lse, plan: PaddingPlan, scale: float, dropout_p: float, rng_state,
                          unused):
    """(dq, dk, dv) of `flash_varlen_forward`."""
    return torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, plan.cu_seqlens, plan.cu_seqlens, plan.max_seqlen, plan.max_seqlen, dropout_p,
        False, rng_state, unused, scale=scale)


class _PackedAttention(torch.autograd.Function):
    """Packed real tokens in, packed outputs out; the kernels are module attributes (tests swap them)."""

    @staticmethod
    def forward(ctx, q, k, v, plan: PaddingPlan, scale: float, dropout_p: float):
        out, lse, rng_state, unused = PaddingVarlenAttention.kernel_forward(q, k, v, plan, scale, dropout_p)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.dropout_p, ctx.rng = plan, scale, dropout_p, (rng_state, unused)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = PaddingVarlenAttention.kernel_backward(dout.contiguous(), q, k, v, out, lse, ctx.plan,
                                                            ctx.scale, ctx.dropout_p, *ctx.rng)
        return dq, dk, dv, None, None, None


class PaddingVarlenAttention(TECompatibleDotProductAttention):
    """`TECompatibleDotProductAttention` whose key-padding case runs the varlen kernel (see the module doc)."""

    kernel_forward = staticmethod(flash_varlen_forward)
    kernel_backward = staticmethod(flash_varlen_backward)
    _cached_plan = (None, None)

    def uses_varlen(self, query: torch.Tensor, attention_mask, attn_mask_type, attention_bias, packed_seq_params):
        """Whether this call takes the packed varlen path."""
        if torch.compiler.is_compiling() or (query.is_cuda and torch.cuda.is_current_stream_capturing()):
            return False  # the plan reads the mask on the host
        return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and attention_bias is None
                and packed_seq_params is None and self.cp_comm_type is None and not self.softmax_in_fp32
                and attn_mask_type == AttnMaskType.padding and attention_mask is not None
                and attention_mask.dtype == torch.bool and attention_mask.dim() == 4
                and attention_mask.shape[1] == 1 and attention_mask.shape[2] == 1
                and query.shape[-1] % 8 == 0 and query.shape[-1] <= 256)

    @classmethod
    def plan_for(cls, attention_mask: torch.Tensor) -> PaddingPlan:
        """The plan of `attention_mask`, computed once for the mask object all layers share."""
        mask, plan = cls._cached_plan
        if mask is not attention_mask:
            plan = padding_plan(attention_mask)
            PaddingVarlenAttention._cached_plan = (attention_mask, plan)
        return plan

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if not self.uses_varlen(query, attention_mask, mask_type, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        sq, b, heads, hn = query.shape
        plan = self.plan_for(attention_mask)
        packed = []
        for t in (query, key, value):
            flat = t.transpose(0, 1).reshape(b * sq, t.shape[2], hn)  # [s, b, n, hn] -> [b*s, n, hn]
            packed.append(flat.index_select(0, plan.index))  # [b*s, n, hn] -> [T, n, hn]
        dropout_p = self.dropout_p if self.training else 0.0
        fork = dropout_p > 0.0 and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if fork else nullcontext():
            out = _PackedAttention.apply(*packed, plan, self.softmax_scale, dropout_p)
        full = out.new_zeros(b * sq, heads, hn).index_copy(0, plan.index, out)  # [T, np, hn] -> [b*s, np, hn]
        full = full.view(b, sq, heads * hn).transpose(0, 1)  # [b*s, np, hn] -> [s, b, np*hn]
        return full.contiguous()


__all__ = ["PaddingPlan", "PaddingVarlenAttention", "padding_plan"]
