"""Multi-head / grouped-query self-attention with a fused QKV projection.

`linear_qkv` produces, per query group, the rows [q_1 .. q_{np/ng}, k, v] * head_dim (Megatron's
layout, so checkpoints interchange). Heads and query groups are split over tensor-parallel ranks;
each rank owns whole query groups, so the split is a contiguous slice of the fused weight.
"""
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from megatron.core.fusions.fused_qkv_rope import try_fused_qkv_rope
from megatron.core.transformer.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import get_model_comm_pgs_tp, get_tp_world_size
from megatron.core.utils import deprecate_inference_params, divide


def layer_cp_comm_type(config: TransformerConfig, layer_number: int) -> Optional[str]:
    """The context-parallel communication of layer `layer_number` (None without CP).

    `config.cp_comm_type` is one value for all layers or a list indexed, as in Megatron-LM 0.13.1's
    `TransformerLayer`, by the 1-based global layer number (entry 0 is never read); None means 'p2p'."""
    if config.context_parallel_size <= 1 or config.cp_comm_type is None:
        return None
    if isinstance(config.cp_comm_type, str):
        return config.cp_comm_type
    if layer_number >= len(config.cp_comm_type):
        raise ValueError(
            f"cp_comm_type has {len(config.cp_comm_type)} entries but layer {layer_number} reads entry "
            f"{layer_number}: a per-layer list is indexed by the 1-based layer number (as in Megatron-LM), so it "
            f"needs num_layers + 1 = {config.num_layers + 1} entries (the first is unused)."
        )
    return config.cp_comm_type[layer_number]


def _is_thd(packed_seq_params) -> bool:
    return packed_seq_params is not None and packed_seq_params.qkv_format == "thd"


def _first_given(*values):
    return next((v for v in values if v is not None), None)


@dataclass
class SelfAttentionSubmodules:
    """Specs of the parts of a self-attention layer."""

    linear_qkv: Union[ModuleSpec, type] = None
    """Fused query/key/value projection (column-parallel)."""

    core_attention: Union[ModuleSpec, type] = None
    """Core attention (softmax(QK^T)V)."""

    linear_proj: Union[ModuleSpec, type] = None
    """Output projection (row-parallel)."""

    q_layernorm: Union[ModuleSpec, type] = None
    """Per-head query norm (None or IdentityOp: none)."""

    k_layernorm: Union[ModuleSpec, type] = None
    """Per-head key norm (None or IdentityOp: none)."""



@dataclass
class CrossAttentionSubmodules:
    """Specs of the parts of a cross-attention layer."""

    linear_q: Union[ModuleSpec, type] = None
    """Query projection (column-parallel)."""

    linear_kv: Union[ModuleSpec, type] = None
    """Fused key/value projection (column-parallel)."""

    core_attention: Union[ModuleSpec, type] = None
    """Core attention (softmax(QK^T)V)."""

    linear_proj: Union[ModuleSpec, type] = None
    """Output projection (row-parallel)."""



