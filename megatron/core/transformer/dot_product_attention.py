"""`DotProductAttention`: softmax(Q K^T * scale + mask) V through torch scaled_dot_product_attention.

Inputs are [s, b, np, hn] (queries) and [s, b, ng, hn] (keys/values, ng query groups for GQA); the
output is [sq, b, np * hn], this rank's slice of the hidden dimension. SDPA picks the fastest kernel
available (flash / cuDNN / memory-efficient on GPU, fused math on CPU), so no Transformer Engine or
Apex softmax is needed.

Masks follow Megatron: a boolean tensor where True means "masked out". A causal layer with no explicit
mask uses SDPA's built-in causal masking. Attention dropout runs inside the 'model-parallel-rng' fork,
since each tensor-parallel rank holds different heads (with sequence parallelism the transformer block
has already entered that fork, and forking twice would replay the same random stream).

Two more paths, both in `megatron.core.context_parallel`, are taken only when asked for:
- `packed_seq_params` (documents): attention restricted to each document. `qkv_format='thd'` is Megatron's
  packed layout (batch dimension 1, inputs [t, n, hn], output [t, np * hn]); 'sbhd' with cumulative lengths
  over the flattened [b * s] tokens marks documents inside ordinary rows (how `pretrain_gpt.py` passes
  `--reset-attention-mask`). No [s, s] mask exists on GPUs (varlen kernels).
- `context_parallel_size > 1`: causal attention across the CP split with `cp_comm_type`'s communication
  (like Transformer Engine, a causal layer ignores `attention_mask`).
Without either, the causal SDPA call below is the path, unchanged.
"""
import math
from contextlib import nullcontext
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.context_parallel.attention import (
    CP_COMM_TYPES,
    context_parallel_attention,
    document_attention,
    sdpa_backend_priority,
)
from megatron.core.context_parallel.layout import sequence_layout
from megatron.core.transformer.enums import AttnMaskType, AttnType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import get_model_comm_pgs_tp, get_tp_world_size
from megatron.core.utils import divide


