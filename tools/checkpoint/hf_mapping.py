"""Parameter mapping between a full (TP=1, PP=1) Megatron GPT state dict (local-spec names) and a
HuggingFace Llama-family, GPT-2, Mixtral or Qwen3-MoE state dict (MoE layers: `hf_mapping_moe`).

Megatron layouts (spec §12.15): `linear_qkv` rows are grouped per query group as
`[q_1 .. q_{np/ng}, k, v] * hn`; SwiGLU `linear_fc1` is `[gate; up]`. HF GPT-2 uses Conv1D, whose
weights are stored transposed (`[in, out]`), and its `c_attn` output is `[Q; K; V]`.
"""
from typing import Dict, Optional

import torch

from tools.checkpoint.hf_mapping_moe import is_moe_layer, moe_extra_state_keys, moe_layer_from_hf, moe_layer_to_hf
from tools.checkpoint.model_description import ModelDescription, hf_architecture

StateDict = Dict[str, torch.Tensor]
_LINEARS_WITH_EXTRA_STATE = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                             "mlp.linear_fc2")


def split_qkv(qkv: torch.Tensor, desc: ModelDescription):
    """Grouped Megatron QKV (weight [ng*(np/ng+2)*hn, h] or bias) -> (q, k, v) in head order."""
    ng, hn = desc.num_query_groups, desc.kv_channels
    per_group = desc.num_attention_heads // ng
    rest = qkv.shape[1:]
    # [ng*(np/ng+2)*hn, ...] -> [ng, np/ng+2, hn, ...]
    grouped = qkv.reshape(ng, per_group + 2, hn, *rest)
    # [ng, np/ng, hn, ...] -> [np*hn, ...]
    q = grouped[:, :per_group].reshape(ng * per_group * hn, *rest)
    # [ng, hn, ...] -> [ng*hn, ...]
    k = grouped[:, per_group].reshape(ng * hn, *rest)
    v = grouped[:, per_group + 1].reshape(ng * hn, *rest)
    return q, k, v


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, desc: ModelDescription) -> torch.Tensor:
    """(q, k, v) in head order -> grouped Megatron QKV."""
    ng, hn = desc.num_query_groups, desc.kv_channels
    per_group = desc.num_attention_heads // ng
    rest = q.shape[1:]
    # [np*hn, ...] -> [ng, np/ng, hn, ...]
    q = q.reshape(ng, per_group, hn, *rest)
    # [ng*hn, ...] -> [ng, 1, hn, ...]
    k = k.reshape(ng, 1, hn, *rest)
    v = v.reshape(ng, 1, hn, *rest)
    # [ng, np/ng+2, hn, ...] -> [ng*(np/ng+2)*hn, ...]
    return torch.cat([q, k, v], dim=1).reshape(ng * (per_group + 2) * hn, *rest)


def _vocab_rows(t: torch.Tensor, desc: ModelDescription) -> torch.Tensor:
    vocab = desc.true_vocab_size or desc.vocab_size
    return t[:vocab].clone()


def _pad_vocab(t: torch.Tensor, desc: ModelDescription) -> torch.Tensor:
    if t.shape[0] >= desc.vocab_size:
        return t[: desc.vocab_size].clone()
    # [V, h] -> [V_padded, h]: new rows are zero (never produced by the tokenizer)
    return torch.cat([t, t.new_zeros(desc.vocab_size - t.shape[0], *t.shape[1:])])


