"""Scale + mask + softmax of attention scores (`FusedScaleMaskSoftmax` and its three autograd functions).

Megatron's versions call Apex's CUDA extensions (`scaled_upper_triang_masked_softmax_cuda`, ...); these are
the same operations in PyTorch, on any device. Their numerics follow the kernels: fp16/bf16 scores are
read, scaled, masked and normalised in fp32 and the probabilities rounded once to the input's dtype; the
backward uses those saved probabilities: `dx = scale * y * (dy - sum(dy * y))`, in fp32, rounded once.

Masks are boolean (True = masked out). The causal kernel gives masked positions probability exactly 0;
the padding-mask kernel, like `attention_mask_func`, replaces masked scores by -10000 before the softmax
(so a fully masked row comes out uniform, as Megatron's does).
"""
from typing import Callable, Optional, Tuple

import torch

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import get_default_causal_mask, get_sliding_window_causal_mask

_MASKED_SCORE = -10000.0


def _softmax_backward(grad_output: torch.Tensor, probs: torch.Tensor, scale: float) -> torch.Tensor:
    """Gradient of softmax(scale * x) at the saved probabilities, in fp32, in the gradient's dtype."""
    y = probs.float()
    g = grad_output.float()
    grad = y * (g - (g * y).sum(dim=-1, keepdim=True))
    return (grad * scale).to(grad_output.dtype)


