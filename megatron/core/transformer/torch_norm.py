"""Native LayerNorm / RMSNorm / L2Norm built from a `TransformerConfig`.

Unlike Megatron's torch norm wrapper these honour `layernorm_zero_centered_gamma` (weight stored
zero-centred, applied as 1 + w) and sequence parallelism: the weight and bias carry the attribute
`sequence_parallel`, so their gradients (computed from this rank's sequence shard only) are summed over
the tensor-parallel group by `finalize_model_grads`. `persist_layer_norm` and
`memory_efficient_layer_norm` select Apex kernels in Megatron; here they are accepted and ignored.
"""
import torch
import torch.nn.functional as F

from megatron.core.fusions._compile import CudaCompiled
from megatron.core.transformer.transformer_config import TransformerConfig


class _TorchNorm(torch.nn.Module):
    """Shared parameter handling of the native norms."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float, zero_centered_gamma: bool, bias: bool):
        super().__init__()
        self.config = config
        self.hidden_size = (hidden_size,) if isinstance(hidden_size, int) else tuple(hidden_size)
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        self.sequence_parallel = config.sequence_parallel
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(self.hidden_size, dtype=config.params_dtype, device=device))
        self.bias = (
            torch.nn.Parameter(torch.empty(self.hidden_size, dtype=config.params_dtype, device=device)) if bias else None
        )
        self.reset_parameters()
        for param in (self.weight, self.bias):
            if param is not None:
                setattr(param, "sequence_parallel", self.sequence_parallel)

    def reset_parameters(self):
        """Weight 1 (0 when zero-centred), bias 0."""
        if self.zero_centered_gamma:
            torch.nn.init.zeros_(self.weight)
        else:
            torch.nn.init.ones_(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def _effective_weight(self) -> torch.Tensor:
        return self.weight + 1 if self.zero_centered_gamma else self.weight

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class LayerNorm(_TorchNorm):
    """LayerNorm over the last dimension with optional zero-centred gamma and sequence parallelism."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, zero_centered_gamma=None):
        zero_centered = config.layernorm_zero_centered_gamma if zero_centered_gamma is None else zero_centered_gamma
        super().__init__(config, hidden_size, eps, zero_centered, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.hidden_size, self._effective_weight(), self.bias, self.eps)


class RMSNorm(_TorchNorm):
    """RMSNorm over the last dimension with optional zero-centred gamma and sequence parallelism."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, zero_centered_gamma=None):
        zero_centered = config.layernorm_zero_centered_gamma if zero_centered_gamma is None else zero_centered_gamma
        super().__init__(config, hidden_size, eps, zero_centered, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self._effective_weight(), self.eps)


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm over the last dimension as ONE autograd node.

    torch's rms_norm is a composite op on CPU: its backward sums the input gradient from several
    internal uses, so the summation order (and the last bit) changes when the norm is recomputed
    inside a checkpoint. A single node keeps recompute bitwise identical. The backward is computed in
    fp32: with r = rsqrt(mean(x^2) + eps) and u = grad * w,
    dx = r * u - x * r^3 * mean(u * x),  dw = sum(grad * x * r).
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_x, grad_w = _rms_norm_backward(grad_output, x, weight, ctx.eps)
        return grad_x, grad_w, None


def _rms_norm_backward_eager(grad_output, x, weight, eps):
    x32, g32, w32 = x.float(), grad_output.float(), weight.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    u = g32 * w32
    grad_x = rstd * u - x32 * rstd.pow(3) * (u * x32).mean(-1, keepdim=True)
    grad_w = (g32 * x32 * rstd).reshape(-1, x.shape[-1]).sum(0)  # [..., h] -> [tokens, h] -> [h]
    return grad_x.to(x.dtype), grad_w.to(weight.dtype)


_rms_norm_backward = CudaCompiled(_rms_norm_backward_eager)


def apply_norm(x: torch.Tensor, normalization: str, weight, bias, eps: float, zero_centered_gamma: bool):
    """Normalise the last dimension of `x` with a stored weight (zero-centred when asked) and bias."""
    effective = weight + 1 if zero_centered_gamma else weight
    if normalization == "RMSNorm":
        return _RMSNormFunction.apply(x, effective, eps)
    return F.layer_norm(x, (x.shape[-1],), effective, bias, eps)


class WrappedTorchNorm:
    """Builds the norm named by `config.normalization` (Megatron's constructor signature)."""

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ):
        if config.normalization == "LayerNorm":
            return LayerNorm(config, hidden_size, eps)
        if config.normalization == "RMSNorm":
            return RMSNorm(config, hidden_size, eps)
        if config.normalization == "L2Norm":
            return L2Norm(hidden_size, eps)
        raise ValueError(
            f"normalization ({config.normalization!r}) must be 'LayerNorm' or 'RMSNorm' (--normalization)."
        )


class L2Norm(torch.nn.Module):
    """x / sqrt(mean(x^2) + eps) with no learnable weight (Llama-4 qk norm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, **kwargs):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_float = x.float()
        return (x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


__all__ = ["WrappedTorchNorm", "LayerNorm", "RMSNorm", "L2Norm", "apply_norm"]