def _llama_layer_to_hf(sd: StateDict, i: int, desc: ModelDescription, out: StateDict) -> None:
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    out[h + "input_layernorm.weight"] = sd[m + "input_layernorm.weight"]
    q, k, v = split_qkv(sd[m + "self_attention.linear_qkv.weight"], desc)
    out[h + "self_attn.q_proj.weight"], out[h + "self_attn.k_proj.weight"], out[h + "self_attn.v_proj.weight"] = q, k, v
    if desc.qkv_has_bias:
        qb, kb, vb = split_qkv(sd[m + "self_attention.linear_qkv.bias"], desc)
        out[h + "self_attn.q_proj.bias"], out[h + "self_attn.k_proj.bias"], out[h + "self_attn.v_proj.bias"] = qb, kb, vb
    out[h + "self_attn.o_proj.weight"] = sd[m + "self_attention.linear_proj.weight"]
    if desc.qk_layernorm:
        out[h + "self_attn.q_norm.weight"] = sd[m + "self_attention.q_layernorm.weight"]
        out[h + "self_attn.k_norm.weight"] = sd[m + "self_attention.k_layernorm.weight"]
    out[h + "post_attention_layernorm.weight"] = sd[m + "pre_mlp_layernorm.weight"]
    if is_moe_layer(desc, i):
        moe_layer_to_hf(sd, i, desc, out)
        return
    gate, up = torch.chunk(sd[m + "mlp.linear_fc1.weight"], 2, dim=0)
    out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
    out[h + "mlp.down_proj.weight"] = sd[m + "mlp.linear_fc2.weight"]
    if desc.add_bias_linear:
        out[h + "self_attn.o_proj.bias"] = sd[m + "self_attention.linear_proj.bias"]
        gate_b, up_b = torch.chunk(sd[m + "mlp.linear_fc1.bias"], 2, dim=0)
        out[h + "mlp.gate_proj.bias"], out[h + "mlp.up_proj.bias"] = gate_b, up_b
        out[h + "mlp.down_proj.bias"] = sd[m + "mlp.linear_fc2.bias"]


def _llama_layer_from_hf(hf: StateDict, i: int, desc: ModelDescription, out: StateDict) -> None:
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
    out[m + "self_attention.linear_qkv.weight"] = merge_qkv(
        hf[h + "self_attn.q_proj.weight"], hf[h + "self_attn.k_proj.weight"], hf[h + "self_attn.v_proj.weight"], desc)
    if desc.qkv_has_bias:
        out[m + "self_attention.linear_qkv.bias"] = merge_qkv(
            hf[h + "self_attn.q_proj.bias"], hf[h + "self_attn.k_proj.bias"], hf[h + "self_attn.v_proj.bias"], desc)
    out[m + "self_attention.linear_proj.weight"] = hf[h + "self_attn.o_proj.weight"]
    if desc.qk_layernorm:
        out[m + "self_attention.q_layernorm.weight"] = hf[h + "self_attn.q_norm.weight"]
        out[m + "self_attention.k_layernorm.weight"] = hf[h + "self_attn.k_norm.weight"]
    out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
    if is_moe_layer(desc, i):
        moe_layer_from_hf(hf, i, desc, out)
        return
    out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]])
    out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
    if desc.add_bias_linear:
        out[m + "self_attention.linear_proj.bias"] = hf[h + "self_attn.o_proj.bias"]
        out[m + "mlp.linear_fc1.bias"] = torch.cat([hf[h + "mlp.gate_proj.bias"], hf[h + "mlp.up_proj.bias"]])
        out[m + "mlp.linear_fc2.bias"] = hf[h + "mlp.down_proj.bias"]


def _gpt2_qkv_to_hf(qkv: torch.Tensor, desc: ModelDescription) -> torch.Tensor:
    q, k, v = split_qkv(qkv, desc)
    return torch.cat([q, k, v])


def _gpt2_qkv_from_hf(qkv: torch.Tensor, desc: ModelDescription) -> torch.Tensor:
    q, k, v = torch.chunk(qkv, 3, dim=0)
    return merge_qkv(q, k, v, desc)