class ScaledUpperTriangMaskedSoftmax(torch.autograd.Function):
    """softmax(scale * x) with key j > query i masked out, for x of shape [attn_batches, sq, sk] (sq == sk)."""

    @staticmethod
    def forward(ctx, inputs: torch.Tensor, scale: float) -> torch.Tensor:
        if inputs.dim() != 3 or inputs.size(1) != inputs.size(2):
            raise ValueError(f"ScaledUpperTriangMaskedSoftmax expects [attn_batches, sq, sq] scores, got "
                             f"{tuple(inputs.shape)}")
        sq = inputs.size(1)
        scores = inputs.float() * scale
        scores = scores.masked_fill(get_default_causal_mask(sq, device=inputs.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(inputs.dtype)
        ctx.scale = scale
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, output_grads: torch.Tensor) -> Tuple[torch.Tensor, None]:
        (probs,) = ctx.saved_tensors
        return _softmax_backward(output_grads, probs, ctx.scale), None


class ScaledMaskedSoftmax(torch.autograd.Function):
    """softmax(scale * x) with masked scores set to -10000; x [b, np, sq, sk], mask [b or 1, 1, sq, sk] bool."""

    @staticmethod
    def forward(ctx, inputs: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        scores = inputs.float() * scale
        scores = scores.masked_fill(mask.to(torch.bool), _MASKED_SCORE)
        probs = torch.softmax(scores, dim=-1).to(inputs.dtype)
        ctx.scale = scale
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, output_grads: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        (probs,) = ctx.saved_tensors
        return _softmax_backward(output_grads, probs, ctx.scale), None, None


class ScaledSoftmax(torch.autograd.Function):
    """softmax(scale * x) with no mask, for x of shape [b, np, sq, sk]."""

    @staticmethod
    def forward(ctx, inputs: torch.Tensor, scale: float) -> torch.Tensor:
        probs = torch.softmax(inputs.float() * scale, dim=-1).to(inputs.dtype)
        ctx.scale = scale
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, output_grads: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        (probs,) = ctx.saved_tensors
        return _softmax_backward(output_grads, probs, ctx.scale), None, None


class FusedScaleMaskSoftmax(torch.nn.Module):
    """Scale, mask and softmax attention scores [b, np, sq, sk] (Megatron's constructor and dispatch).

    Args:
        input_in_fp16: the scores are fp16.
        input_in_bf16: the scores are bf16.
        attn_mask_type: `AttnMaskType.causal` builds the causal mask itself (no mask needed); otherwise the
            given mask (or none) is applied.
        scaled_masked_softmax_fusion: use the fused functions when the shape allows (Megatron's kernel limits).
        mask_func: `mask_func(scores, mask)` for the unfused path (e.g. `attention_mask_func`).
        softmax_in_fp32: the unfused path computes the softmax of fp16/bf16 scores in fp32.
        scale: multiply the scores by this before masking (None: 1); needs `softmax_in_fp32`.
        window_size: (left, right) sliding-window attention; always takes the unfused path.
    """

    def __init__(
        self,
        input_in_fp16: bool,
        input_in_bf16: bool,
        attn_mask_type: AttnMaskType,
        scaled_masked_softmax_fusion: bool,
        mask_func: Callable,
        softmax_in_fp32: bool,
        scale: Optional[float],
        window_size: Optional[Tuple[int, int]] = None,
    ):
        super().__init__()
        problems = []
        if input_in_fp16 and input_in_bf16:
            problems.append("input_in_fp16 and input_in_bf16 are both True: the scores have one dtype, set one.")
        if scale is not None and not softmax_in_fp32:
            problems.append(f"scale={scale} needs softmax_in_fp32=True (a scaled softmax runs in fp32).")
        if problems:
            raise ValueError("FusedScaleMaskSoftmax: " + " ".join(problems))
        self.input_in_fp16 = input_in_fp16
        self.input_in_bf16 = input_in_bf16
        self.input_in_float16 = input_in_fp16 or input_in_bf16
        self.attn_mask_type = attn_mask_type
        self.scaled_masked_softmax_fusion = scaled_masked_softmax_fusion
        self.mask_func = mask_func
        self.softmax_in_fp32 = softmax_in_fp32
        self.scale = scale
        self.window_size = window_size

    def forward(self, input: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Probabilities [b, np, sq, sk] of the scores `input`; `mask` may be None for causal attention."""
        if input.dim() != 4:
            raise ValueError(f"FusedScaleMaskSoftmax expects [b, np, sq, sk] scores, got {tuple(input.shape)}")
        if self.is_kernel_available(mask, *input.size()):
            return self.forward_fused_softmax(input, mask)
        return self.forward_torch_softmax(input, mask)

    def is_kernel_available(self, mask: Optional[torch.Tensor], b: int, np: int, sq: int, sk: int) -> bool:
        """Whether Megatron's fused kernel would take these scores (same limits, so both pick the same path)."""
        attn_batches = b * np
        if not (self.scaled_masked_softmax_fusion and self.input_in_float16 and self.window_size is None):
            return False
        if not (16 < sk <= 4096 and sq % 4 == 0 and sk % 4 == 0 and attn_batches % 4 == 0):
            return False
        batch_per_block = self.get_batch_per_block(sq, sk, b, np)
        if self.attn_mask_type == AttnMaskType.causal:
            return attn_batches % batch_per_block == 0
        return sq % batch_per_block == 0

    def forward_fused_softmax(self, input: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """The fused functions: causal, masked or plain scaled softmax."""
        b, np, sq, sk = input.size()
        scale = self.scale if self.scale is not None else 1.0
        if self.attn_mask_type == AttnMaskType.causal:
            if sq != sk:
                raise ValueError(f"causal softmax needs sq == sk (self-attention), got sq={sq}, sk={sk}")
            probs = ScaledUpperTriangMaskedSoftmax.apply(input.reshape(-1, sq, sk), scale)  # [b, np, sq, sk] -> [b*np, sq, sk]
            return probs.view(b, np, sq, sk)  # [b*np, sq, sk] -> [b, np, sq, sk]
        if mask is not None:
            return ScaledMaskedSoftmax.apply(input, mask, scale)
        return ScaledSoftmax.apply(input, scale)

    def forward_torch_softmax(self, input: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Plain PyTorch: optional fp32 upcast, scale, mask (built for causal / sliding window), softmax."""
        if self.input_in_float16 and self.softmax_in_fp32:
            input = input.float()
        if self.scale is not None:
            input = input * self.scale
        sq, sk = input.size(2), input.size(3)
        if self.window_size is not None:
            mask = get_sliding_window_causal_mask(sq, sk, self.window_size, device=input.device)
        elif self.attn_mask_type == AttnMaskType.causal and mask is None and sq > 1:
            # sq == 1 is one decoding step against a KV cache: every key is in the past, nothing is masked.
            if sq != sk:
                raise ValueError(f"causal softmax needs sq == sk (self-attention), got sq={sq}, sk={sk}")
            mask = get_default_causal_mask(sq, device=input.device)
        masked = self.mask_func(input, mask) if mask is not None else input
        probs = torch.nn.Softmax(dim=-1)(masked)
        if self.input_in_float16 and self.softmax_in_fp32:
            probs = probs.half() if self.input_in_fp16 else probs.bfloat16()
        return probs

    @staticmethod
    def get_batch_per_block(sq: int, sk: int, b: int, np: int) -> int:
        """Rows of scores one 128-thread block of Megatron's softmax kernel handles for key length `sk`."""
        next_power_of_two = 1 << max(0, (sk - 1).bit_length())
        warp_size = min(next_power_of_two, 32)
        batches_per_warp = 2 if next_power_of_two <= 128 else 1
        warps_per_block = 128 // warp_size
        return warps_per_block * batches_per_warp


__all__ = ["FusedScaleMaskSoftmax", "ScaledUpperTriangMaskedSoftmax", "ScaledMaskedSoftmax", "ScaledSoftmax"]