class Attention(MegatronModule):
    """Shared part of attention layers: core attention, output projection and the forward pass."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        cp_comm_type: Optional[str] = None,
        model_comm_pgs=None,
    ):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.tp_group = get_model_comm_pgs_tp(model_comm_pgs)
        self.cp_group = getattr(model_comm_pgs, "cp", None) if model_comm_pgs is not None else None
        world_size = get_tp_world_size(self.tp_group)
        self.query_projection_size = config.kv_channels * config.num_attention_heads
        self.kv_projection_size = config.kv_channels * config.num_query_groups
        self.hidden_size_per_attention_head = divide(self.query_projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, world_size)
        if cp_comm_type is None:
            cp_comm_type = layer_cp_comm_type(config, layer_number)
        self.core_attention = build_module(
            submodules.core_attention,
            config=config,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type=attention_type,
            cp_comm_type=cp_comm_type,
            softmax_scale=config.softmax_scale,
            model_comm_pgs=model_comm_pgs,
        )
        self.linear_proj = build_module(
            submodules.linear_proj,
            self.query_projection_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="proj",
            tp_group=self.tp_group,
        )

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None):
        """Queries [sq, b, np, hn], keys and values [sk, b, ng, hn]."""
        raise NotImplementedError(f"{type(self).__name__} must define get_query_key_value_tensors")

    def _rotated_query_key_value(self, hidden_states, key_value_states, rotary_pos_emb, packed_seq_params):
        """Queries, keys and values with the rotary position embeddings (when given) applied."""
        query, key, value = self.get_query_key_value_tensors(hidden_states, key_value_states)
        if _is_thd(packed_seq_params):  # packed rows: batch dimension 1, squeezed as Megatron does
            query, key, value = (t.squeeze(1) for t in (query, key, value))  # [t, 1, n, hn] -> [t, n, hn]
        return (*self._apply_rotary(query, key, rotary_pos_emb, packed_seq_params), value)

    def _apply_rotary(self, query, key, rotary_pos_emb, packed_seq_params):
        if rotary_pos_emb is None:
            return query, key
        q_pos_emb, k_pos_emb = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
        cu_q = cu_kv = None
        if _is_thd(packed_seq_params):  # positions restart at every packed sequence (padded bounds if given)
            cu_q = _first_given(packed_seq_params.cu_seqlens_q_padded, packed_seq_params.cu_seqlens_q)
            cu_kv = _first_given(packed_seq_params.cu_seqlens_kv_padded, packed_seq_params.cu_seqlens_kv)
        query = apply_rotary_pos_emb(query, q_pos_emb, config=self.config, cu_seqlens=cu_q, cp_group=self.cp_group)
        key = apply_rotary_pos_emb(key, k_pos_emb, config=self.config, cu_seqlens=cu_kv, cp_group=self.cp_group)
        return query, key

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        key_value_states: Optional[torch.Tensor] = None,
        inference_context=None,
        rotary_pos_emb: Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None,
        rotary_pos_cos: Optional[torch.Tensor] = None,
        rotary_pos_sin: Optional[torch.Tensor] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
        sequence_len_offset: Optional[int] = None,
        *,
        inference_params=None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """[s, b, h] -> (output [s, b, h], output bias or None)."""
        inference_context = deprecate_inference_params(inference_context, inference_params)
        if inference_context is not None:  # KV cache: the context stores keys/values and attends over them
            query, key, value = self.get_query_key_value_tensors(hidden_states, key_value_states)
            scale = getattr(self.core_attention, "softmax_scale", None)
            core_attn_out = inference_context.attend(self.layer_number, query, key, value, rotary_pos_emb, scale,
                                                     self.config)
            return self.linear_proj(core_attn_out)
        query, key, value = self._rotated_query_key_value(hidden_states, key_value_states, rotary_pos_emb,
                                                          packed_seq_params)
        core_attn_out = self.core_attention(
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=self.attn_mask_type,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
        )
        if _is_thd(packed_seq_params):
            core_attn_out = core_attn_out.reshape(core_attn_out.size(0), 1, -1)  # [t, np*hn] -> [t, 1, np*hn]
        return self.linear_proj(core_attn_out)


class SelfAttention(Attention):
    """Self-attention: queries, keys and values all come from `hidden_states` through one projection."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: SelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        cp_comm_type: Optional[str] = None,
        model_comm_pgs=None,
    ):
        super().__init__(
            config=config,
            submodules=submodules,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type="self",
            cp_comm_type=cp_comm_type,
            model_comm_pgs=model_comm_pgs,
        )
        self.linear_qkv = build_module(
            submodules.linear_qkv,
            config.hidden_size,
            self.query_projection_size + 2 * self.kv_projection_size,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=config.add_bias_linear or config.add_qkv_bias,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="qkv",
            tp_group=self.tp_group,
        )
        self.q_layernorm = self._build_qk_norm(submodules.q_layernorm)
        self.k_layernorm = self._build_qk_norm(submodules.k_layernorm)
        self.heads_per_group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        # the fused split + rotation (`_rotated_query_key_value`) applies only without q/k norms
        norms = (self.q_layernorm, self.k_layernorm)
        self._no_qk_norm = all(norm is None or isinstance(norm, IdentityOp) for norm in norms)

    def _build_qk_norm(self, spec):
        if spec is None:
            return None
        return build_module(
            spec, hidden_size=self.hidden_size_per_attention_head, config=self.config, eps=self.config.layernorm_epsilon
        )

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None):
        """Split the fused projection into per-head queries, keys and values (qk-norm applied per head)."""
        mixed_qkv, _ = self.linear_qkv(hidden_states)
        return self._split_mixed_qkv(mixed_qkv)

    def _rotated_query_key_value(self, hidden_states, key_value_states, rotary_pos_emb, packed_seq_params):
        """With rotary embeddings, no packed sequences and no q/k norm, the split and the rotation are one
        kernel each way on CUDA (`fusions.fused_qkv_rope`), same values; otherwise split, then rotate."""
        freqs = rotary_pos_emb
        if isinstance(freqs, tuple) and freqs[0] is freqs[1]:
            freqs = freqs[0]
        if not torch.is_tensor(freqs) or _is_thd(packed_seq_params) or not self._no_qk_norm:
            return super()._rotated_query_key_value(hidden_states, key_value_states, rotary_pos_emb, packed_seq_params)
        mixed_qkv, _ = self.linear_qkv(hidden_states)
        fused = try_fused_qkv_rope(mixed_qkv, freqs, self.heads_per_group, self.hidden_size_per_attention_head,
                                   self.config)
        if fused is not None:
            return fused
        query, key, value = self._split_mixed_qkv(mixed_qkv)
        return (*self._apply_rotary(query, key, rotary_pos_emb, packed_seq_params), value)

    def _split_mixed_qkv(self, mixed_qkv):
        """Queries [sq, b, np, hn], keys and values [sq, b, ng, hn] from the fused projection's output."""
        heads_per_group = self.heads_per_group
        hn = self.hidden_size_per_attention_head
        group_shape = (self.num_query_groups_per_partition, (heads_per_group + 2) * hn)
        mixed_qkv = mixed_qkv.view(*mixed_qkv.shape[:-1], *group_shape)  # [sq, b, ng*(np/ng+2)*hn] -> [sq, b, ng, (np/ng+2)*hn]
        query, key, value = torch.split(mixed_qkv, [heads_per_group * hn, hn, hn], dim=-1)
        query = query.reshape(query.size(0), query.size(1), -1, hn)  # [sq, b, ng, np/ng*hn] -> [sq, b, np, hn]
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        return query, key, value


