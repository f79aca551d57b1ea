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
import os
from typing import Any, Dict, Tuple

import torch

from megatron.core.dist_checkpointing.safe_load import safe_torch_load
from tools.checkpoint.legacy_layout import TRACKER, read_tracker

_MIXER_PARAMS = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight",
                 "out_proj.weight")


def _json_float(value) -> float:
    """A float of config.json (transformers writes infinity as {"__float__": "Infinity"})."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def megatron_args_from_hf_config(config: Dict[str, Any]) -> Dict[str, Any]:
    """The Megatron flags (as argument names) of an HF Mamba2 config; ValueError on what MambaModel cannot hold."""
    problems = []
    if config.get("use_bias", False):
        problems.append("use_bias=True: Megatron's mixer has no in_proj/out_proj bias")
    if not config.get("use_conv_bias", True):
        problems.append("use_conv_bias=False: Megatron's mixer always has a conv bias")
    if config.get("conv_kernel", 4) != 4:
        problems.append(f"conv_kernel={config.get('conv_kernel')}: Megatron's mixer uses d_conv 4")
    limit = tuple(_json_float(v) for v in config.get("time_step_limit", (0.0, float("inf"))))
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




_PIECED = {"mixer.in_proj.weight": "in_proj", "mixer.conv1d.weight": "conv", "mixer.conv1d.bias": "conv"}
_TP_ROWS = ("mixer.dt_bias", "mixer.A_log", "mixer.D", "mixer.norm.weight", "mixer.out_proj.weight")


def _piece_sizes(kind: str, args: Dict[str, Any]):
    d_inner = args["mamba_num_heads"] * args["mamba_head_dim"]
    groups_state = args["mamba_num_groups"] * args["mamba_state_dim"]
    if kind == "in_proj":
        return [d_inner, d_inner, groups_state, groups_state, args["mamba_num_heads"]]
    return [d_inner, groups_state, groups_state]


def shard_for_tp(key: str, value: torch.Tensor, rank: int, tp: int, args: Dict[str, Any]) -> torch.Tensor:
    """TP rank `rank`'s part of a single-process MambaModel tensor (Megatron's per-rank mixer layout: each piece
    of in_proj [z|x|B|C|dt] and conv1d [x|B|C] split on its own)."""
    if tp == 1:
        return value
    for suffix, kind in _PIECED.items():
        if key.endswith(suffix):
            pieces = torch.split(value, _piece_sizes(kind, args), dim=0)
            return torch.cat([torch.chunk(p, tp, dim=0)[rank] for p in pieces]).clone()
    if key.endswith("mixer.out_proj.weight"):
        return torch.chunk(value, tp, dim=1)[rank].clone()
    if any(key.endswith(suffix) for suffix in _TP_ROWS) or key in ("embedding.word_embeddings.weight",
                                                                   "output_layer.weight"):
        return torch.chunk(value, tp, dim=0)[rank].clone()
    return value


def write_megatron_dir(config: Dict[str, Any], hf_state: Dict[str, torch.Tensor], save_dir: str,
                       tp: int = 1) -> Dict[str, Any]:
    """An HF Mamba2 model (config.json dict and weights) as a legacy (`torch`) Megatron checkpoint (`release`,
    TP=`tp`, PP=1). Returns the checkpoint args."""
    args = megatron_args_from_hf_config(config)
    args.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, is_hybrid_model=False,
                spec=["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"])
    full = hf_to_megatron(hf_state, config)
    for rank in range(tp):
        rank_dir = os.path.join(save_dir, "release", f"mp_rank_{rank:02d}")
        os.makedirs(rank_dir, exist_ok=True)
        model = {k: shard_for_tp(k, v, rank, tp, args) for k, v in full.items()}
        torch.save({"model": model, "args": dict(args), "iteration": 0, "checkpoint_version": 3.0},
                   os.path.join(rank_dir, "model_optim_rng.pt"))
    with open(os.path.join(save_dir, TRACKER), "w") as f:
        f.write("release")
    return args


def is_mamba_checkpoint_args(args: Dict[str, Any]) -> bool:
    """Whether legacy checkpoint args describe a MambaModel (a Mamba --spec or a hybrid pattern)."""
    return "mamba" in " ".join(args.get("spec") or []) or bool(args.get("hybrid_override_pattern"))


def read_megatron_args(load_dir: str) -> Dict[str, Any]:
    """The args (as a dict) of a legacy checkpoint's first rank file."""
    iter_name, _ = read_tracker(load_dir)
    rank_dir = os.path.join(load_dir, iter_name, "mp_rank_00")
    path = os.path.join(rank_dir if os.path.isdir(rank_dir) else rank_dir + "_000", "model_optim_rng.pt")
    if not os.path.isfile(path):
        return {}
    args = safe_torch_load(path)["args"]
    return args if isinstance(args, dict) else vars(args)


def read_megatron_dir(load_dir: str) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """A TP=1, PP=1 legacy Megatron MambaModel checkpoint (all-`M` pattern) as (HF config dict, HF weights)."""
    iter_name, _ = read_tracker(load_dir)
    rank_dir = os.path.join(load_dir, iter_name, "mp_rank_00")
    if not os.path.isdir(rank_dir) or os.path.isdir(os.path.join(load_dir, iter_name, "mp_rank_01")):
        raise ValueError(f"{load_dir}: Mamba export reads TP=1, PP=1 legacy checkpoints (mp_rank_00 only)")
    state = safe_torch_load(os.path.join(rank_dir, "model_optim_rng.pt"))
    args = state["args"] if isinstance(state["args"], dict) else vars(state["args"])
    sd = {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
    tied = not args.get("untie_embeddings_and_output_weights", False)
    hf_state = megatron_to_hf(sd, args["num_layers"], tied)
    return split_for_hf_dir(hf_config_from_megatron_args(args), hf_state)


__all__ = ["megatron_args_from_hf_config", "hf_config_from_megatron_args", "hf_to_megatron", "megatron_to_hf",
           "split_for_hf_dir", "shard_for_tp", "write_megatron_dir", "read_megatron_dir", "read_megatron_args",
           "is_mamba_checkpoint_args"]
