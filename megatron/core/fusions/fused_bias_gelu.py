"""Bias + GELU (tanh approximation, as Megatron's fused kernel), forward and backward."""
import torch

from megatron.core.fusions._compile import CudaCompiled


# gelu_tanh(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), written as x * sigmoid(2u) (the same
# function: 1 + tanh(u) = 2 sigmoid(2u)). Compiled, tanh becomes a long libdevice routine that made the GELU
# kernels compute-bound on an H200 (at GPT-1.3B's fc1 output: forward 3.0 TB/s, backward 3.8; 2.6 and 3.2
# inside the compiled layers); with sigmoid, an exponential and a division, 3.8 and 4.2
# (benchmarks/gpu/activation_bench.py, docs/performance.md).
_TWO_SQRT_2_OVER_PI = 1.5957691216057308
_Z_CUBIC = 0.07135481627260025  # 0.044715 * 2 sqrt(2/pi): z = 2u = x (1.5957... + 0.0713... x^2)
_DZ_SQUARE = 0.21406444881780073  # 3 * 0.044715 * 2 sqrt(2/pi): dz/dx = 1.5957... + 0.2140... x^2


def bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(y + bias)."""
    x = bias + y
    return x * torch.sigmoid(x * (_TWO_SQRT_2_OVER_PI + _Z_CUBIC * x * x))


def bias_gelu_back(g: torch.Tensor, bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """d gelu_tanh(y + bias) / dx times `g`: s + x s (1 - s) dz/dx with s = sigmoid(z), z = 2u."""
    x = bias + y
    s = torch.sigmoid(x * (_TWO_SQRT_2_OVER_PI + _Z_CUBIC * x * x))
    ff = s + x * s * (1 - s) * (_TWO_SQRT_2_OVER_PI + _DZ_SQUARE * x * x)
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
