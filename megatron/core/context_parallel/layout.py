"""Which tokens each context-parallel rank holds, and which key each query may attend to.

Megatron's load-balanced split (`get_batch_on_this_cp_rank`): every row of S tokens is cut into 2 * CP
chunks of S / (2 * CP) and CP rank r keeps chunks r and 2 * CP - 1 - r, in that order, so every rank gets
the same amount of causal attention work. Packed (THD) rows are split the same way per sequence (each
sequence, padded to a multiple of 2 * CP, is cut into 2 * CP pieces; Transformer Engine's
`thd_get_partitioned_indices`).

A `TokenGroup` describes the tokens on one side of an attention computation by their global index in the
row (the causal order), their document key and their CP chunk id. Query i may attend to key j when
`index[j] <= index[i]` and both belong to the same document; this single rule covers plain causal
attention, document masking (`--reset-attention-mask`) and packed sequences, under any CP split.
"""
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch


def cp_chunk_ids(cp_size: int, cp_rank: int) -> Tuple[int, int]:
    """The two of the 2 * CP sequence chunks that CP rank `cp_rank` keeps, in local order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def load_balanced_indices(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions ([seq_len / cp]) of the tokens CP rank `cp_rank` holds, in its local order."""
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(
            f"sequence length ({seq_len}) must be divisible by 2 x context-parallel size ({2 * cp_size}): "
            "each row is cut into 2 * CP equal chunks."
        )
    chunk = seq_len // (2 * cp_size)
    starts = [c * chunk for c in cp_chunk_ids(cp_size, cp_rank)]
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in starts])


