"""HuggingFace DeepseekV3 (`transformers`' DeepseekV3ForCausalLM) <-> Megatron GPT with MLA + MoE (local spec
names; the legacy layout at any TP and PP, experts at EP=1).

Config facts (transformers' modeling_deepseek_v3 / modeling_rope_utils vs Megatron):
- HF's softmax scale is q_head_dim^-0.5 * m(factor, mscale_all_dim)^2 and its cos/sin carry
  m(factor, mscale) / m(factor, mscale_all_dim); Megatron's softmax uses m(factor, config.mscale)^2 and its cos/sin
  m(mscale) / m(mscale_all_dim). Both agree when HF's mscale == mscale_all_dim (DeepSeek-V3: 1.0 / 1.0), mapped to
  Megatron mscale = mscale_all_dim = that value; other combinations are refused.
- YaRN: HF `original_max_position_embeddings` is Megatron's `max_position_embeddings` (L_orig); `truncate` must
  be true (Megatron floors/ceils the correction range).
- Routing (noaux_tc): sigmoid scores plus `e_score_correction_bias` (Megatron's `expert_bias`) choose experts,
  groups are scored by their top-2 -> Megatron's `topk // group_topk` must be 2; `norm_topk_prob` must be true
  (Megatron normalises sigmoid top-k probabilities), then `routed_scaling_factor` = `moe_router_topk_scaling_factor`.
- First `first_k_dense_replace` layers dense (`moe_layer_freq` list), `n_shared_experts * moe_intermediate_size`
  the shared expert width. The rotary part is interleaved in HF's weights and de-interleaved by both sides' RoPE.
- MTP weights (`num_nextn_predict_layers`) are not part of transformers' model and are not converted.
"""
import os
from types import SimpleNamespace
from typing import Any, Dict, Optional

import torch

StateDict = Dict[str, torch.Tensor]


def _mscale(hf: Dict[str, Any]):
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "yarn":
        return rope, None
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if not mscale or not all_dim or mscale != all_dim or rope.get("attention_factor") is not None:
        raise ValueError(f"DeepseekV3 rope parameters mscale ({mscale}) / mscale_all_dim ({all_dim}) / "
                         f"attention_factor ({rope.get('attention_factor')}): only equal non-zero mscale and "
                         "mscale_all_dim without attention_factor map onto Megatron's YaRN (as DeepSeek-V3 ships).")
    if not rope.get("truncate", True):
        raise ValueError("DeepseekV3 rope parameters truncate=False: Megatron's YaRN floors/ceils the correction range.")
    return rope, float(mscale)


def megatron_config_from_hf(hf: Dict[str, Any]) -> Dict[str, Any]:
    """MLATransformerConfig keyword arguments of an HF DeepseekV3 config.json dict."""
    problems = []
    if not hf.get("norm_topk_prob", True):
        problems.append("norm_topk_prob=False (Megatron normalises the sigmoid top-k probabilities)")
    topk, n_group, topk_group = hf["num_experts_per_tok"], hf.get("n_group", 1), hf.get("topk_group", 1)
    if n_group > 1 and topk // topk_group != 2:
        problems.append(f"num_experts_per_tok // topk_group = {topk} // {topk_group} != 2 (HF scores groups by their "
                        "top-2 experts, Megatron by topk // group_topk)")
    if hf.get("attention_bias"):
        problems.append("attention_bias=True (Megatron's MLA has no biases)")
    if problems:
        raise ValueError("DeepseekV3 config not representable: " + "; ".join(problems))
    rope, mscale = _mscale(hf)
    layers, first_dense = hf["num_hidden_layers"], hf.get("first_k_dense_replace", 0)
    config = dict(
        num_layers=layers, hidden_size=hf["hidden_size"], ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=hf["num_attention_heads"], q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"], qk_head_dim=hf["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"], normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6), gated_linear_unit=True, add_bias_linear=False,
        qk_layernorm=True, rotary_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        num_moe_experts=hf["n_routed_experts"], moe_router_topk=topk, moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=hf["moe_intermediate_size"] * hf.get("n_shared_experts", 1),
        moe_router_num_groups=n_group if n_group > 1 else None,
        moe_router_group_topk=topk_group if n_group > 1 else None,
        moe_router_topk_scaling_factor=hf.get("routed_scaling_factor", 1.0), moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_dtype="fp32", moe_router_load_balancing_type="seq_aux_loss",
        moe_layer_freq=[0] * first_dense + [1] * (layers - first_dense),
    )
    if mscale is None:
        config.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=1.0)
    else:
        config.update(rope_type="yarn", rotary_scaling_factor=float(rope["factor"]), mscale=mscale,
                      mscale_all_dim=mscale, max_position_embeddings=rope["original_max_position_embeddings"],
                      beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1))
    return config


