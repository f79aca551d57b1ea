"""Multi-latent attention (DeepSeek-V2/V3), with Megatron Core's module names and checkpoint keys.

Per layer (n heads, q_head_dim = qk_head_dim + qk_pos_emb_head_dim = d_nope + d_r):
- queries: `linear_q_proj` (H -> n*q_head_dim) or, with `q_lora_rank`, `linear_q_down_proj` (H -> q_lora_rank),
  `q_layernorm`, `linear_q_up_proj` (q_lora_rank -> n*q_head_dim); rows per head [q_nope | q_pe];
- keys/values: `linear_kv_down_proj` (H -> kv_lora_rank + d_r) whose rows are [kv_latent | k_pe], `kv_layernorm`
  on the latent, `linear_kv_up_proj` (kv_lora_rank -> n*(d_nope + v_head_dim)) with rows per head [k_nope | v];
- the decoupled RoPE part: q_pe per head and k_pe as ONE head shared by all heads, both rotated after
  de-interleaving (`cat(t[..., 0::2], t[..., 1::2])`, the rotated result stays in that layout);
- query = [q_nope | rope(q_pe)], key = [k_nope | rope(k_pe)], softmax scale m^2 / sqrt(q_head_dim) with
  m = yarn_get_mscale(rotary_scaling_factor, mscale); `linear_proj` (n*v_head_dim -> H).

Inference: with a static or dynamic inference context, this layer rotates q_pe / k_pe itself at the positions of
the forward's tokens (`inference_context.token_positions`: the cache offset onwards, YaRN mscale included) and
hands the per-head query, key (q_head_dim) and value (v_head_dim) to `inference_context.attend` with MLA's
softmax scale; the contexts cache the decompressed per-head keys and values (as Megatron does).
A context built with `cache_mla_latents=True` caches DeepSeek's compressed form instead: ONE key head
[normed kv latent | rope(k_pe)] (kv_lora_rank + d_r) whose leading kv_lora_rank channels (the latent) are
also the value (the contexts keep them once), the same on every TP rank. The layer then attends with
absorbed projections: q_nope is mapped into latent space through the k_nope rows of `linear_kv_up_proj`
(q_nope . W_uk c = q_nope . k_nope), and the attention output (a latent per head) is mapped to values
through its v rows. Per token and layer that caches kv_lora_rank + d_r numbers instead of
n * (q_head_dim + v_head_dim) (DeepSeek-V3: 576 instead of 40960).

Tensor parallelism: heads are split over TP. The down projections are column-parallel too; their outputs are
all-gathered over TP (and, under sequence parallelism, the latents are scattered back to sequence shards). The
k_pe slice is then one replicated tensor that every TP rank uses for its own heads, so its gradient is summed
over TP (forward identity, backward all-reduce) before the gather's backward keeps this rank's slice.
"""
import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding, _yarn_get_mscale
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.attention import Attention, layer_cp_comm_type
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.core.transformer.utils import get_model_comm_pgs_tp, get_tp_world_size
from megatron.core.utils import divide


@dataclass
class MLASelfAttentionSubmodules:
    """Specs of the parts of an MLA self-attention layer."""

    linear_q_proj: Union[ModuleSpec, type] = None
    """Full-rank query projection (used when q_lora_rank is None)."""

    linear_q_down_proj: Union[ModuleSpec, type] = None
    """Query down projection H -> q_lora_rank."""

    linear_q_up_proj: Union[ModuleSpec, type] = None
    """Query up projection q_lora_rank -> n*q_head_dim (TE spec: carries the q norm as layer_norm_weight)."""

    linear_kv_down_proj: Union[ModuleSpec, type] = None
    """Key/value down projection H -> kv_lora_rank + qk_pos_emb_head_dim."""

    linear_kv_up_proj: Union[ModuleSpec, type] = None
    """Key/value up projection kv_lora_rank -> n*(qk_head_dim + v_head_dim) (TE spec: carries the kv norm)."""

    core_attention: Union[ModuleSpec, type] = None
    """Core attention (softmax(QK^T)V)."""

    linear_proj: Union[ModuleSpec, type] = None
    """Output projection (row-parallel)."""

    q_layernorm: Union[ModuleSpec, type] = None
    """Norm of the query latent (IdentityOp: none, or fused into linear_q_up_proj)."""

    kv_layernorm: Union[ModuleSpec, type] = None
    """Norm of the key/value latent (IdentityOp: none, or fused into linear_kv_up_proj)."""


def apply_mla_rotary(t: torch.Tensor, freqs: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
    """Megatron's MLA RoPE on t [s, b, n, d_r] with angles freqs [s, 1, 1, d_r]: de-interleave, then rotate-half."""
    freqs = freqs.to(t.device)
    t = torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)  # [s, b, n, d_r] pairs (2i, 2i+1) -> halves
    cos_ = (torch.cos(freqs) * mscale).to(t.dtype)
    sin_ = (torch.sin(freqs) * mscale).to(t.dtype)
    first, second = torch.chunk(t, 2, dim=-1)
    return t * cos_ + torch.cat((-second, first), dim=-1) * sin_