_GPT2_NORMS = (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2"))
# (Megatron linear, HF Conv1D) pairs: HF weight = Megatron weight transposed.
_GPT2_LINEARS = (("self_attention.linear_proj", "attn.c_proj"), ("mlp.linear_fc1", "mlp.c_fc"),
                 ("mlp.linear_fc2", "mlp.c_proj"))


def _gpt2_layer_to_hf(sd: StateDict, i: int, desc: ModelDescription, out: StateDict) -> None:
    m, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
    for ours, theirs in _GPT2_NORMS:
        out[h + theirs + ".weight"] = sd[m + ours + ".weight"]
        out[h + theirs + ".bias"] = sd[m + ours + ".bias"]
    # [3h, h] -> [h, 3h] (Conv1D stores [in, out])
    out[h + "attn.c_attn.weight"] = _gpt2_qkv_to_hf(sd[m + "self_attention.linear_qkv.weight"], desc).t().contiguous()
    out[h + "attn.c_attn.bias"] = _gpt2_qkv_to_hf(sd[m + "self_attention.linear_qkv.bias"], desc)
    for ours, theirs in _GPT2_LINEARS:
        # [out, in] -> [in, out]
        out[h + theirs + ".weight"] = sd[m + ours + ".weight"].t().contiguous()
        out[h + theirs + ".bias"] = sd[m + ours + ".bias"]


def _gpt2_layer_from_hf(hf: StateDict, i: int, desc: ModelDescription, out: StateDict) -> None:
    m, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
    for ours, theirs in _GPT2_NORMS:
        out[m + ours + ".weight"] = hf[h + theirs + ".weight"]
        out[m + ours + ".bias"] = hf[h + theirs + ".bias"]
    # [h, 3h] -> [3h, h]
    out[m + "self_attention.linear_qkv.weight"] = _gpt2_qkv_from_hf(hf[h + "attn.c_attn.weight"].t(), desc)
    out[m + "self_attention.linear_qkv.bias"] = _gpt2_qkv_from_hf(hf[h + "attn.c_attn.bias"], desc)
    for ours, theirs in _GPT2_LINEARS:
        # [in, out] -> [out, in]
        out[m + ours + ".weight"] = hf[h + theirs + ".weight"].t().contiguous()
        out[m + ours + ".bias"] = hf[h + theirs + ".bias"]


def megatron_to_hf(sd: StateDict, desc: ModelDescription) -> StateDict:
    """HF state dict of a full Megatron state dict."""
    gpt2 = hf_architecture(desc) == "GPT2LMHeadModel"
    out: StateDict = {}
    base = "transformer." if gpt2 else "model."
    out[base + ("wte.weight" if gpt2 else "embed_tokens.weight")] = _vocab_rows(sd["embedding.word_embeddings.weight"], desc)
    if gpt2:
        out["transformer.wpe.weight"] = sd["embedding.position_embeddings.weight"]
    for i in range(desc.num_layers):
        (_gpt2_layer_to_hf if gpt2 else _llama_layer_to_hf)(sd, i, desc, out)
    final = "transformer.ln_f." if gpt2 else "model.norm."
    out[final + "weight"] = sd["decoder.final_layernorm.weight"]
    if gpt2:
        out[final + "bias"] = sd["decoder.final_layernorm.bias"]
    if not desc.tie_embeddings:
        out["lm_head.weight"] = _vocab_rows(sd["output_layer.weight"], desc)
    return {k: v.contiguous() for k, v in out.items()}


def hf_to_megatron(hf: StateDict, desc: ModelDescription, with_extra_state: bool = True) -> Dict[str, Optional[torch.Tensor]]:
    """Full Megatron state dict (local-spec names, `_extra_state` entries as Megatron's linears emit)."""
    gpt2 = desc.position_embedding_type == "learned_absolute"
    out: Dict[str, Optional[torch.Tensor]] = {}
    emb = hf["transformer.wte.weight" if gpt2 else "model.embed_tokens.weight"]
    out["embedding.word_embeddings.weight"] = _pad_vocab(emb, desc)
    if gpt2:
        out["embedding.position_embeddings.weight"] = hf["transformer.wpe.weight"]
    for i in range(desc.num_layers):
        (_gpt2_layer_from_hf if gpt2 else _llama_layer_from_hf)(hf, i, desc, out)
        if with_extra_state:
            moe = is_moe_layer(desc, i)
            for name in _LINEARS_WITH_EXTRA_STATE[:2] if moe else _LINEARS_WITH_EXTRA_STATE:
                out[f"decoder.layers.{i}.{name}._extra_state"] = None
            for key in moe_extra_state_keys(desc, i) if moe else []:
                out[key] = None
    final = "transformer.ln_f." if gpt2 else "model.norm."
    out["decoder.final_layernorm.weight"] = hf[final + "weight"]
    if gpt2:
        out["decoder.final_layernorm.bias"] = hf[final + "bias"]
    if not desc.tie_embeddings:
        out["output_layer.weight"] = _pad_vocab(hf["lm_head.weight"], desc)
    if with_extra_state:
        out["output_layer._extra_state"] = None
    return {k: (v.clone().contiguous() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}