class CrossAttention(Attention):
    """Cross-attention (encoder-decoder models): queries from `hidden_states`, keys and values from the
    encoder output `key_value_states` through one fused projection whose rows are, per head, [k | v]."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: CrossAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        cp_comm_type: Optional[str] = None,
        model_comm_pgs=None,
    ):
        super().__init__(
            config=config,
            submodules=submodules,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type="cross",
            cp_comm_type=cp_comm_type,
            model_comm_pgs=model_comm_pgs,
        )
        if config.num_query_groups != config.num_attention_heads:
            raise ValueError(
                f"num_query_groups ({config.num_query_groups}) must equal num_attention_heads "
                f"({config.num_attention_heads}) for cross attention: grouped-query cross attention is not "
                "supported (as in Megatron-LM); drop --group-query-attention for encoder-decoder models."
            )
        common = dict(config=config, init_method=config.init_method, gather_output=False,
                      bias=config.add_bias_linear, skip_bias_add=False, is_expert=False, tp_group=self.tp_group)
        self.linear_q = build_module(submodules.linear_q, config.hidden_size, self.query_projection_size, **common)
        self.linear_kv = build_module(submodules.linear_kv, config.hidden_size, 2 * self.kv_projection_size, **common)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None):
        """Queries [sq, b, np, hn] from `hidden_states`; keys and values [sk, b, np, hn] from `key_value_states`."""
        if key_value_states is None:
            raise ValueError("CrossAttention needs key_value_states (the encoder output passed as `context`).")
        np_, hn = self.num_attention_heads_per_partition, self.hidden_size_per_attention_head
        mixed_kv, _ = self.linear_kv(key_value_states)
        mixed_kv = mixed_kv.view(*mixed_kv.shape[:-1], np_, 2 * hn)  # [sk, b, np*2*hn] -> [sk, b, np, 2*hn]
        key, value = torch.split(mixed_kv, [hn, hn], dim=-1)
        query, _ = self.linear_q(hidden_states)
        query = query.view(*query.shape[:-1], np_, hn)  # [sq, b, np*hn] -> [sq, b, np, hn]
        return query, key, value


__all__ = ["Attention", "SelfAttention", "CrossAttention", "SelfAttentionSubmodules", "CrossAttentionSubmodules",
           "layer_cp_comm_type"]
