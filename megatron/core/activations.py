"""Activation functions with no direct `torch.nn.functional` equivalent (Megatron's `megatron.core.activations`).

Module-level functions, so configs holding them stay picklable and comparable.
"""
import math

import torch
import torch.nn.functional as F

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x) ** 2 (Primer, So et al. 2021)."""
    return torch.pow(F.relu(x), 2)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x), the sigmoid approximation of GELU."""
    return x * torch.sigmoid(1.702 * x)


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x)))


def erf_gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact (erf-based) GELU written out: 0.5 x (1 + erf(x / sqrt(2))) (Megatron's `--onnx-safe` path)."""
    return x * 0.5 * (torch.erf(x / math.sqrt(2.0)) + 1.0)
