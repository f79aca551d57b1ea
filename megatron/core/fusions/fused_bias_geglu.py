"""Bias + GeGLU: gelu(gate) * up for y = [gate, up] along the last dimension, with the tanh-approximated GELU
(Megatron's `fused_bias_geglu`). Saves only the input for the backward."""
import math

import torch

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def geglu(y: torch.Tensor) -> torch.Tensor:
    """0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) * u for y = [g, u]."""
    gate, up = torch.chunk(y, 2, -1)
    return (gate * 0.5 * (1.0 + torch.tanh(_SQRT_2_OVER_PI * gate * (1 + 0.044715 * gate * gate)))) * up


def bias_geglu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """geglu(y + bias) (Megatron's argument order: bias first)."""
    return geglu(y + bias)


def geglu_back(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Gradient of geglu at y times the output gradient g, as [d gate, d up]."""
    gate, up = torch.chunk(y, 2, -1)
    tanh_out = torch.tanh(_SQRT_2_OVER_PI * gate * (1 + 0.044715 * gate * gate))
    # d/dg of 0.5 g (1 + tanh(k (g + c g^3))) = 0.5 (1 + tanh) + 0.5 g (1 - tanh^2) k (1 + 3 c g^2)
    d_gelu = 0.5 * (1 + tanh_out) + 0.5 * gate * (1 - tanh_out * tanh_out) * _SQRT_2_OVER_PI * (
        1 + 3 * 0.044715 * gate * gate)
    gelu = gate * 0.5 * (1 + tanh_out)
    return torch.cat((g * up * d_gelu, g * gelu), -1)


def bias_geglu_back(g: torch.Tensor, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Gradient of bias_geglu with respect to y (equal to that of the bias before its reduction)."""
    return geglu_back(g, y + bias)


class BiasGeGLUFunction(torch.autograd.Function):
    """geglu(input + bias), saving input and bias."""

    @staticmethod
    def forward(ctx, input, bias):
        ctx.save_for_backward(input, bias)
        return bias_geglu(bias, input)

    @staticmethod
    def backward(ctx, grad_output):
        input, bias = ctx.saved_tensors
        grad = bias_geglu_back(grad_output, input, bias)
        bias_grad = grad.reshape(-1, grad.shape[-1]).sum(0).reshape(bias.shape)  # [..., 2f] -> [2f]
        return grad, bias_grad


class GeGLUFunction(torch.autograd.Function):
    """geglu(input), saving only the input."""

    @staticmethod
    def forward(ctx, input):
        ctx.save_for_backward(input)
        return geglu(input)

    @staticmethod
    def backward(ctx, grad_output):
        (input,) = ctx.saved_tensors
        return geglu_back(grad_output, input)


def bias_geglu_impl(input: torch.Tensor, bias) -> torch.Tensor:
    """geglu(input + bias) on [s, b, 2f] or [tokens, 2f]; `bias` may be None."""
    if input.dim() not in (2, 3):
        raise ValueError(f"bias_geglu_impl expects a [tokens, 2f] or [s, b, 2f] input, got {tuple(input.shape)}")
    shape = input.shape
    flat = input.reshape(-1, shape[-1])  # [s, b, 2f] -> [s*b, 2f]
    output = BiasGeGLUFunction.apply(flat, bias) if bias is not None else GeGLUFunction.apply(flat)
    return output if input.dim() == 2 else output.view(shape[0], shape[1], -1)  # [s*b, f] -> [s, b, f]


__all__ = ["geglu", "bias_geglu", "geglu_back", "bias_geglu_back", "BiasGeGLUFunction", "GeGLUFunction",
           "bias_geglu_impl"]
