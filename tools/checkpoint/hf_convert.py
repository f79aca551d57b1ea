"""Direct HuggingFace <-> Megatron conversion (legacy `torch` layout on the Megatron side).

    python tools/checkpoint/hf_convert.py megatron-to-hf --load-dir CKPT --save-dir HF_DIR
    python tools/checkpoint/hf_convert.py hf-to-megatron --load-dir HF_DIR --save-dir CKPT \
        [--target-tensor-parallel-size 2] [--target-pipeline-parallel-size 2]

Supported: Llama / Mistral / Qwen2 (qkv bias) / Qwen3 (qk-norm) style models (RoPE, RMSNorm, SwiGLU,
GQA, tied or untied), GPT-2 (learned positions, LayerNorm, GELU, biases), the MoE models Mixtral and
Qwen3-MoE (SequentialMLP expert keys, EP=1 on the Megatron side; `hf_mapping_moe`), Mamba2
(`hf_mapping_mamba`; any TP on import, TP=1 PP=1 on export) and DeepSeek-V3 (`model_type` deepseek_v3: MLA +
MoE, any TP/PP on the Megatron side, experts at EP=1; mapping in `hf_deepseek_v3.py`). The HF side is a local
directory with `config.json` and `model.safetensors` (or a sharded `model.safetensors.index.json`);
nothing is downloaded.
"""
import argparse
import json
import os
import sys
import time
from types import SimpleNamespace
from typing import Dict, List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
from safetensors.torch import load_file, save_file

from megatron.core.dist_checkpointing.safe_load import safe_torch_load
from tools.checkpoint import hf_deepseek_v3, hf_mapping, hf_mapping_mamba
from tools.checkpoint.legacy_layout import read_legacy_checkpoint, write_legacy_checkpoint
from tools.checkpoint.model_description import (
    ModelDescription,
    from_hf_config,
    from_megatron_args,
    to_hf_config,
    to_megatron_args,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_hf_dir(hf_dir: str) -> tuple:
    """(config dict, state dict) of a local HF model directory."""
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path} is missing: --load-dir must be a local HF model directory")
    with open(config_path) as f:
        config = json.load(f)
    single = os.path.join(hf_dir, "model.safetensors")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        return config, load_file(single)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        state = {}
        for name in files:
            state.update(load_file(os.path.join(hf_dir, name)))
        return config, state
    legacy = os.path.join(hf_dir, "pytorch_model.bin")
    if os.path.isfile(legacy):
        return config, safe_torch_load(legacy)
    raise FileNotFoundError(f"{hf_dir} has no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def write_hf_dir(hf_dir: str, config: dict, state: Dict[str, torch.Tensor]) -> None:
    """Write config.json and model.safetensors."""
    os.makedirs(hf_dir, exist_ok=True)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(hf_dir, "model.safetensors"),
              metadata={"format": "pt"})


_START = time.monotonic()


def _progress(message: str) -> None:
    """A progress line on stderr (`[hf_convert] <elapsed> s: message`), so stdout keeps the summary only."""
    print(f"[hf_convert] {time.monotonic() - _START:6.1f} s: {message}", file=sys.stderr, flush=True)


def megatron_to_hf(load_dir: str, save_dir: str, true_vocab_size: Optional[int] = None,
                   dtype: Optional[str] = None) -> Optional[ModelDescription]:
    """Convert a legacy-layout Megatron checkpoint (any TP/PP; a Mamba model at TP=1, PP=1) into an HF directory."""
    _progress(f"reading the Megatron checkpoint {load_dir}")
    if hf_mapping_mamba.is_mamba_checkpoint_args(hf_mapping_mamba.read_megatron_args(load_dir)):
        config, state = hf_mapping_mamba.read_megatron_dir(load_dir)
        write_hf_dir(save_dir, config, state)
        return None
    if _is_deepseek_v3_checkpoint(load_dir):
        full, args, _, _ = read_legacy_checkpoint(load_dir, _full_layout_description)
        hf_deepseek_v3.megatron_dir_to_hf(full, args, save_dir, write_hf_dir)
        return _full_layout_description(args)
    full, _, _, desc = read_legacy_checkpoint(load_dir, from_megatron_args)
    _progress(f"read {len(full)} tensors; mapping {desc.num_layers} layers to HF names")
    if true_vocab_size is not None:
        desc.true_vocab_size = true_vocab_size
    if dtype is not None:
        desc.params_dtype = dtype
    hf_state = hf_mapping.megatron_to_hf(full, desc)
    target = _DTYPES[desc.params_dtype]
    _progress(f"writing {len(hf_state)} tensors to {save_dir}")
    write_hf_dir(save_dir, to_hf_config(desc), {k: v.to(target) for k, v in hf_state.items()})
    _progress("done")
    return desc