def hf_config_from_megatron(config, vocab_size: int, tied: bool = False,
                            max_position_embeddings: int = 4096) -> Dict[str, Any]:
    """HF DeepseekV3 config.json dict of an MLATransformerConfig with MoE (the inverse of the above)."""
    if config.rope_type == "yarn" and config.mscale != config.mscale_all_dim:
        raise ValueError(f"mscale ({config.mscale}) != mscale_all_dim ({config.mscale_all_dim}): HF DeepseekV3 "
                         "cannot express Megatron's YaRN scales then.")
    pattern = config.moe_layer_freq if isinstance(config.moe_layer_freq, list) else [
        1 if i % config.moe_layer_freq == 0 else 0 for i in range(config.num_layers)]
    first_dense = pattern.index(1) if 1 in pattern else config.num_layers
    if pattern != [0] * first_dense + [1] * (config.num_layers - first_dense):
        raise ValueError(f"moe_layer_freq {pattern}: HF DeepseekV3 has dense layers only before the first MoE layer.")
    shared = config.moe_shared_expert_intermediate_size or 0
    if shared % config.moe_ffn_hidden_size:
        raise ValueError("moe_shared_expert_intermediate_size must be a multiple of moe_ffn_hidden_size for HF.")
    rope = {"rope_type": "default", "rope_theta": config.rotary_base}
    if config.rope_type == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": config.rotary_base, "factor": config.rotary_scaling_factor,
                "original_max_position_embeddings": config.max_position_embeddings, "beta_fast": config.beta_fast,
                "beta_slow": config.beta_slow, "mscale": config.mscale, "mscale_all_dim": config.mscale_all_dim}
    return dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=vocab_size,
        hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
        moe_intermediate_size=config.moe_ffn_hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_attention_heads,
        n_shared_experts=shared // config.moe_ffn_hidden_size, n_routed_experts=config.num_moe_experts,
        routed_scaling_factor=config.moe_router_topk_scaling_factor or 1.0, kv_lora_rank=config.kv_lora_rank,
        q_lora_rank=config.q_lora_rank, qk_rope_head_dim=config.qk_pos_emb_head_dim, v_head_dim=config.v_head_dim,
        qk_nope_head_dim=config.qk_head_dim, n_group=config.moe_router_num_groups or 1,
        topk_group=config.moe_router_group_topk or 1, num_experts_per_tok=config.moe_router_topk,
        first_k_dense_replace=first_dense, norm_topk_prob=True, hidden_act="silu",
        max_position_embeddings=max_position_embeddings, rms_norm_eps=config.layernorm_epsilon,
        tie_word_embeddings=tied, rope_parameters=rope, rope_interleave=True, attention_bias=False,
    )


_ATTN = {  # Megatron (under decoder.layers.{i}.) <- HF (under model.layers.{i}.)
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
}


def _mlp_to_megatron(hf: StateDict, src: str, dst: str, out: StateDict) -> None:
    """A gated HF MLP (gate/up/down) -> Megatron linear_fc1 ([gate; up]) / linear_fc2."""
    out[f"{dst}linear_fc1.weight"] = torch.cat([hf[f"{src}gate_proj.weight"], hf[f"{src}up_proj.weight"]])
    out[f"{dst}linear_fc2.weight"] = hf[f"{src}down_proj.weight"].clone()


def _mlp_to_hf(sd: StateDict, src: str, dst: str, out: StateDict) -> None:
    gate, up = sd[f"{src}linear_fc1.weight"].chunk(2)
    out[f"{dst}gate_proj.weight"], out[f"{dst}up_proj.weight"] = gate.clone(), up.clone()
    out[f"{dst}down_proj.weight"] = sd[f"{src}linear_fc2.weight"].clone()


def _experts_to_megatron(hf: StateDict, h: str, m: str, num_experts: int, out: StateDict) -> None:
    """Fused [E, 2I, H] / [E, H, I] expert tensors (transformers >= 5) or per-expert HF keys -> SequentialMLP keys."""
    for e in range(num_experts):
        dst = f"{m}mlp.experts.local_experts.{e}."
        if f"{h}mlp.experts.gate_up_proj" in hf:
            out[f"{dst}linear_fc1.weight"] = hf[f"{h}mlp.experts.gate_up_proj"][e].clone()
            out[f"{dst}linear_fc2.weight"] = hf[f"{h}mlp.experts.down_proj"][e].clone()
        else:
            _mlp_to_megatron(hf, f"{h}mlp.experts.{e}.", dst, out)


def hf_to_megatron(hf: StateDict, config, tied: bool = False) -> StateDict:
    """HF DeepseekV3 state dict -> Megatron GPTModel state dict (local MLA spec names, SequentialMLP experts)."""
    out: StateDict = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"].clone(),
                      "decoder.final_layernorm.weight": hf["model.norm.weight"].clone()}
    if not tied:
        out["output_layer.weight"] = hf["lm_head.weight"].clone()
    for i, is_moe in enumerate(_pattern(config)):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for mkey, hkey in _ATTN.items():
            if h + hkey in hf:
                out[m + mkey] = hf[h + hkey].clone()
        if is_moe:
            _experts_to_megatron(hf, h, m, config.num_moe_experts, out)
            _mlp_to_megatron(hf, f"{h}mlp.shared_experts.", f"{m}mlp.shared_experts.", out)
        else:
            _mlp_to_megatron(hf, f"{h}mlp.", f"{m}mlp.", out)
    return out


