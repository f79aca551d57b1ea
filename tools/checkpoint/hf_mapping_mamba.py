"""HuggingFace `Mamba2ForCausalLM` <-> Megatron `MambaModel` (all-`M` pattern) weights and configs.

Both sides lay out the mixer the same way (`in_proj` rows [z | x | B | C | dt], conv channels [x | B | C], grouped
gated RMSNorm); only names differ, and Megatron fuses each layer's pre-norm into `mixer.in_proj`:

    backbone.embeddings.weight              <-> embedding.word_embeddings.weight
    backbone.layers.{i}.norm.weight         <-> decoder.layers.{i}.mixer.in_proj.layer_norm_weight
    backbone.layers.{i}.mixer.<p>           <-> decoder.layers.{i}.mixer.<p>   (in_proj.weight, conv1d.*, dt_bias,
                                                                                A_log, D, norm.weight, out_proj.weight)
    backbone.norm_f.weight                  <-> decoder.final_norm.weight
    lm_head.weight                          <-> output_layer.weight (absent when tied)

State dicts here are single-process (TP=1) Megatron state dicts.
"""
from typing import Any, Dict, Tuple

import torch

_MIXER_PARAMS = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight",
                 "out_proj.weight")


def megatron_args_from_hf_config(config: Dict[str, Any]) -> Dict[str, Any]:
    """The Megatron flags (as argument names) of an HF Mamba2 config; ValueError on what MambaModel cannot hold."""
    problems = []
    if config.get("use_bias", False):
        problems.append("use_bias=True: Megatron's mixer has no in_proj/out_proj bias")
    if not config.get("use_conv_bias", True):
        problems.append("use_conv_bias=False: Megatron's mixer always has a conv bias")
    if config.get("conv_kernel", 4) != 4:
        problems.append(f"conv_kernel={config.get('conv_kernel')}: Megatron's mixer uses d_conv 4")
    limit = tuple(config.get("time_step_limit", (0.0, float("inf"))))
    if limit != (0.0, float("inf")):
        problems.append(f"time_step_limit={limit}: Megatron does not clamp dt")
    if problems:
        raise ValueError("HF Mamba2 config cannot be converted: " + "; ".join(problems))
    return {
        "num_layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"],
        "mamba_state_dim": config["state_size"], "mamba_head_dim": config["head_dim"],
        "mamba_num_groups": config["n_groups"], "mamba_num_heads": config["num_heads"],
        "norm_epsilon": config.get("layer_norm_epsilon", 1e-5), "normalization": "RMSNorm",
        "padded_vocab_size": config["vocab_size"], "vocab_size": config["vocab_size"],
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        "hybrid_override_pattern": "M" * config["num_hidden_layers"], "position_embedding_type": "none",
        "chunk_size": config.get("chunk_size", 256),
    }


def hf_config_from_megatron_args(args: Dict[str, Any]) -> Dict[str, Any]:
    """An HF Mamba2 config.json dict for a pure-Mamba Megatron model."""
    pattern = args.get("hybrid_override_pattern") or "M" * args["num_layers"]
    if set(pattern) != {"M"}:
        raise ValueError(f"--hybrid-override-pattern {pattern!r}: HF Mamba2ForCausalLM holds Mamba layers only.")
    hidden = args["hidden_size"]
    num_heads = args.get("mamba_num_heads") or 2 * hidden // args["mamba_head_dim"]
    return {
        "architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2", "hidden_size": hidden,
        "num_hidden_layers": args["num_layers"], "state_size": args["mamba_state_dim"],
        "head_dim": args["mamba_head_dim"], "n_groups": args["mamba_num_groups"], "num_heads": num_heads,
        "expand": num_heads * args["mamba_head_dim"] // hidden, "conv_kernel": 4, "use_bias": False,
        "use_conv_bias": True, "layer_norm_epsilon": args.get("norm_epsilon", 1e-5),
        "vocab_size": args.get("vocab_size") or args["padded_vocab_size"],
        "tie_word_embeddings": not args.get("untie_embeddings_and_output_weights", True),
        "chunk_size": args.get("chunk_size", 256), "residual_in_fp32": False,
    }


def hf_to_megatron(hf: Dict[str, torch.Tensor], config: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """A single-process Megatron MambaModel state dict from an HF Mamba2 state dict."""
    out = {"embedding.word_embeddings.weight": hf["backbone.embeddings.weight"],
           "decoder.final_norm.weight": hf["backbone.norm_f.weight"]}
    for i in range(config["num_hidden_layers"]):
        src, dst = f"backbone.layers.{i}.", f"decoder.layers.{i}.mixer."
        out[f"{dst}in_proj.layer_norm_weight"] = hf[f"{src}norm.weight"]
        for name in _MIXER_PARAMS:
            out[f"{dst}{name}"] = hf[f"{src}mixer.{name}"]
    if not config.get("tie_word_embeddings", False):
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def megatron_to_hf(sd: Dict[str, torch.Tensor], num_layers: int, tied: bool) -> Dict[str, torch.Tensor]:
    """An HF Mamba2 state dict from a single-process Megatron MambaModel state dict (all-`M` pattern)."""
    out = {"backbone.embeddings.weight": sd["embedding.word_embeddings.weight"],
           "backbone.norm_f.weight": sd["decoder.final_norm.weight"]}
    for i in range(num_layers):
        src, dst = f"decoder.layers.{i}.mixer.", f"backbone.layers.{i}."
        if f"{src}in_proj.weight" not in sd:
            raise ValueError(f"decoder.layers.{i} is not a Mamba layer: HF Mamba2ForCausalLM holds Mamba layers only.")
        out[f"{dst}norm.weight"] = sd[f"{src}in_proj.layer_norm_weight"]
        for name in _MIXER_PARAMS:
            out[f"{dst}mixer.{name}"] = sd[f"{src}{name}"]
    out["lm_head.weight"] = sd["embedding.word_embeddings.weight"] if tied else sd["output_layer.weight"]
    return out


def split_for_hf_dir(config: Dict[str, Any], state: Dict[str, torch.Tensor]) -> Tuple[Dict[str, Any], Dict]:
    """(config, state) ready for `hf_convert.write_hf_dir` (tied heads are not stored twice)."""
    if config.get("tie_word_embeddings", False):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    return config, state


__all__ = ["megatron_args_from_hf_config", "hf_config_from_megatron_args", "hf_to_megatron", "megatron_to_hf",
           "split_for_hf_dir"]
