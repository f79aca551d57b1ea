"""`PackedSeqParams`: how several sequences are packed into one row of a batch (THD layout).

Megatron passes it from the data pipeline through `GPTModel.forward(packed_seq_params=...)` down to the
attention and RoPE code. With `qkv_format == "thd"` the batch dimension is 1, tokens of all sequences are
concatenated, and `cu_seqlens_*` (int32 prefix sums of the sequence lengths, `[num_seqs + 1]`) mark where
each sequence starts: lengths 3, 5, 2 give `cu_seqlens = [0, 3, 8, 10]` and `max_seqlen = 5`. The
`*_padded` variants count per-sequence padding (e.g. to multiples of 2 * CP); when given, positions and
the context-parallel split follow them.
"""
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class PackedSeqParams:
    """Boundaries of the sequences packed into a batch (Megatron Core's fields, all optional)."""

    qkv_format: Optional[str] = None
    """Layout of q, k and v: 'thd' for packed sequences, or 'sbhd' / 'bshd'."""

    cu_seqlens_q: Optional[torch.Tensor] = None
    """int32 [num_seqs + 1]: prefix sums of the query sequence lengths."""

    cu_seqlens_kv: Optional[torch.Tensor] = None
    """int32 [num_seqs + 1]: prefix sums of the key/value sequence lengths."""

    cu_seqlens_q_padded: Optional[torch.Tensor] = None
    """int32 [num_seqs + 1]: query prefix sums including each sequence's padding."""

    cu_seqlens_kv_padded: Optional[torch.Tensor] = None
    """int32 [num_seqs + 1]: key/value prefix sums including each sequence's padding."""

    max_seqlen_q: Optional[int] = None
    """Length of the longest query sequence."""

    max_seqlen_kv: Optional[int] = None
    """Length of the longest key/value sequence."""


__all__ = ["PackedSeqParams"]
