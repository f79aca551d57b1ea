"""Bias + SwiGLU: silu(gate) * up where the last dimension holds [gate, up]."""
import torch
import torch.nn.functional as F

from megatron.core.fusions import _triton_swiglu
from megatron.core.fusions._compile import CudaCompiled, eager_fusions_requested


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for y = [gate, up] along the last dimension."""
    gate, up = torch.chunk(y, 2, -1)
    return F.silu(gate) * up


def bias_swiglu(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """swiglu(y + bias)."""
    return swiglu(y + bias)


def swiglu_back(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Gradient of swiglu at y times `g` (returned as [d gate, d up])."""
    gate, up = torch.chunk(y, 2, -1)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    d_gate = g * up * (sig * (1 + gate * (1 - sig)))
    d_up = g * silu
    return torch.cat((d_gate, d_up), -1)


_swiglu = CudaCompiled(swiglu)
_swiglu_back = CudaCompiled(swiglu_back)


@torch.library.custom_op("megatron_core::swiglu_back", mutates_args=())
def swiglu_back_triton(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`swiglu_back` as one Triton kernel (`_triton_swiglu`): a custom op, so that a compiled layer calls it as
    one opaque step instead of generating its own, slower pointwise kernel."""
    return _triton_swiglu.swiglu_back(g, y)


@swiglu_back_triton.register_fake
def _swiglu_back_triton_fake(g, y):
    return torch.empty_like(y)


def _swiglu_backward(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The Triton kernel where it applies (CUDA, contiguous; not under `--fusion-kernels eager`), else the
    compiled (CUDA) or eager (CPU) `swiglu_back`."""
    if _triton_swiglu.usable(g, y) and not eager_fusions_requested():
        return swiglu_back_triton(g, y)
    return _swiglu_back(g, y)


def bias_swiglu_back(g: torch.Tensor, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Gradient of bias_swiglu with respect to y (the bias's before its reduction over tokens)."""
    return swiglu_back(g, y + bias)


class BiasSwiGLUFunction(torch.autograd.Function):
    """swiglu(input + bias), saving input and bias (optionally the input in FP8) for backward."""

    @staticmethod
    def forward(ctx, input, bias, fp8_input_store, cpu_offload_input=False):
        ctx.input_dtype = input.dtype
        ctx.fp8_input_store = fp8_input_store
        ctx.save_for_backward(input.to(torch.float8_e4m3fn) if fp8_input_store else input, bias)
        return bias_swiglu(input, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, bias = ctx.saved_tensors
        if ctx.fp8_input_store:
            input = input.to(ctx.input_dtype)
        grad = bias_swiglu_back(grad_output, input, bias)
        bias_grad = grad.reshape(-1, grad.shape[-1]).sum(0).reshape(bias.shape)  # [..., 2f] -> [2f]
        return grad, bias_grad, None, None


class SwiGLUFunction(torch.autograd.Function):
    """SwiGLU saving only its input for backward."""

    @staticmethod
    def forward(ctx, input):
        ctx.save_for_backward(input)
        return _swiglu(input)

    @staticmethod
    def backward(ctx, grad_output):
        (input,) = ctx.saved_tensors
        return _swiglu_backward(grad_output, input)


def bias_swiglu_impl(input: torch.Tensor, bias, fp8_input_store: bool = False, cpu_offload_input: bool = False):
    """swiglu(input + bias); `bias` may be None. Works on [s, b, 2f] or [tokens, 2f] inputs."""
    if bias is not None:
        input = input + bias
    return SwiGLUFunction.apply(input)


def weighted_swiglu(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """swiglu(y) * weights, returned in y's dtype (weights [tokens, 1], e.g. fp32 router probabilities)."""
    return (swiglu(y) * weights).to(y.dtype)


def weighted_swiglu_back(g: torch.Tensor, y: torch.Tensor, weights: torch.Tensor):
    """Gradients of `weighted_swiglu` at (y, weights) for output gradient g: (d y in y's dtype, d weights in
    the weights' dtype). The weight gradient is the sum over the last dimension of swiglu(y) * g, computed
    in the weights' precision (router probabilities are often fp32 while y and g are bf16)."""
    input_grad = swiglu_back(g * weights, y)
    weights_grad = (swiglu(y).to(weights.dtype) * g.to(weights.dtype)).sum(dim=-1, keepdim=True)
    return input_grad.to(y.dtype), weights_grad


class WeightedSwiGLUFunction(torch.autograd.Function):
    """swiglu(input) * weights, saving the input (optionally in FP8) and the weights for backward."""

    @staticmethod
    def forward(ctx, input, weights, fp8_input_store):
        ctx.input_dtype = input.dtype
        ctx.fp8_input_store = fp8_input_store
        ctx.save_for_backward(input.to(torch.float8_e4m3fn) if fp8_input_store else input, weights)
        return weighted_swiglu(input, weights)

    @staticmethod
    def backward(ctx, grad_output):
        input, weights = ctx.saved_tensors
        if ctx.fp8_input_store:
            input = input.to(ctx.input_dtype)
        input_grad, weights_grad = weighted_swiglu_back(grad_output, input, weights)
        return input_grad, weights_grad, None


def weighted_bias_swiglu_impl(input: torch.Tensor, bias, weights: torch.Tensor, fp8_input_store: bool = False):
    """SwiGLU of each token's fc1 output scaled by its routing probability (MoE experts).

    `input` is [tokens, 2f] or [s, b, 2f]; `weights` holds one value per token ([tokens, 1]). `bias` must be
    None (as in Megatron: the experts apply probabilities only without fc1 bias); `fp8_input_store` keeps the
    saved input in FP8 (E4M3) to halve its memory, at FP8 precision in the backward.
    """
    if input.dim() not in (2, 3):
        raise ValueError(f"weighted_bias_swiglu_impl expects a [tokens, 2f] or [s, b, 2f] input, got "
                         f"{tuple(input.shape)}")
    if bias is not None:
        raise ValueError("weighted_bias_swiglu_impl: a bias is not supported with probability-weighted SwiGLU "
                         "(use add_bias_linear=False for the experts).")
    shape = input.shape
    flat = input.reshape(-1, shape[-1])  # [s, b, 2f] -> [s*b, 2f]
    output = WeightedSwiGLUFunction.apply(flat, weights, fp8_input_store)
    return output if input.dim() == 2 else output.view(shape[0], shape[1], -1)  # [s*b, f] -> [s, b, f]


__all__ = ["swiglu", "bias_swiglu", "swiglu_back", "bias_swiglu_back", "bias_swiglu_impl", "SwiGLUFunction",
           "BiasSwiGLUFunction", "weighted_swiglu",
           "weighted_swiglu_back", "WeightedSwiGLUFunction", "weighted_bias_swiglu_impl"]
