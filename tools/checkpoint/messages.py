"""The loader -> saver message protocol of `convert.py` (Megatron's names, spec §8.3).

First a metadata Namespace (`md`), then named dicts of full, unsharded tensors: "embeddings",
"transformer layer N", "final norm", "output layer" (untied only), then the string "done". A loader
that fails puts "exit". Extensions of this project: "q norm weight"/"k norm weight" (qk layernorm).
"""
import argparse
from typing import Any, Dict, Optional

import torch

from tools.checkpoint.model_description import ModelDescription, from_megatron_args

# (message key, Megatron local-spec suffix) per layer; the bias entries are sent when present.
_LAYER_KEYS = (
    ("input norm weight", "input_layernorm.weight"), ("input norm bias", "input_layernorm.bias"),
    ("qkv weight", "self_attention.linear_qkv.weight"), ("qkv bias", "self_attention.linear_qkv.bias"),
    ("q norm weight", "self_attention.q_layernorm.weight"), ("k norm weight", "self_attention.k_layernorm.weight"),
    ("dense weight", "self_attention.linear_proj.weight"), ("dense bias", "self_attention.linear_proj.bias"),
    ("post norm weight", "pre_mlp_layernorm.weight"), ("post norm bias", "pre_mlp_layernorm.bias"),
    ("mlp l1 weight", "mlp.linear_fc2.weight"), ("mlp l1 bias", "mlp.linear_fc2.bias"),
)
_EXTRA_STATE = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def make_metadata(desc: ModelDescription, checkpoint_args: Dict[str, Any], iteration: Optional[int],
                  previous_tp: int = 1, previous_pp: int = 1) -> argparse.Namespace:
    """The `md` Namespace a loader sends first."""
    return argparse.Namespace(
        model_type="GPT", num_layers=desc.num_layers, hidden_size=desc.hidden_size,
        seq_length=desc.max_position_embeddings, num_attention_heads=desc.num_attention_heads,
        max_position_embeddings=desc.max_position_embeddings, tokenizer_type=checkpoint_args.get("tokenizer_type"),
        iteration=iteration, params_dtype=desc.params_dtype, bert_binary_head=False,
        output_layer=not desc.tie_embeddings, position_embedding_type=desc.position_embedding_type,
        linear_bias=desc.add_bias_linear, qkv_bias=desc.qkv_has_bias, norm_has_bias=desc.normalization == "LayerNorm",
        swiglu=desc.swiglu, previous_tensor_parallel_size=previous_tp, previous_pipeline_parallel_size=previous_pp,
        true_vocab_size=desc.true_vocab_size, make_vocab_size_divisible_by=checkpoint_args.get("make_vocab_size_divisible_by"),
        checkpoint_args=checkpoint_args, use_legacy_models=False,
        consumed_train_samples=checkpoint_args.get("consumed_train_samples", 0),
        consumed_valid_samples=checkpoint_args.get("consumed_valid_samples", 0),
    )


def _put(queue, name: str, msg: Dict[str, Any]) -> None:
    msg["name"] = name
    queue.put(msg)


def send_model(queue, md: argparse.Namespace, full: Dict[str, Any], desc: ModelDescription) -> None:
    """Send `md` and the full state dict `full` (local-spec names) as protocol messages."""
    queue.put(md)
    embeddings = {"word embeddings": full["embedding.word_embeddings.weight"]}
    if desc.position_embedding_type == "learned_absolute":
        embeddings["position embeddings"] = full["embedding.position_embeddings.weight"]
    _put(queue, "embeddings", embeddings)
    for i in range(desc.num_layers):
        prefix = f"decoder.layers.{i}."
        msg = {key: full[prefix + suffix] for key, suffix in _LAYER_KEYS if prefix + suffix in full}
        fc1_w, fc1_b = full[prefix + "mlp.linear_fc1.weight"], full.get(prefix + "mlp.linear_fc1.bias")
        if desc.swiglu:
            msg["mlp l0 weight W"], msg["mlp l0 weight V"] = torch.chunk(fc1_w, 2, dim=0)
            if fc1_b is not None:
                msg["mlp l0 bias W"], msg["mlp l0 bias V"] = torch.chunk(fc1_b, 2, dim=0)
        else:
            msg["mlp l0 weight"] = fc1_w
            if fc1_b is not None:
                msg["mlp l0 bias"] = fc1_b
        _put(queue, f"transformer layer {i}", msg)
    final = {"weight": full["decoder.final_layernorm.weight"]}
    if "decoder.final_layernorm.bias" in full:
        final["bias"] = full["decoder.final_layernorm.bias"]
    _put(queue, "final norm", final)
    if not desc.tie_embeddings:
        _put(queue, "output layer", {"weight": full["output_layer.weight"]})
    queue.put("done")


class ConversionAborted(RuntimeError):
    """The loader sent "exit"."""


def _get(queue, name: Optional[str], checking: bool):
    value = queue.get()
    if value == "exit":
        raise ConversionAborted("the loader exited; nothing was saved")
    if checking and name is not None and (not isinstance(value, dict) or value.get("name") != name):
        got = value.get("name") if isinstance(value, dict) else value
        raise ValueError(f"unexpected message {got!r}, expected {name!r}")
    return value


def receive_model(queue, checking: bool = True):
    """(md, full state dict with local-spec names and `_extra_state` entries, ModelDescription)."""
    md = _get(queue, None, checking)
    desc = from_megatron_args(md.checkpoint_args)
    desc.true_vocab_size = md.true_vocab_size
    full: Dict[str, Any] = {}
    embeddings = _get(queue, "embeddings", checking)
    full["embedding.word_embeddings.weight"] = embeddings["word embeddings"]
    if "position embeddings" in embeddings:
        full["embedding.position_embeddings.weight"] = embeddings["position embeddings"]
    for i in range(md.num_layers):
        msg = _get(queue, f"transformer layer {i}", checking)
        prefix = f"decoder.layers.{i}."
        for key, suffix in _LAYER_KEYS:
            if key in msg:
                full[prefix + suffix] = msg[key]
        if "mlp l0 weight W" in msg:
            full[prefix + "mlp.linear_fc1.weight"] = torch.cat([msg["mlp l0 weight W"], msg["mlp l0 weight V"]])
            if "mlp l0 bias W" in msg:
                full[prefix + "mlp.linear_fc1.bias"] = torch.cat([msg["mlp l0 bias W"], msg["mlp l0 bias V"]])
        else:
            full[prefix + "mlp.linear_fc1.weight"] = msg["mlp l0 weight"]
            if "mlp l0 bias" in msg:
                full[prefix + "mlp.linear_fc1.bias"] = msg["mlp l0 bias"]
        for name in _EXTRA_STATE:
            full[f"{prefix}{name}._extra_state"] = None
    final = _get(queue, "final norm", checking)
    full["decoder.final_layernorm.weight"] = final["weight"]
    if "bias" in final:
        full["decoder.final_layernorm.bias"] = final["bias"]
    if md.output_layer:
        full["output_layer.weight"] = _get(queue, "output layer", checking)["weight"]
    full["output_layer._extra_state"] = None
    done = queue.get()
    if done != "done":
        raise ValueError(f"expected the final 'done' message, got {done!r}")
    return md, full, desc