class DotProductAttention(MegatronModule):
    """Core attention (no projections) over this rank's heads."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        model_comm_pgs=None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
    ):
        super().__init__(config=config)
        self.cp_comm_type = None
        if config.context_parallel_size > 1:
            self.cp_comm_type = "p2p" if cp_comm_type is None else cp_comm_type
            if self.cp_comm_type not in CP_COMM_TYPES:
                raise ValueError(f"cp_comm_type ({self.cp_comm_type!r}) must be one of {', '.join(CP_COMM_TYPES)}.")
            if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
                raise ValueError(f"context parallelism supports causal attention only, got {attn_mask_type}.")
        self.model_comm_pgs = model_comm_pgs
        if config.window_size is not None:
            raise ValueError("window_size (sliding-window attention) is not supported by the native DotProductAttention.")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        world_size = get_tp_world_size(get_model_comm_pgs_tp(model_comm_pgs))
        # multi-latent attention: query/key heads of k_channels, value (and output) heads of v_channels
        k_channels = config.kv_channels if k_channels is None else k_channels
        v_channels = config.kv_channels if v_channels is None else v_channels
        self.hidden_size_per_partition = divide(v_channels * config.num_attention_heads, world_size)
        self.hidden_size_per_attention_head = k_channels
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, world_size)
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_in_fp32 = config.apply_query_key_layer_scaling

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        attn_mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if packed_seq_params is not None or self.cp_comm_type is not None:
            return self._document_or_context_parallel(query, key, value, attention_mask, attn_mask_type,
                                                      attention_bias, packed_seq_params)
        sq, b = query.shape[0], query.shape[1]
        out_dtype = query.dtype
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, hn] -> [b, n, s, hn]
        if self.softmax_in_fp32 and q.dtype != torch.float32:
            q, k, v = q.float(), k.float(), v.float()
        if attention_bias is not None and attention_mask is None and attn_mask_type == AttnMaskType.causal:
            # an additive bias (T5's relative positions) replaces SDPA's causal flag: mask the future explicitly
            attention_mask = torch.ones(sq, k.shape[2], dtype=torch.bool, device=q.device).triu(1)
        mask = self._sdpa_mask(attention_mask, attention_bias, attn_mask_type, q.dtype)
        is_causal = mask is None and attn_mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        dropout_p = self.dropout_p if self.training else 0.0
        enable_gqa = q.shape[1] != k.shape[1]
        # Under sequence parallelism the whole block already runs inside the model-parallel fork.
        fork = dropout_p > 0.0 and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if fork else nullcontext(), sdpa_backend_priority(q):
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                scale=self.softmax_scale, enable_gqa=enable_gqa,
            )
        context = context.to(out_dtype).permute(2, 0, 1, 3)  # [b, np, sq, hn] -> [sq, b, np, hn]
        return context.reshape(sq, b, self.hidden_size_per_partition)  # [sq, b, np, hn] -> [sq, b, np*hn]

    # Eager inside a compiled layer: the plans depend on each micro-batch's documents (host values) and the
    # ring exchanges data; traced, every micro-batch would recompile. The layer's graph splits around it.
    @torch.compiler.disable
    def _document_or_context_parallel(self, query, key, value, attention_mask, attn_mask_type, attention_bias,
                                      packed_seq_params):
        """Document-restricted and/or context-parallel attention (see the module docstring)."""
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd:
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))  # [t, n, hn] -> [t, 1, n, hn]
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported with packed sequences or context parallelism.")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"packed sequences and context parallelism need causal attention, got {attn_mask_type}.")
        if attention_mask is not None and self.cp_comm_type is not None and type(self) is DotProductAttention:
            raise ValueError("an explicit attention_mask is not supported with context parallelism: pass "
                             "documents as packed_seq_params (pretrain_gpt.py does for --reset-attention-mask).")
        sq, b = query.shape[0], query.shape[1]
        dropout_p = self.dropout_p if self.training else 0.0
        cp_group, hierarchical = self._cp_groups()
        cp_size = cp_group.size() if self.cp_comm_type is not None else 1
        layout = sequence_layout(packed_seq_params, sq, b, cp_size, query.device)
        fork = dropout_p > 0.0 and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if fork else nullcontext():
            if self.cp_comm_type is None:
                context = document_attention(query, key, value, layout, [0], self.softmax_scale, dropout_p)
            else:
                context = context_parallel_attention(query, key, value, layout, self.cp_comm_type, cp_group,
                                                     hierarchical, self.softmax_scale, dropout_p)
        if thd:
            return context.reshape(sq, self.hidden_size_per_partition)  # [t, 1, np, hn] -> [t, np*hn]
        return context.reshape(sq, b, self.hidden_size_per_partition)  # [sq, b, np, hn] -> [sq, b, np*hn]

    def _cp_groups(self):
        """(CP group, hierarchical CP groups or None) from model_comm_pgs or parallel_state."""
        if self.cp_comm_type is None:
            return None, None
        pgs = self.model_comm_pgs
        cp_group = getattr(pgs, "cp", None) if pgs is not None else None
        if cp_group is None:
            cp_group = parallel_state.get_context_parallel_group()
        hierarchical = getattr(pgs, "hcp", None) if pgs is not None else None
        if hierarchical is None and self.cp_comm_type == "a2a+p2p":
            hierarchical = parallel_state.get_hierarchical_context_parallel_groups()
        return cp_group, hierarchical

    @staticmethod
    def _sdpa_mask(attention_mask, attention_bias, attn_mask_type, dtype):
        """Megatron's True-means-masked boolean mask (plus an optional additive bias) as an SDPA mask."""
        if attn_mask_type == AttnMaskType.no_mask:
            attention_mask = None
        if attention_mask is None:
            return attention_bias.to(dtype) if attention_bias is not None else None
        allowed = ~attention_mask.bool()
        if attention_bias is None:
            return allowed
        blocked = torch.zeros((), dtype=dtype, device=attention_bias.device).new_full((), float("-inf"))
        return attention_bias.to(dtype).masked_fill(~allowed, blocked)




class TECompatibleDotProductAttention(DotProductAttention):
    """`DotProductAttention` that behaves like Transformer Engine's attention in Megatron's TE spec.

    Like TE, a causal layer ignores the attention mask it is given (the dataloader's mask is the causal
    mask anyway) and runs SDPA's causal kernel, which is also the fastest path. An (empty) `_extra_state`
    entry makes state dicts carry exactly Megatron's TE keys.
    """

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type == AttnMaskType.causal:
            attention_mask = None
        return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)

    def get_extra_state(self):
        """No extra state (the key exists for state-dict compatibility)."""
        return None

    def set_extra_state(self, state):
        """Extra state from Transformer Engine checkpoints (fp8 metadata) is ignored."""


__all__ = ["DotProductAttention", "TECompatibleDotProductAttention"]