def _sequence_of(index: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sequence number of each packed token index (cu_seqlens: [num_seqs + 1] prefix sums)."""
    return torch.searchsorted(cu_seqlens.to(index.device, torch.int64), index, right=True) - 1


def thd_partitioned_indices(cu_seqlens_padded: torch.Tensor, total_tokens: int, cp_size: int,
                            cp_rank: int) -> torch.Tensor:
    """Packed-token indices CP rank `cp_rank` holds: chunks r and 2CP-1-r of every sequence, sequence by
    sequence (Transformer Engine's `thd_get_partitioned_indices`). Each sequence length must be a multiple
    of 2 * CP. No host synchronisation (the result size is total_tokens / cp)."""
    device = cu_seqlens_padded.device
    index = torch.arange(total_tokens, device=device)
    holder, _ = _thd_holder_and_chunk(index, cu_seqlens_padded, cp_size)
    return torch.nonzero_static(holder == cp_rank, size=total_tokens // cp_size).view(-1)  # [n, 1] -> [n]


def _thd_holder_and_chunk(index: torch.Tensor, cu_seqlens: torch.Tensor, cp_size: int):
    cu = cu_seqlens.to(index.device, torch.int64)
    seq = _sequence_of(index, cu)
    start, length = cu[seq], cu[seq + 1] - cu[seq]
    chunk = (index - start) * (2 * cp_size) // length.clamp(min=1)
    holder = torch.where(chunk < cp_size, chunk, 2 * cp_size - 1 - chunk)
    return holder, chunk


def thd_positions(index: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Position of each packed token inside its own sequence (RoPE restarts at every sequence)."""
    cu = cu_seqlens.to(index.device, torch.int64)
    return index - cu[_sequence_of(index, cu)]


@dataclass
class TokenGroup:
    """The tokens on one side (queries or keys) of an attention computation, in their local order."""

    index: torch.Tensor
    """[n] global index of each token in its row (the causal order), sorted ascending."""

    chunk: torch.Tensor
    """[n] CP chunk id of each token (within its sequence for packed rows)."""

    chunk_values: Tuple[int, ...]
    """The chunk ids present, ascending (known on the host)."""

    doc: Optional[torch.Tensor]
    """[b, n] document key of each token (unique across rows: the varlen plans rely on it), or None: one
    document per row."""

    ranks: Tuple[int, ...]
    """The CP ranks whose tokens these are."""


class SequenceLayout:
    """The CP split and the documents of one micro-batch, shared by every attention layer.

    `seq_len` is the full row length S (packed rows: the total token count), `batch` the micro-batch size
    b. `doc_keys` ([b, S], or None for plain causal rows) gives each token's document. `cu_seqlens_padded`
    marks packed (THD) rows, which CP splits per sequence.
    """

    def __init__(self, seq_len: int, batch: int, cp_size: int, device, doc_keys: Optional[torch.Tensor] = None,
                 cu_seqlens_padded: Optional[torch.Tensor] = None):
        self.seq_len, self.batch, self.cp_size, self.device = seq_len, batch, cp_size, device
        self.doc_keys = doc_keys
        self.cu_seqlens_padded = cu_seqlens_padded
        self._held = {}
        self._plans = {}

    @property
    def packed(self) -> bool:
        """True for packed (THD) rows."""
        return self.cu_seqlens_padded is not None

    def held(self, cp_rank: int) -> torch.Tensor:
        """[S / cp] global indices of CP rank `cp_rank`'s tokens, in its local order (ascending)."""
        if cp_rank not in self._held:
            if self.cp_size == 1:
                indices = torch.arange(self.seq_len, device=self.device)
            elif self.packed:
                indices = thd_partitioned_indices(self.cu_seqlens_padded, self.seq_len, self.cp_size, cp_rank)
            else:
                indices = load_balanced_indices(self.seq_len, self.cp_size, cp_rank, self.device)
            self._held[cp_rank] = indices
        return self._held[cp_rank]

    def concatenated(self, ranks: Sequence[int]) -> torch.Tensor:
        """Global indices of the tokens of `ranks` concatenated in that order (what a gather yields)."""
        return torch.cat([self.held(r) for r in ranks])

    def group(self, ranks: Sequence[int]) -> TokenGroup:
        """The tokens of CP ranks `ranks`, sorted by global index."""
        ranks = tuple(sorted(ranks))
        index = torch.sort(self.concatenated(ranks)).values
        chunk_values = tuple(sorted({c for r in ranks for c in cp_chunk_ids(self.cp_size, r)}))
        if self.cp_size == 1:
            chunk, chunk_values = torch.zeros_like(index), (0,)
        elif self.packed:
            _, chunk = _thd_holder_and_chunk(index, self.cu_seqlens_padded, self.cp_size)
        else:
            chunk = index // (self.seq_len // (2 * self.cp_size))
        doc = None if self.doc_keys is None else self.doc_keys[:, index]
        return TokenGroup(index=index, chunk=chunk, chunk_values=chunk_values, doc=doc, ranks=ranks)

    def sort_permutation(self, ranks: Sequence[int]) -> torch.Tensor:
        """Permutation taking the concatenation of `ranks`' tokens to ascending global order."""
        return torch.argsort(self.concatenated(ranks))

    def cached_plan(self, key, build):
        """The plan `build()` made for `key` on an earlier layer of this micro-batch (built on first use)."""
        if key not in self._plans:
            self._plans[key] = build()
        return self._plans[key]


def allowed_mask(query: TokenGroup, key: TokenGroup, causal: bool = True) -> torch.Tensor:
    """[b or 1, nq, nk] bool: True where a query may attend to a key (same document, key not later)."""
    allowed = torch.ones(1, query.index.numel(), key.index.numel(), dtype=torch.bool, device=query.index.device)
    if causal:
        allowed = allowed & (key.index[None, None, :] <= query.index[None, :, None])
    if query.doc is not None:
        allowed = allowed & (query.doc[:, :, None] == key.doc[:, None, :])
    return allowed


def document_keys_from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq_len: int, device) -> torch.Tensor:
    """[b, S] document key of every token of rows described by prefix sums over the flattened b * S tokens
    (each row's start must be a boundary; keys are made unique across rows either way)."""
    flat = torch.arange(batch * seq_len, device=device)
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    doc = torch.searchsorted(cu, flat, right=True) - 1
    rows = torch.arange(batch, device=device).repeat_interleave(seq_len)
    return (doc + rows * (cu.numel() + 1)).view(batch, seq_len)  # [b*S] -> [b, S]


_PLAIN_LAYOUTS = {}


def sequence_layout(packed_seq_params, local_len: int, batch: int, cp_size: int, device) -> SequenceLayout:
    """The layout of this micro-batch: rows of `local_len * cp_size` tokens (packed rows when
    `packed_seq_params.qkv_format == 'thd'`), documents from `packed_seq_params`' cumulative lengths.

    Cached: on the `packed_seq_params` object (one per micro-batch, shared by every layer, so masks and
    kernel plans are built once per micro-batch), or per shape when there are no documents."""
    seq_len = local_len * cp_size
    key = (seq_len, batch, cp_size, str(device))
    if packed_seq_params is None:
        if key not in _PLAIN_LAYOUTS:
            if len(_PLAIN_LAYOUTS) > 16:
                _PLAIN_LAYOUTS.clear()
            _PLAIN_LAYOUTS[key] = SequenceLayout(seq_len, batch, cp_size, device)
        return _PLAIN_LAYOUTS[key]
    cache = getattr(packed_seq_params, "_megatron_cp_layouts", None)
    if cache is None:
        cache = {}
        setattr(packed_seq_params, "_megatron_cp_layouts", cache)
    if key not in cache:
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        if cu is None:
            raise ValueError("packed_seq_params needs cu_seqlens_q (prefix sums of the sequence lengths).")
        packed = packed_seq_params.qkv_format == "thd"
        if packed and batch != 1:
            raise ValueError(f"packed sequences (qkv_format 'thd') need a batch dimension of 1, got {batch}.")
        doc_keys = document_keys_from_cu_seqlens(cu, batch, seq_len, device)
        cache[key] = SequenceLayout(seq_len, batch, cp_size, device, doc_keys=doc_keys,
                                    cu_seqlens_padded=cu.to(device) if packed else None)
    return cache[key]


__all__ = [
    "SequenceLayout",
    "sequence_layout",
    "TokenGroup",
    "allowed_mask",
    "cp_chunk_ids",
    "document_keys_from_cu_seqlens",
    "load_balanced_indices",
    "thd_partitioned_indices",
    "thd_positions",
]
