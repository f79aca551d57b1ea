"""MoE layers between a full (TP=1, PP=1, EP=1) Megatron GPT state dict (local spec, SequentialMLP experts) and
HuggingFace Mixtral / Qwen3-MoE state dicts, in the hub's per-expert layout (what `from_pretrained` reads; the
fused `experts.gate_up_proj` / `experts.down_proj` tensors that transformers >= 5 keeps in memory are read too).

| Megatron (`decoder.layers.i.mlp.`)          | Mixtral (`model.layers.i.block_sparse_moe.`) | Qwen3-MoE (`model.layers.i.mlp.`)  |
|---------------------------------------------|----------------------------------------------|------------------------------------|
| `router.weight` [E, h]                      | `gate.weight`                                | `gate.weight`                      |
| `experts.local_experts.e.linear_fc1.weight` | `experts.e.w1` (gate) ; `experts.e.w3` (up)  | `experts.e.gate_proj` ; `up_proj`  |
| `experts.local_experts.e.linear_fc2.weight` | `experts.e.w2`                               | `experts.e.down_proj`              |

Routing: Mixtral (and Qwen3-MoE with `norm_topk_prob`) softmaxes the router logits, keeps the top k and
renormalizes them, which is Megatron's default (top k of the logits, then a softmax over them); Qwen3-MoE
without `norm_topk_prob` keeps the softmax probabilities of all experts: `--moe-router-pre-softmax`.
"""
from typing import TYPE_CHECKING, Dict

import torch

if TYPE_CHECKING:  # model_description imports this module's config helpers
    from tools.checkpoint.model_description import ModelDescription

StateDict = Dict[str, torch.Tensor]


def is_moe_layer(desc: "ModelDescription", i: int) -> bool:
    """Whether layer `i` of `desc` has an MoE MLP."""
    if not desc.num_experts:
        return False
    return desc.moe_layer_freq is None or bool(desc.moe_layer_freq[i])


def _hf_prefix(desc: "ModelDescription", i: int) -> str:
    return f"model.layers.{i}." + ("mlp." if desc.qk_layernorm else "block_sparse_moe.")


def _hf_expert_names(desc: "ModelDescription"):
    """(gate, up, down) names of one HF expert."""
    return ("gate_proj", "up_proj", "down_proj") if desc.qk_layernorm else ("w1", "w3", "w2")


def moe_layer_to_hf(sd: StateDict, i: int, desc: "ModelDescription", out: StateDict) -> None:
    """The MoE MLP of Megatron layer `i` into `out` (HF names)."""
    m, h = f"decoder.layers.{i}.mlp.", _hf_prefix(desc, i)
    gate_name, up_name, down_name = _hf_expert_names(desc)
    out[h + "gate.weight"] = sd[m + "router.weight"]
    for e in range(desc.num_experts):
        expert = f"{m}experts.local_experts.{e}."
        gate, up = torch.chunk(sd[expert + "linear_fc1.weight"], 2, dim=0)
        out[f"{h}experts.{e}.{gate_name}.weight"] = gate
        out[f"{h}experts.{e}.{up_name}.weight"] = up
        out[f"{h}experts.{e}.{down_name}.weight"] = sd[expert + "linear_fc2.weight"]


def _expert_from_hf(hf: StateDict, h: str, e: int, desc: "ModelDescription"):
    """(linear_fc1 [2f, h], linear_fc2 [h, f]) of expert `e` from per-expert or fused HF tensors."""
    gate_name, up_name, down_name = _hf_expert_names(desc)
    per_expert = f"{h}experts.{e}.{gate_name}.weight"
    if per_expert in hf:
        fc1 = torch.cat([hf[per_expert], hf[f"{h}experts.{e}.{up_name}.weight"]])
        return fc1, hf[f"{h}experts.{e}.{down_name}.weight"]
    fused = h.replace(".block_sparse_moe.", ".mlp.")
    # [E, 2f, h] -> [2f, h] of expert e: rows are [gate; up] as Megatron's fc1
    return hf[fused + "experts.gate_up_proj"][e], hf[fused + "experts.down_proj"][e]


def moe_extra_state_keys(desc: "ModelDescription", i: int):
    """`_extra_state` keys the experts' linears of Megatron layer `i` emit."""
    return [f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{name}._extra_state"
            for e in range(desc.num_experts) for name in ("linear_fc1", "linear_fc2")]


def moe_layer_from_hf(hf: StateDict, i: int, desc: "ModelDescription", out: StateDict) -> None:
    """The MoE MLP of HF layer `i` into `out` (Megatron names)."""
    m, h = f"decoder.layers.{i}.mlp.", _hf_prefix(desc, i)
    router = h + "gate.weight"
    out[m + "router.weight"] = hf[router] if router in hf else hf[h.replace(".block_sparse_moe.", ".mlp.") + "gate.weight"]
    for e in range(desc.num_experts):
        expert = f"{m}experts.local_experts.{e}."
        out[expert + "linear_fc1.weight"], out[expert + "linear_fc2.weight"] = _expert_from_hf(hf, h, e, desc)


def moe_megatron_args(desc: "ModelDescription") -> Dict:
    """The MoE flag dests of `desc` (empty for a dense model)."""
    if not desc.num_experts:
        return {}
    return {"num_experts": desc.num_experts, "moe_router_topk": desc.moe_router_topk,
            "moe_ffn_hidden_size": desc.moe_ffn_hidden_size, "moe_router_pre_softmax": desc.moe_router_pre_softmax,
            "moe_layer_freq": list(desc.moe_layer_freq) if desc.moe_layer_freq is not None else 1,
            "moe_router_score_function": "softmax", "moe_grouped_gemm": False,
            "moe_token_dispatcher_type": "alltoall"}


def moe_hf_config(desc: "ModelDescription") -> Dict:
    """The MoE entries of config.json for `desc` (Mixtral or Qwen3-MoE)."""
    if desc.qk_layernorm:
        freq = desc.moe_layer_freq or [1] * desc.num_layers
        return {"num_experts": desc.num_experts, "num_experts_per_tok": desc.moe_router_topk,
                "moe_intermediate_size": desc.moe_ffn_hidden_size, "norm_topk_prob": not desc.moe_router_pre_softmax,
                "decoder_sparse_step": 1, "mlp_only_layers": [i for i, f in enumerate(freq) if not f],
                "output_router_logits": False, "router_aux_loss_coef": 0.0}
    return {"num_local_experts": desc.num_experts, "num_experts_per_tok": desc.moe_router_topk,
            "output_router_logits": False, "router_aux_loss_coef": 0.0, "sliding_window": None}


def moe_fields_from_hf_config(config: Dict) -> Dict:
    """ModelDescription MoE fields of a Mixtral / Qwen3-MoE config.json."""
    layers = int(config["num_hidden_layers"])
    if config.get("model_type") == "mixtral":
        return {"num_experts": int(config["num_local_experts"]), "moe_router_topk": int(config["num_experts_per_tok"]),
                "moe_ffn_hidden_size": int(config["intermediate_size"]), "moe_router_pre_softmax": False,
                "moe_layer_freq": None}
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or [])
    freq = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    experts = config["num_experts"] if "num_experts" in config else config["num_local_experts"]  # transformers >= 5
    return {"num_experts": int(experts), "moe_router_topk": int(config["num_experts_per_tok"]),
            "moe_ffn_hidden_size": int(config["moe_intermediate_size"]),
            "moe_router_pre_softmax": not bool(config.get("norm_topk_prob", False)),
            "moe_layer_freq": None if all(freq) else freq}