class MultiLatentAttention(Attention):
    """Shared part of MLA layers: rotary embedding, core attention, output projection, forward."""

    def __init__(
        self,
        config: MLATransformerConfig,
        submodules: MLASelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        cp_comm_type: Optional[str] = None,
        model_comm_pgs=None,
    ):
        MegatronModule.__init__(self, config=config)
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.tp_group = get_model_comm_pgs_tp(model_comm_pgs)
        self.cp_group = getattr(model_comm_pgs, "cp", None) if model_comm_pgs is not None else None
        world_size = get_tp_world_size(self.tp_group)
        self.q_head_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        self.query_projection_size = config.v_head_dim * config.num_attention_heads
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world_size)
        self.softmax_scale = _yarn_get_mscale(config.rotary_scaling_factor, config.mscale) ** 2 / math.sqrt(
            self.q_head_dim)
        self.rotary_pos_emb = self._build_rotary(config)
        if cp_comm_type is None:
            cp_comm_type = layer_cp_comm_type(config, layer_number)
        self.core_attention = build_module(
            submodules.core_attention, config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
            attention_type=attention_type, cp_comm_type=cp_comm_type, softmax_scale=self.softmax_scale,
            model_comm_pgs=model_comm_pgs, k_channels=self.q_head_dim, v_channels=config.v_head_dim,
        )
        self.linear_proj = build_module(
            submodules.linear_proj, self.query_projection_size, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear, input_is_parallel=True,
            skip_bias_add=True, is_expert=False, tp_comm_buffer_name="proj", tp_group=self.tp_group,
        )

    def _build_rotary(self, config):
        cp_group = self.cp_group
        if config.rope_type == "rope":
            return RotaryEmbedding(config.qk_pos_emb_head_dim, rotary_percent=config.rotary_percent,
                                   rotary_base=config.rotary_base, use_cpu_initialization=config.use_cpu_initialization,
                                   cp_group=cp_group)
        return YarnRotaryEmbedding(
            config.qk_pos_emb_head_dim, rotary_base=config.rotary_base, scaling_factor=config.rotary_scaling_factor,
            original_max_position_embeddings=config.max_position_embeddings, beta_fast=config.beta_fast,
            beta_slow=config.beta_slow, mscale=config.mscale, mscale_all_dim=config.mscale_all_dim,
            use_cpu_initialization=config.use_cpu_initialization, cp_group=cp_group,
        )

    def _rotary_angles(self, hidden_states, inference_context, packed_seq_params):
        """(angles [S, 1, 1, d_r], magnitude scale) for this layer's sequence (positions 0..S-1)."""
        seq_len = self.rotary_pos_emb.get_rotary_seq_len(inference_context, None, hidden_states, self.config,
                                                         packed_seq_params)
        packed = packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd"
        if packed:
            raise ValueError("multi-latent attention does not support packed (thd) sequences here.")
        if self.config.rope_type == "rope":
            return self.rotary_pos_emb(seq_len), 1.0
        return self.rotary_pos_emb(seq_len)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        key_value_states: Optional[torch.Tensor] = None,
        inference_context=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        attention_bias=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
    ):
        """[s, b, h] (or [s/tp, b, h] under SP) -> (output, output bias or None); the model's rotary_pos_emb is
        ignored (MLA owns its rotary embedding)."""
        inference_context = inference_context if inference_context is not None else inference_params
        angles, mscale = self._rotary_angles(hidden_states, inference_context, packed_seq_params)
        if inference_context is not None:
            return self._forward_with_cache(hidden_states, inference_context, angles, mscale)
        query, key, value = self.get_query_key_value_tensors(hidden_states, angles, mscale)
        core_attn_out = self.core_attention(query, key, value, attention_mask, attn_mask_type=self.attn_mask_type,
                                            attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        return self.linear_proj(core_attn_out)

    def _forward_with_cache(self, hidden_states, inference_context, angles, mscale):
        """[s, b, h] of new tokens -> (output, bias): keys/values cached by the context, attention over the cache.

        `angles` covers positions 0..max_sequence_length-1; the new tokens take the rows of their positions."""
        if self.config.sequence_parallel:
            raise ValueError("multi-latent attention with an inference context does not support "
                             "--sequence-parallel: drop the flag when serving")
        positions = inference_context.token_positions(hidden_states.shape[0], hidden_states.device)
        step_angles = angles.index_select(0, positions.to(angles.device))  # [s, 1, 1, d_r]
        if getattr(inference_context, "cache_mla_latents", False):
            query, key, latent = self.latent_query_key_value(hidden_states, step_angles, mscale)
            latent_out = inference_context.attend(self.layer_number, query, key, latent, None, self.softmax_scale,
                                                  self.config)  # [s, b, n/tp * kv_lora_rank]
            return self.linear_proj(self.values_from_latent(latent_out))
        query, key, value = self.get_query_key_value_tensors(hidden_states, step_angles, mscale)
        core_attn_out = inference_context.attend(self.layer_number, query, key, value, None, self.softmax_scale,
                                                 self.config)
        return self.linear_proj(core_attn_out)


class MLASelfAttention(MultiLatentAttention):
    """MLA self-attention: q (optionally low-rank) and kv low-rank projections with a decoupled RoPE part."""

    def __init__(
        self,
        config: MLATransformerConfig,
        submodules: MLASelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        cp_comm_type: Optional[str] = None,
        model_comm_pgs=None,
    ):
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         attn_mask_type=attn_mask_type, attention_type="self", cp_comm_type=cp_comm_type,
                         model_comm_pgs=model_comm_pgs)
        n = config.num_attention_heads
        column = dict(config=config, init_method=config.init_method, gather_output=False, bias=False,
                      skip_bias_add=False, is_expert=False, tp_group=self.tp_group)
        if config.q_lora_rank is None:
            self.linear_q_proj = build_module(submodules.linear_q_proj, config.hidden_size, n * self.q_head_dim,
                                              tp_comm_buffer_name="q_proj", **column)
        else:
            self.linear_q_down_proj = build_module(submodules.linear_q_down_proj, config.hidden_size,
                                                   config.q_lora_rank, tp_comm_buffer_name="q_down_proj", **column)
            self.linear_q_up_proj = build_module(submodules.linear_q_up_proj, config.q_lora_rank, n * self.q_head_dim,
                                                 tp_comm_buffer_name="q_up_proj", **column)
        self.linear_kv_down_proj = build_module(
            submodules.linear_kv_down_proj, config.hidden_size, config.kv_lora_rank + config.qk_pos_emb_head_dim,
            tp_comm_buffer_name="kv_down_proj", **column)
        self.linear_kv_up_proj = build_module(
            submodules.linear_kv_up_proj, config.kv_lora_rank, n * (config.qk_head_dim + config.v_head_dim),
            tp_comm_buffer_name="kv_up_proj", **column)
        if config.q_lora_rank is not None:
            self.q_layernorm = build_module(submodules.q_layernorm, hidden_size=config.q_lora_rank, config=config,
                                            eps=config.layernorm_epsilon)
        self.kv_layernorm = build_module(submodules.kv_layernorm, hidden_size=config.kv_lora_rank, config=config,
                                         eps=config.layernorm_epsilon)

    def _gathered_latent(self, projection, hidden_states):
        """Down projection output gathered over TP: [s, b, out] (s the full sequence under SP)."""
        latent, _ = projection(hidden_states)
        if latent.size(-1) != projection.output_size:
            latent = gather_from_tensor_model_parallel_region(latent, group=self.tp_group)
        return latent

    def _query_input(self, hidden_states):
        """The q LoRA latent [s, b, q_lora_rank] (normed by the up projection), or the full-rank queries."""
        if self.config.q_lora_rank is None:
            q, _ = self.linear_q_proj(hidden_states)
            return q
        q_compressed = self._gathered_latent(self.linear_q_down_proj, hidden_states)
        if self.config.sequence_parallel:
            q_compressed = scatter_to_sequence_parallel_region(q_compressed, group=self.tp_group)
        return q_compressed

    def get_query_key_value_tensors(self, hidden_states, angles=None, mscale=1.0):
        """query, key [s, b, n/tp, q_head_dim] (RoPE applied to the decoupled part), value [s, b, n/tp, v]."""
        cfg = self.config
        q_input = self._query_input(hidden_states)
        kv_combined = self._gathered_latent(self.linear_kv_down_proj, hidden_states)
        kv_compressed, k_pos_emb = torch.split(kv_combined, [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
        # every TP rank uses the one k_pe head for its own heads: sum its gradient over TP
        k_pos_emb = copy_to_tensor_model_parallel_region(k_pos_emb, group=self.tp_group)
        if cfg.sequence_parallel:
            kv_compressed = scatter_to_sequence_parallel_region(kv_compressed, group=self.tp_group)
        return self.up_projection(q_input, kv_compressed, k_pos_emb, angles, mscale)

    def up_projection(self, q_input, kv_compressed, k_pos_emb, angles=None, mscale=1.0):
        """Latents -> per-head query, key, value with RoPE (what selective recompute `mla_up_proj` re-runs)."""
        cfg = self.config
        heads = self.num_attention_heads_per_partition
        if cfg.q_lora_rank is None:
            q = q_input
        else:
            q, _ = self.linear_q_up_proj(self.q_layernorm(q_input))
        query = q.view(*q.shape[:-1], heads, self.q_head_dim)  # [s, b, n*qhd] -> [s, b, n, qhd]
        kv, _ = self.linear_kv_up_proj(self.kv_layernorm(kv_compressed))
        kv = kv.view(*kv.shape[:-1], heads, cfg.qk_head_dim + cfg.v_head_dim)  # [s, b, n*(qk+v)] -> [s, b, n, qk+v]
        k_no_pe, value = torch.split(kv, [cfg.qk_head_dim, cfg.v_head_dim], dim=-1)
        q_no_pe, q_pos_emb = torch.split(query, [cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)
        k_pos_emb = k_pos_emb.unsqueeze(2)  # [s, b, d_r] -> [s, b, 1, d_r]
        if angles is not None:
            q_pos_emb = apply_mla_rotary(q_pos_emb, angles, mscale)
            k_pos_emb = apply_mla_rotary(k_pos_emb, angles, mscale)
        query = torch.cat([q_no_pe, q_pos_emb], dim=-1)
        key = torch.cat([k_no_pe, k_pos_emb.expand(-1, -1, heads, -1)], dim=-1)
        return query.contiguous(), key.contiguous(), value.contiguous()

    def _absorbed_weights(self):
        """(W_uk [n/tp, qk_head_dim, kv_lora_rank], W_uv [n/tp, v_head_dim, kv_lora_rank]) of linear_kv_up_proj."""
        cfg = self.config
        if hasattr(self.linear_kv_up_proj, "layer_norm_weight"):
            raise ValueError("cache_mla_latents needs the kv latent norm as its own module (the local MLA spec); "
                             "this layer fuses it into linear_kv_up_proj: build the context with "
                             "cache_mla_latents=False")
        weight = self.linear_kv_up_proj.weight
        weight = weight.view(self.num_attention_heads_per_partition, cfg.qk_head_dim + cfg.v_head_dim,
                             cfg.kv_lora_rank)  # [n*(qk+v), c] -> [n, qk+v, c]
        return weight[:, :cfg.qk_head_dim], weight[:, cfg.qk_head_dim:]

    def latent_query_key_value(self, hidden_states, angles, mscale=1.0):
        """The absorbed form for a latent cache: query [s, b, n/tp, c + d_r] (q_nope mapped to latent space |
        rope(q_pe)), key [s, b, 1, c + d_r] (normed latent | rope(k_pe)), value [s, b, 1, c]: the latent, a view
        of the key's leading channels."""
        cfg = self.config
        heads = self.num_attention_heads_per_partition
        q_input = self._query_input(hidden_states)
        q = q_input if cfg.q_lora_rank is None else self.linear_q_up_proj(self.q_layernorm(q_input))[0]
        query = q.view(*q.shape[:-1], heads, self.q_head_dim)  # [s, b, n*qhd] -> [s, b, n, qhd]
        q_no_pe, q_pos_emb = torch.split(query, [cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)
        kv_combined = self._gathered_latent(self.linear_kv_down_proj, hidden_states)
        kv_compressed, k_pos_emb = torch.split(kv_combined, [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
        latent = self.kv_layernorm(kv_compressed).unsqueeze(2)  # [s, b, c] -> [s, b, 1, c]
        k_pos_emb = apply_mla_rotary(k_pos_emb.unsqueeze(2), angles, mscale)  # [s, b, d_r] -> [s, b, 1, d_r]
        w_uk, _ = self._absorbed_weights()
        q_latent = torch.einsum("sbnq,nqc->sbnc", q_no_pe, w_uk.to(q_no_pe.dtype))
        query = torch.cat([q_latent, apply_mla_rotary(q_pos_emb, angles, mscale)], dim=-1)
        key = torch.cat([latent, k_pos_emb.to(latent.dtype)], dim=-1)
        return query.contiguous(), key, key[..., :cfg.kv_lora_rank]

    def values_from_latent(self, latent_out):
        """Attention output in latent space [s, b, n/tp * c] -> per-head values [s, b, n/tp * v_head_dim]."""
        s, b = latent_out.shape[:2]
        heads = self.num_attention_heads_per_partition
        _, w_uv = self._absorbed_weights()
        latent_out = latent_out.reshape(s, b, heads, self.config.kv_lora_rank)  # [s, b, n*c] -> [s, b, n, c]
        values = torch.einsum("sbnc,nvc->sbnv", latent_out, w_uv.to(latent_out.dtype))
        return values.reshape(s, b, -1)  # [s, b, n, v] -> [s, b, n*v]


__all__ = ["MLASelfAttentionSubmodules", "MultiLatentAttention", "MLASelfAttention", "apply_mla_rotary"]
