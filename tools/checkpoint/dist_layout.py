"""Read a `torch_dist` checkpoint (ours or Megatron-LM's) as one full (TP=1, PP=1) local-spec state dict.

The stored global tensors already are the TP=1/PP=1 tensors (SwiGLU fc1 as `[all gate; all up]`, the tied
output weight stored once under the embedding key), except that homogeneous layers are stacked along a
leading layer axis (`decoder.layers.<name>` with shape [num_layers, ...]) and the norms fused into the next
linear layer carry Transformer Engine names. Both are undone here; optimizer state is skipped.
"""
import os
from typing import Any, Dict, Optional, Tuple

from megatron.core import dist_checkpointing
from tools.checkpoint.model_description import ModelDescription

_TE_TO_LOCAL = (
    ("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
    ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."),
)
_STACKED = "decoder.layers."


def _local_name(layer_key: str) -> str:
    for te_prefix, local_prefix in _TE_TO_LOCAL:
        if layer_key.startswith(te_prefix):
            return local_prefix + layer_key[len(te_prefix):]
    return layer_key


def is_dist_checkpoint(iter_dir: str) -> bool:
    """True for a complete torch_dist iteration directory (its metadata.json exists and parses)."""
    return dist_checkpointing.check_is_distributed_checkpoint(iter_dir)


def read_dist_checkpoint(iter_dir: str, desc_from_args) -> Tuple[Dict[str, Any], Any, Optional[int], ModelDescription]:
    """(full model state dict, checkpoint args, iteration, ModelDescription) of a torch_dist directory."""
    common = dist_checkpointing.load_common_state_dict(iter_dir)
    if "args" not in common:
        raise ValueError(f"{os.path.join(iter_dir, 'common.pt')} has no 'args' entry: the model shape is unknown")
    tensors = dist_checkpointing.load_plain_tensors(iter_dir)
    full: Dict[str, Any] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer.") or not key.startswith(("embedding.", "decoder.", "output_layer.")):
            continue
        rest = key[len(_STACKED):] if key.startswith(_STACKED) else None
        if rest is None:
            full[key] = value
        elif rest.split(".", 1)[0].isdigit():
            index, name = rest.split(".", 1)
            full[f"{_STACKED}{index}.{_local_name(name)}"] = value
        else:
            for index in range(value.shape[0]):
                full[f"{_STACKED}{index}.{_local_name(rest)}"] = value[index].clone()
    _unstack_experts(full)
    args = common["args"]
    return full, args, common.get("iteration"), desc_from_args(args)


_STACKED_EXPERTS = ".mlp.experts.experts."


def _unstack_experts(full: Dict[str, Any]) -> None:
    """Megatron stores every expert layout's weights stacked over the experts (`mlp.experts.experts.linear_fc1.weight`
    [E, 2f, h] once the layer axis is gone): split into SequentialMLP keys `mlp.experts.local_experts.<e>.*`."""
    for key in [k for k in full if _STACKED_EXPERTS in k]:
        value = full.pop(key)
        if key.endswith("._extra_state") or not hasattr(value, "shape"):
            continue
        head, name = key.split(_STACKED_EXPERTS)
        for expert in range(value.shape[0]):
            full[f"{head}.mlp.experts.local_experts.{expert}.{name}"] = value[expert].clone()
