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


__all__ = ["swiglu", "bias_swiglu", "swiglu_back", "bias_swiglu_impl", "SwiGLUFunction"]
