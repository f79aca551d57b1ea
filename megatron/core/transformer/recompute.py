"""Activation recompute as wrappers: a module's forward is replaced by a checkpointed call of itself.

Layers stay free of recompute branches (style rule 7). `checkpoint_forward(module)` rebinds the
module's `forward` so that, in training with autograd on, it runs through `tensor_parallel.checkpoint`
(which saves and restores the CPU/CUDA and tracker RNG states, so dropout replays exactly). Parameter
names and state-dict keys do not change.
"""
import torch

from megatron.core import tensor_parallel
from megatron.core.transformer.identity_op import IdentityOp


def checkpointed_call(function, distribute_saved_activations: bool, *args, **kwargs):
    """Run `function(*args, **kwargs)` through `tensor_parallel.checkpoint`.

    `tensor_parallel.checkpoint` takes positional tensors only, so non-tensor arguments (None, enums,
    flags) are bound into a closure and only the tensors are passed through it. Outputs that are leaf
    parameters (an MLP's skipped fc2 bias) are handed back outside the checkpoint: returned from inside,
    autograd would attach the checkpoint node to the parameter itself.
    """
    names = list(kwargs)
    flat = list(args) + [kwargs[name] for name in names]
    tensor_positions = [i for i, value in enumerate(flat) if torch.is_tensor(value)]
    leaf_outputs = {}

    def run(*tensors):
        values = list(flat)
        for position, tensor in zip(tensor_positions, tensors):
            values[position] = tensor
        outputs = function(*values[: len(args)], **dict(zip(names, values[len(args):])))
        if not isinstance(outputs, tuple):
            return outputs
        kept = []
        for index, output in enumerate(outputs):
            if torch.is_tensor(output) and output.is_leaf and output.requires_grad:
                leaf_outputs[index] = output
                output = None
            kept.append(output)
        return tuple(kept)

    outputs = tensor_parallel.checkpoint(run, distribute_saved_activations, *[flat[i] for i in tensor_positions])
    if leaf_outputs:
        outputs = tuple(leaf_outputs.get(index, output) for index, output in enumerate(outputs))
    return outputs


def checkpoint_forward(module: torch.nn.Module, distribute_saved_activations: bool = False) -> torch.nn.Module:
    """Make `module` recompute its forward during backward (in training, with grad enabled)."""
    original_forward = module.forward

    def forward(*args, **kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return original_forward(*args, **kwargs)
        return checkpointed_call(original_forward, distribute_saved_activations, *args, **kwargs)

    module.forward = forward
    module.is_recomputed = True
    return module


def checkpoint_method(module: torch.nn.Module, name: str, distribute_saved_activations: bool = False) -> None:
    """Make `module.<name>` (a method returning tensors) recompute during backward, in training with grad on."""
    original = getattr(module, name)

    def method(*args, **kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return original(*args, **kwargs)
        return checkpointed_call(original, distribute_saved_activations, *args, **kwargs)

    setattr(module, name, method)


def apply_selective_recompute(layer: torch.nn.Module, recompute_modules) -> None:
    """Wrap the parts of a transformer layer named in `recompute_modules` (selective granularity)."""
    targets = {
        "core_attn": [getattr(getattr(layer, "self_attention", None), "core_attention", None)],
        "mlp": [getattr(layer, "mlp", None)],
        "layernorm": [getattr(layer, "input_layernorm", None), getattr(layer, "pre_mlp_layernorm", None)],
        "moe_act": [],
    }
    attention = getattr(layer, "self_attention", None)
    if "mla_up_proj" in recompute_modules and hasattr(attention, "up_projection"):
        checkpoint_method(attention, "up_projection")  # MLA: q/kv up projections and RoPE
    for name in recompute_modules:
        for module in targets.get(name, []):
            if module is not None and not _is_identity(module):
                checkpoint_forward(module)


def _is_identity(module: torch.nn.Module) -> bool:
    return isinstance(module, IdentityOp)


__all__ = ["checkpointed_call", "checkpoint_forward", "checkpoint_method", "apply_selective_recompute"]