def megatron_to_hf(sd: StateDict, config, tied: bool = False) -> StateDict:
    """Megatron GPTModel state dict (local MLA spec names) -> HF DeepseekV3 state dict (fused expert tensors)."""
    out: StateDict = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"].clone(),
                      "model.norm.weight": sd["decoder.final_layernorm.weight"].clone()}
    out["lm_head.weight"] = (sd["embedding.word_embeddings.weight"] if tied else sd["output_layer.weight"]).clone()
    for i, is_moe in enumerate(_pattern(config)):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for mkey, hkey in _ATTN.items():
            if m + mkey in sd:
                out[h + hkey] = sd[m + mkey].clone()
        if is_moe:
            experts = [f"{m}mlp.experts.local_experts.{e}." for e in range(config.num_moe_experts)]
            out[f"{h}mlp.experts.gate_up_proj"] = torch.stack([sd[f"{e}linear_fc1.weight"] for e in experts])
            out[f"{h}mlp.experts.down_proj"] = torch.stack([sd[f"{e}linear_fc2.weight"] for e in experts])
            _mlp_to_hf(sd, f"{m}mlp.shared_experts.", f"{h}mlp.shared_experts.", out)
        else:
            _mlp_to_hf(sd, f"{m}mlp.", f"{h}mlp.", out)
    return out


def _pattern(config):
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    return list(freq)


def _checkpoint_args(kwargs: Dict[str, Any], vocab_size: int, tied: bool, tp: int, pp: int) -> Dict[str, Any]:
    """Megatron command-line arguments (as a checkpoint stores them) of a DeepSeek-V3 model."""
    args = {k: v for k, v in kwargs.items() if k not in ("num_moe_experts", "layernorm_epsilon", "gated_linear_unit",
                                                          "add_bias_linear", "rope_type")}
    args.update(num_experts=kwargs["num_moe_experts"], norm_epsilon=kwargs["layernorm_epsilon"], swiglu=True,
                add_bias_linear=False, multi_latent_attention=True, position_embedding_type="rope",
                untie_embeddings_and_output_weights=not tied, vocab_size=vocab_size, padded_vocab_size=vocab_size,
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, model_type="GPT",
                seq_length=kwargs.get("max_position_embeddings", 4096))
    return args


def hf_dir_to_megatron(hf_config: Dict[str, Any], hf_state: StateDict, save_dir: str, tp: int = 1, pp: int = 1,
                       iteration: Optional[int] = None) -> Dict[str, Any]:
    """Write an HF DeepseekV3 model as a legacy-layout Megatron checkpoint at TP=`tp` (experts split at expert
    TP = TP, EP=1) and PP=`pp`. Returns the args."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    from tools.checkpoint.legacy_layout import write_legacy_checkpoint

    kwargs = megatron_config_from_hf(hf_config)
    config = MLATransformerConfig(**kwargs)
    tied = bool(hf_config.get("tie_word_embeddings", False))
    full = hf_to_megatron(hf_state, config, tied)
    args = _checkpoint_args(kwargs, hf_config["vocab_size"], tied, tp, pp)
    layout = SimpleNamespace(num_layers=config.num_layers, swiglu=True)
    write_legacy_checkpoint(save_dir, full, args, layout, iteration, tp, pp)
    return args


def megatron_dir_to_hf(full: StateDict, args, save_dir: str, write_hf_dir) -> Dict[str, Any]:
    """Write a full Megatron DeepSeek-V3 state dict (with its checkpoint args) as an HF directory."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    get = args.get if isinstance(args, dict) else lambda name, default=None: getattr(args, name, default)
    names = {f.name for f in __import__("dataclasses").fields(MLATransformerConfig)}
    kwargs = {k: get(k) for k in names if get(k) is not None}
    kwargs.update(num_moe_experts=get("num_experts"), layernorm_epsilon=get("norm_epsilon", 1e-6),
                  gated_linear_unit=True, add_bias_linear=False)
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                 "sequence_parallel", "params_dtype", "pipeline_dtype"):
        kwargs.pop(name, None)
    config = MLATransformerConfig(**kwargs)
    tied = not get("untie_embeddings_and_output_weights", False)
    vocab = get("true_vocab_size") or full["embedding.word_embeddings.weight"].shape[0]
    hf_config = hf_config_from_megatron(config, vocab, tied, get("max_position_embeddings", 4096))
    state = megatron_to_hf(full, config, tied)
    write_hf_dir(save_dir, hf_config, {k: v[:vocab] if "embed_tokens" in k or "lm_head" in k else v
                                       for k, v in state.items()})
    return hf_config


__all__ = ["hf_dir_to_megatron", "megatron_dir_to_hf", "megatron_config_from_hf", "hf_config_from_megatron", "hf_to_megatron", "megatron_to_hf"]
