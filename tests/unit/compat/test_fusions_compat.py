"""The fusion modules added for Megatron's surface, against autograd of the formulas written here."""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_geglu import bias_geglu_impl, geglu
from megatron.core.fusions.fused_bias_swiglu import BiasSwiGLUFunction, bias_swiglu_back
from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
from megatron.core.transformer.transformer_config import TransformerConfig


def _tanh_gelu(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", [(6, 10), (2, 3, 10)])
def test_bias_geglu_forward_and_backward(with_bias, shape):
    torch.manual_seed(0)
    y = torch.randn(shape, dtype=torch.float64)
    bias = torch.randn(10, dtype=torch.float64) if with_bias else None
    g = torch.randn(shape[:-1] + (5,), dtype=torch.float64)

    y1 = y.clone().requires_grad_()
    b1 = bias.clone().requires_grad_() if with_bias else None
    out = bias_geglu_impl(y1, b1)
    out.backward(g)

    y2 = y.clone().requires_grad_()
    b2 = bias.clone().requires_grad_() if with_bias else None
    z = y2 + b2 if with_bias else y2
    reference = _tanh_gelu(z[..., :5]) * z[..., 5:]
    reference.backward(g)
    torch.testing.assert_close(out, reference)
    torch.testing.assert_close(y1.grad, y2.grad)
    if with_bias:
        torch.testing.assert_close(b1.grad, b2.grad)
    torch.testing.assert_close(geglu(y), _tanh_gelu(y[..., :5]) * y[..., 5:])


def test_bias_swiglu_function_forward_and_backward():
    torch.manual_seed(1)
    y = torch.randn(7, 12, dtype=torch.float64)
    bias = torch.randn(12, dtype=torch.float64)
    g = torch.randn(7, 6, dtype=torch.float64)
    y1, b1 = y.clone().requires_grad_(), bias.clone().requires_grad_()
    BiasSwiGLUFunction.apply(y1, b1, False).backward(g)
    y2, b2 = y.clone().requires_grad_(), bias.clone().requires_grad_()
    z = y2 + b2
    (F.silu(z[:, :6]) * z[:, 6:]).backward(g)
    torch.testing.assert_close(y1.grad, y2.grad)
    torch.testing.assert_close(b1.grad, b2.grad)
    torch.testing.assert_close(bias_swiglu_back(g, y, bias), y2.grad)


def test_fused_layer_norm_is_layernorm_with_megatrons_constructor():
    torch.manual_seed(2)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
    norm = FusedLayerNorm(config, 8, eps=1e-5, persist_layer_norm=True)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(3, 2, 8)
    torch.testing.assert_close(norm(x), F.layer_norm(x, (8,), norm.weight, norm.bias, 1e-5))
    assert [name for name, _ in norm.named_parameters()] == ["weight", "bias"]

    centred = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True,
                                layernorm_zero_centered_gamma=True)
    norm1p = FusedLayerNorm(centred, 8)
    with torch.no_grad():
        norm1p.weight.normal_()
    torch.testing.assert_close(norm1p(x), F.layer_norm(x, (8,), 1 + norm1p.weight, norm1p.bias, 1e-5))
    with pytest.raises(ValueError, match="only normalization='LayerNorm'"):
        FusedLayerNorm(config, 8, normalization="RMSNorm")


def test_jit_fuser_is_torch_compile():
    from megatron.core.jit import jit_fuser

    assert jit_fuser is torch.compile
