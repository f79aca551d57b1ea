"""Read and write Megatron's legacy `torch` checkpoint layout as one full (TP=1, PP=1) state dict.

Layout: `<dir>/latest_checkpointed_iteration.txt` (an iteration or `release`), then
`iter_{:07d}/` (or `release/`) with `mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt` holding
`{"model", "args", "iteration", "checkpoint_version"}`. Files are read with the restricted unpickler.

Tensor-parallel rules (local-spec names): column-parallel weights (`linear_qkv`, `linear_fc1`, word
embeddings, output layer, the multi-latent attention projections other than `linear_proj`) are split along dim 0, row-parallel weights (`linear_proj`, `linear_fc2`)
along dim 1, everything else is replicated. A SwiGLU `linear_fc1` shard holds `[gate_shard; up_shard]`.
Pipeline stages hold consecutive layers renumbered from 0; the first stage holds the embeddings, the
last the final norm and output layer (a real copy of the tied embedding when PP > 1).
"""
import os
import re
import shutil
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.core.dist_checkpointing.safe_load import safe_torch_load
from tools.checkpoint.dist_layout import is_dist_checkpoint, read_dist_checkpoint
from tools.checkpoint.model_description import ModelDescription

TRACKER = "latest_checkpointed_iteration.txt"
_COLUMN = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "mlp.linear_fc1.weight",
           "mlp.linear_fc1.bias", "embedding.word_embeddings.weight", "output_layer.weight",
           # multi-latent attention: every projection but linear_proj is column-parallel (the down projections'
           # outputs are all-gathered over TP; the kv_down rows [latent | k_pe] are sharded as one block)
           "self_attention.linear_q_proj.weight", "self_attention.linear_q_down_proj.weight",
           "self_attention.linear_q_up_proj.weight", "self_attention.linear_kv_down_proj.weight",
           "self_attention.linear_kv_up_proj.weight")
_ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


_EXPERT_RE = re.compile(r"\.mlp\.(experts\.local_experts\.\d+|shared_experts)\.linear_fc(1|2)\.weight$")


def _split_dim(key: str) -> Optional[int]:
    if key.endswith(_COLUMN):
        return 0
    if key.endswith(_ROW):
        return 1
    expert = _EXPERT_RE.search(key)  # expert TP = TP at EP=1: fc1 column-, fc2 row-parallel
    if expert:
        return 0 if expert.group(2) == "1" else 1
    return None


def _is_swiglu_fc1(key: str, desc: ModelDescription) -> bool:
    fc1 = key.endswith(("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"))
    return desc.swiglu and (fc1 or (_EXPERT_RE.search(key) is not None and key.endswith("fc1.weight")))


def read_tracker(load_dir: str) -> Tuple[str, Optional[int]]:
    """(iteration directory name, iteration or None for release)."""
    path = os.path.join(load_dir, TRACKER)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: {load_dir} is not a Megatron checkpoint directory")
    text = open(path).read().strip()
    if text == "release":
        return "release", None
    if not text.isdigit():
        raise ValueError(f"{path} holds {text!r}, expected an iteration number or 'release'")
    return f"iter_{int(text):07d}", int(text)


def _rank_dirs(iter_dir: str) -> Dict[Tuple[int, int], str]:
    found = {}
    for name in sorted(os.listdir(iter_dir)):
        match = re.fullmatch(r"mp_rank_(\d{2})(?:_(\d{3}))?", name)
        if match:
            found[(int(match.group(1)), int(match.group(2) or 0))] = os.path.join(iter_dir, name, "model_optim_rng.pt")
    if not found:
        raise FileNotFoundError(f"{iter_dir} holds no mp_rank_XX directories (expected the legacy torch layout)")
    return found


def _merge_tp(shards: List[Dict[str, Any]], desc: ModelDescription) -> Dict[str, Any]:
    merged = {}
    for key, first in shards[0].items():
        dim = _split_dim(key)
        if dim is None or len(shards) == 1 or not isinstance(first, torch.Tensor):
            merged[key] = first
        elif _is_swiglu_fc1(key, desc):
            halves = [torch.chunk(s[key], 2, dim=0) for s in shards]
            merged[key] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            merged[key] = torch.cat([s[key] for s in shards], dim=dim)
    return merged


def _renumber(stage_sd: Dict[str, Any], offset: int) -> Tuple[Dict[str, Any], int]:
    out, count = {}, 0
    for key, value in stage_sd.items():
        match = _LAYER_RE.match(key)
        if match:
            local = int(match.group(1))
            count = max(count, local + 1)
            key = f"decoder.layers.{local + offset}.{match.group(2)}"
        out[key] = value
    return out, count