def hf_to_megatron(load_dir: str, save_dir: str, tp: int = 1, pp: int = 1, iteration: Optional[int] = None,
                   make_vocab_size_divisible_by: Optional[int] = None) -> Optional[ModelDescription]:
    """Convert an HF directory into a legacy-layout Megatron checkpoint at TP=`tp`, PP=`pp`
    (a `release` checkpoint unless `iteration` is given)."""
    _progress(f"reading the HF checkpoint {load_dir}")
    config, hf_state = read_hf_dir(load_dir)
    _progress(f"read {len(hf_state)} tensors; mapping to Megatron names")
    if config.get("model_type") == "mamba2":
        if pp != 1:
            raise ValueError(f"--target-pipeline-parallel-size {pp}: Mamba2 checkpoints are written at PP=1 here.")
        hf_mapping_mamba.write_megatron_dir(config, hf_state, save_dir, tp)
        return None
    if config.get("model_type") == "deepseek_v3":  # MLA + MoE: its own mapping (tools/checkpoint/hf_deepseek_v3.py)
        hf_deepseek_v3.hf_dir_to_megatron(config, hf_state, save_dir, tp, pp, iteration)
        return _full_layout_description(hf_deepseek_v3.megatron_config_from_hf(config))
    desc = from_hf_config(config, make_vocab_size_divisible_by, tp)
    full = hf_mapping.hf_to_megatron(hf_state, desc)
    _progress(f"writing TP={tp} PP={pp} shards to {save_dir}")
    args = to_megatron_args(desc, tp, pp, iteration or 0)
    if make_vocab_size_divisible_by:
        args["make_vocab_size_divisible_by"] = make_vocab_size_divisible_by
    write_legacy_checkpoint(save_dir, full, args, desc, iteration, tp, pp)
    _progress("done")
    return desc


def _arg(args, name, default=None):
    return args.get(name, default) if isinstance(args, dict) else getattr(args, name, default)


def _full_layout_description(args):
    """What the legacy layout needs of a DeepSeek-V3 model (its layer count; fc1 is SwiGLU)."""
    return SimpleNamespace(num_layers=_arg(args, "num_layers"), hidden_size=_arg(args, "hidden_size"), swiglu=True,
                           num_query_groups=None,
                           tie_embeddings=not _arg(args, "untie_embeddings_and_output_weights", True))


def _is_deepseek_v3_checkpoint(load_dir: str) -> bool:
    """A legacy checkpoint whose args say --multi-latent-attention."""
    from tools.checkpoint.legacy_layout import read_tracker

    iter_name, _ = read_tracker(load_dir)
    iter_dir = os.path.join(load_dir, iter_name)
    for name in sorted(os.listdir(iter_dir)) if os.path.isdir(iter_dir) else []:
        path = os.path.join(iter_dir, name, "model_optim_rng.pt")
        if os.path.isfile(path):
            return bool(_arg(safe_torch_load(path).get("args"), "multi_latent_attention", False))
    return False


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("direction", choices=["megatron-to-hf", "hf-to-megatron"])
    parser.add_argument("--load-dir", required=True, help="source directory")
    parser.add_argument("--save-dir", required=True, help="target directory")
    parser.add_argument("--target-tensor-parallel-size", type=int, default=1, help="TP of the written Megatron checkpoint")
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=1, help="PP of the written Megatron checkpoint")
    parser.add_argument("--iteration", type=int, default=None, help="iteration to record (default: release)")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                        help="pad the Megatron vocab to a multiple of this times TP (default: no padding)")
    parser.add_argument("--true-vocab-size", type=int, default=None, help="HF vocab size (drops padded rows)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="HF weight dtype (default: as trained)")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    args = _parse(argv)
    if args.direction == "megatron-to-hf":
        desc = megatron_to_hf(args.load_dir, args.save_dir, args.true_vocab_size, args.dtype)
    else:
        desc = hf_to_megatron(args.load_dir, args.save_dir, args.target_tensor_parallel_size,
                              args.target_pipeline_parallel_size, args.iteration, args.make_vocab_size_divisible_by)
    what = f" ({desc.num_layers} layers, hidden {desc.hidden_size})" if desc is not None else " (Mamba2)"
    print(f"converted {args.load_dir} -> {args.save_dir}{what}")


if __name__ == "__main__":
    main()
