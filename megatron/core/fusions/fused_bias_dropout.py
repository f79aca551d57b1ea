"""Bias + dropout + residual add, the tail of every attention and MLP branch.

The dropout draws from the default generator (outside the model-parallel RNG fork), so it is identical
across tensor-parallel ranks unless the caller forks (as the transformer block does under sequence
parallelism, where each rank holds a different sequence shard).

Eval note (Megatron's behaviour, which callers may rely on): in eval mode, when neither input needs a
gradient, the sum is computed in place into x and x itself is returned.

Speed note: with dropout off (eval, or probability 0 as in the benchmark configs) no dropout op runs at
all (torch's dropout at p=0 in training mode still copies the tensor and writes a mask), and on CUDA the
bias add and the residual add are one compiled kernel. With dropout on, the chain stays eager so that
activation recompute replays the same random mask.
"""
from typing import Optional, Tuple

import torch

from megatron.core.fusions._compile import CudaCompiled


def _add_bias_and_residual(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return residual + (x + bias)


_add_bias_and_residual_compiled = CudaCompiled(_add_bias_and_residual)


def _bias_dropout_add_func(x_with_bias: Tuple[torch.Tensor, Optional[torch.Tensor]], residual, prob, training):
    """Megatron's semantics: the result has x's dtype (the residual is cast to it); in eval mode with no
    input needing a gradient the sum is written into x itself and x is returned (no new tensor)."""
    x, bias = x_with_bias
    if residual.dtype != x.dtype:
        residual = residual.to(x.dtype)
    needs_grad = x.requires_grad or residual.requires_grad or (bias is not None and bias.requires_grad)
    if not training and not needs_grad:
        if bias is not None:
            x.add_(bias)
        return x.add_(residual)
    if not training or prob == 0.0:
        if bias is None:
            return residual + x
        return _add_bias_and_residual_compiled(x, bias, residual)
    if bias is not None:
        x = x + bias
    out = torch.nn.functional.dropout(x, p=prob, training=training)
    return residual + out


def bias_dropout_add_unfused(training: bool):
    """The bias-dropout-add function for train or eval mode."""

    def _bias_dropout_add(x_with_bias, residual, prob):
        return _bias_dropout_add_func(x_with_bias, residual, prob, training)

    return _bias_dropout_add


def bias_dropout_add_fused_train(x_with_bias, residual, prob):
    """Training-mode bias-dropout-add (dropout kept eager so recompute replays it exactly)."""
    return _bias_dropout_add_func(x_with_bias, residual, prob, True)


def bias_dropout_add_fused_inference(x_with_bias, residual, prob):
    """Inference-mode bias-add + residual add."""
    return _bias_dropout_add_func(x_with_bias, residual, prob, False)


def get_bias_dropout_add(training: bool, fused: bool):
    """Megatron's factory: the bias-dropout-add callable for (training, fused)."""
    if fused:
        return bias_dropout_add_fused_train if training else bias_dropout_add_fused_inference
    return bias_dropout_add_unfused(training)


__all__ = ["get_bias_dropout_add", "bias_dropout_add_unfused"]
