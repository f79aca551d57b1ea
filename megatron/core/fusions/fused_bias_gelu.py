"""Bias + GELU (tanh approximation, as Megatron's fused kernel), forward and backward."""
import torch

from megatron.core.fusions._compile import CudaCompiled


def bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(y + bias)."""
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def bias_gelu_back(g: torch.Tensor, bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """d gelu_tanh(y + bias) / dx times `g`."""
    x = bias + y
    tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
    return ff * g


_bias_gelu = CudaCompiled(bias_gelu)
_bias_gelu_back = CudaCompiled(bias_gelu_back)


class GeLUFunction(torch.autograd.Function):
    """Fused bias-GELU; saves only the two inputs for backward."""

    @staticmethod
    def forward(ctx, input, bias):
        ctx.save_for_backward(input, bias)
        return _bias_gelu(bias, input)

    @staticmethod
    def backward(ctx, grad_output):
        input, bias = ctx.saved_tensors
        tmp = _bias_gelu_back(grad_output, bias, input)
        return tmp, tmp


def bias_gelu_impl(input: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu(input + bias) with a hand-written backward; `bias` may be None."""
    if bias is None:
        return GeLUFunction.apply(input, torch.zeros((), dtype=input.dtype, device=input.device))
    return GeLUFunction.apply(input, bias)


__all__ = ["bias_gelu", "bias_gelu_back", "bias_gelu_impl", "GeLUFunction"]