def read_legacy_checkpoint(load_dir: str, desc_from_args) -> Tuple[Dict[str, Any], Any, Optional[int], ModelDescription]:
    """(full model state dict, checkpoint args, iteration (None: release), ModelDescription).

    A torch_dist iteration directory (metadata.json) is read through `dist_layout` instead."""
    iter_name, iteration = read_tracker(load_dir)
    if is_dist_checkpoint(os.path.join(load_dir, iter_name)):
        full, args, _, desc = read_dist_checkpoint(os.path.join(load_dir, iter_name), desc_from_args)
        return full, args, iteration, desc
    files = _rank_dirs(os.path.join(load_dir, iter_name))
    tp = max(t for t, _ in files) + 1
    pp = max(p for _, p in files) + 1
    loaded = {coord: safe_torch_load(path) for coord, path in files.items()}
    first = loaded[(0, 0)]
    if "model" not in first:
        raise ValueError(f"{files[(0, 0)]} has no 'model' entry (virtual pipeline chunks 'model0'.. are not supported)")
    desc = desc_from_args(first["args"])
    full: Dict[str, Any] = {}
    offset = 0
    for stage in range(pp):
        missing = [(t, stage) for t in range(tp) if (t, stage) not in loaded]
        if missing:
            raise FileNotFoundError(f"{load_dir}: missing model files for (tp, pp) ranks {missing}")
        merged = _merge_tp([loaded[(t, stage)]["model"] for t in range(tp)], desc)
        stage_sd, count = _renumber(merged, offset)
        offset += count
        for key, value in stage_sd.items():
            if key == "output_layer.weight" and desc.tie_embeddings:
                continue
            full[key] = value
    return full, first["args"], iteration, desc


def _stage_of_layer(num_layers: int, pp: int) -> List[int]:
    if num_layers % pp:
        raise ValueError(f"--target-pipeline-parallel-size {pp} must divide num_layers {num_layers}")
    per = num_layers // pp
    return [i // per for i in range(num_layers)]


def _shard(value: Any, key: str, rank: int, tp: int, desc: ModelDescription) -> Any:
    dim = _split_dim(key)
    if dim is None or tp == 1 or not isinstance(value, torch.Tensor):
        return value
    if _is_swiglu_fc1(key, desc):
        gate, up = torch.chunk(value, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp, dim=0)[rank], torch.chunk(up, tp, dim=0)[rank]]).clone()
    if value.shape[dim] % tp:
        raise ValueError(f"{key}: size {value.shape[dim]} along dim {dim} is not divisible by TP={tp}")
    return torch.chunk(value, tp, dim=dim)[rank].clone()


def _stage_state(full: Dict[str, Any], stage: int, pp: int, desc: ModelDescription) -> Dict[str, Any]:
    stages = _stage_of_layer(desc.num_layers, pp)
    first_layer = stages.index(stage)
    out = {}
    for key, value in full.items():
        match = _LAYER_RE.match(key)
        if match:
            layer = int(match.group(1))
            if stages[layer] == stage:
                out[f"decoder.layers.{layer - first_layer}.{match.group(2)}"] = value
        elif key.startswith("embedding."):
            if stage == 0:
                out[key] = value
        elif stage == pp - 1:
            out[key] = value
    if stage == pp - 1 and pp > 1 and desc.tie_embeddings:
        out["output_layer.weight"] = full["embedding.word_embeddings.weight"]
    return out


def write_legacy_checkpoint(save_dir: str, full: Dict[str, Any], args: Dict[str, Any], desc: ModelDescription,
                            iteration: Optional[int], tp: int = 1, pp: int = 1) -> str:
    """Write `full` at TP=`tp`, PP=`pp`; iteration None writes a `release` checkpoint. Returns the
    iteration directory. The tracker is written last."""
    iter_name = "release" if iteration is None else f"iter_{iteration:07d}"
    final_dir = os.path.join(save_dir, iter_name)
    tmp_dir = os.path.join(save_dir, ".tmp_" + iter_name)
    shutil.rmtree(tmp_dir, ignore_errors=True)
    args = dict(args, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    for stage in range(pp):
        stage_sd = _stage_state(full, stage, pp, desc)
        for rank in range(tp):
            name = f"mp_rank_{rank:02d}" if pp == 1 else f"mp_rank_{rank:02d}_{stage:03d}"
            os.makedirs(os.path.join(tmp_dir, name))
            model = {k: _shard(v, k, rank, tp, desc) for k, v in stage_sd.items()}
            state = {"model": model, "args": args, "iteration": 0 if iteration is None else iteration,
                     "checkpoint_version": 3.0}
            torch.save(state, os.path.join(tmp_dir, name, "model_optim_rng.pt"))
    shutil.rmtree(final_dir, ignore_errors=True)
    os.replace(tmp_dir, final_dir)
    tracker = os.path.join(save_dir, TRACKER)
    with open(tracker + ".tmp", "w") as f:
        f.write("release" if iteration is None else str(iteration))
    os.replace(tracker + ".tmp", tracker)
    return final_dir
