"""The fused QKV projection's output split into queries, keys and values, with rotary position embeddings
applied to queries and keys: one Triton kernel forward and one backward on CUDA (`_triton_qkv_rope`).
Elsewhere (CPU, interleaved rotation, `--fusion-kernels eager`; packed sequences and q/k norms are left to
the caller too) `try_fused_qkv_rope` returns None and self-attention splits and rotates the plain way.

The kernels are custom ops, so a compiled transformer layer calls them as opaque steps instead of generating
its own kernels for the rotation (which recomputed cos and sin for every element) and for the concatenation
of the three gradients in the backward.
"""
from typing import Optional, Tuple

import torch

from megatron.core.fusions import _triton_qkv_rope
from megatron.core.fusions._compile import eager_fusions_requested


@torch.library.custom_op("megatron_core::qkv_rope", mutates_args=())
def qkv_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads_per_group: int,
             head_dim: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [s, b, np, hn], k [s, b, ng, hn], v [s, b, ng, hn]) from `qkv` [s, b, ng * (np/ng + 2) * hn], queries
    and keys rotated with the tables cos/sin [s, rot] (`_triton_qkv_rope.forward`)."""
    return _triton_qkv_rope.forward(qkv, cos, sin, heads_per_group, head_dim)


@qkv_rope.register_fake
def _qkv_rope_fake(qkv, cos, sin, heads_per_group, head_dim):
    s, b, width = qkv.shape
    groups = width // ((heads_per_group + 2) * head_dim)
    q = qkv.new_empty(s, b, groups * heads_per_group, head_dim)
    return q, qkv.new_empty(s, b, groups, head_dim), qkv.new_empty(s, b, groups, head_dim)


@torch.library.custom_op("megatron_core::qkv_rope_backward", mutates_args=())
def qkv_rope_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      heads_per_group: int) -> torch.Tensor:
    """The gradient of `qkv_rope`'s input from those of its three outputs."""
    return _triton_qkv_rope.backward(dq, dk, dv, cos, sin, heads_per_group)


@qkv_rope_backward.register_fake
def _qkv_rope_backward_fake(dq, dk, dv, cos, sin, heads_per_group):
    s, b, groups, head_dim = dk.shape
    return dq.new_empty(s, b, groups * (heads_per_group + 2) * head_dim)


def _setup_context(ctx, inputs, output):
    _, cos, sin, heads_per_group, _ = inputs
    ctx.save_for_backward(cos, sin)
    ctx.heads_per_group = heads_per_group
    ctx.shapes = (output[0].shape, output[1].shape)


def _dense(grad, shape, like):
    """A gradient with a unit last stride (zeros for an output that received none)."""
    if grad is None:
        return like.new_zeros(shape)
    return grad if grad.stride(-1) == 1 else grad.contiguous()


def _backward(ctx, dq, dk, dv):
    cos, sin = ctx.saved_tensors
    q_shape, kv_shape = ctx.shapes
    dq, dk, dv = (_dense(grad, shape, cos) for grad, shape in ((dq, q_shape), (dk, kv_shape), (dv, kv_shape)))
    return qkv_rope_backward(dq, dk, dv, cos, sin, ctx.heads_per_group), None, None, None, None


qkv_rope.register_autograd(_backward, setup_context=_setup_context)


def fused_path_applies(qkv: torch.Tensor, freqs: torch.Tensor, config) -> bool:
    """Whether the Triton kernels may take these operands: CUDA, non-interleaved rotation, angles
    [s, 1, 1, rot] for exactly the sequence of `qkv`, not requiring a gradient (`usable` checks the rest)."""
    return (qkv.is_cuda and _triton_qkv_rope._HAVE_TRITON and not config.rotary_interleaved
            and not eager_fusions_requested() and torch.is_tensor(freqs) and not freqs.requires_grad
            and freqs.dim() == 4 and freqs.shape[1] == 1 and freqs.shape[2] == 1 and freqs.shape[0] == qkv.shape[0])


def try_fused_qkv_rope(qkv: torch.Tensor, freqs: torch.Tensor, heads_per_group: int, head_dim: int,
                       config) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(query [s, b, np, hn], key [s, b, ng, hn], value [s, b, ng, hn]) from the fused projection `qkv`
    [s, b, ng * (np/ng + 2) * hn], queries and keys rotated by the angles `freqs` [s, 1, 1, rot], through the
    Triton kernels; None where they do not apply (the caller splits and rotates the plain way)."""
    if not fused_path_applies(qkv, freqs, config):
        return None
    angles = freqs[:, 0, 0, :].to(device=qkv.device)  # [s, 1, 1, rot] -> [s, rot]
    # the tables `apply_rotary_pos_emb` builds (mscale 1): cos/sin in the angles' precision, in the activations' dtype
    cos = torch.cos(angles).to(qkv.dtype).contiguous()
    sin = torch.sin(angles).to(qkv.dtype).contiguous()
    if not _triton_qkv_rope.usable(qkv, cos, heads_per_group, head_dim):
        return None
    return qkv_rope(qkv, cos, sin, heads_per_group, head_dim)


__all__ = ["try_fused_qkv_rope", "fused_path_applies"]
