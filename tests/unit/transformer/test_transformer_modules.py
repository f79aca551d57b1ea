"""Attention, RoPE, norms and MLP against direct reference implementations (single process, TP=1)."""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention, TECompatibleDotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.torch_norm import L2Norm, LayerNorm, RMSNorm, WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import squared_relu
from megatron.core.utils import get_torch_device_type
from tests.unit.transformer.model_setup import init_single_rank


def _config(**kwargs):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, attention_dropout=0.0, hidden_dropout=0.0,
                use_cpu_initialization=True)
    base.update(kwargs)
    return TransformerConfig(**base)


def _reference_attention(q, k, v, masked, scale):
    """Explicit softmax(QK^T * scale) V with Megatron's mask convention (True = masked); [s, b, n, d]."""
    groups = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(groups, dim=2)
    v = v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("qbnd,kbnd->bnqk", q, k) * scale
    scores = scores.masked_fill(masked, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    context = torch.einsum("bnqk,kbnd->qbnd", probs, v)
    return context.reshape(q.shape[0], q.shape[1], -1)  # [sq, b, np, hn] -> [sq, b, np*hn]


@pytest.mark.parametrize("groups", [4, 2, 1])
def test_dot_product_attention_matches_reference(groups):
    init_single_rank()
    config = _config(num_query_groups=groups)
    sq, b, hn = 8, 2, config.kv_channels
    q = torch.randn(sq, b, 4, hn)
    k, v = torch.randn(sq, b, groups, hn), torch.randn(sq, b, groups, hn)
    causal = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    causal_mask = torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)
    expected = _reference_attention(q, k, v, causal_mask, 1 / math.sqrt(hn))
    torch.testing.assert_close(causal(q, k, v, None), expected, rtol=1e-5, atol=1e-6)

    padding = DotProductAttention(config, 3, AttnMaskType.padding, "self", softmax_scale=0.3)
    mask = torch.rand(b, 1, sq, sq) > 0.6
    mask[..., 0] = False
    expected = _reference_attention(q, k, v, mask, 0.3)
    torch.testing.assert_close(padding(q, k, v, mask), expected, rtol=1e-5, atol=1e-6)
    explicit = _reference_attention(q, k, v, mask, 1 / math.sqrt(hn))
    torch.testing.assert_close(causal(q, k, v, mask), explicit, rtol=1e-5, atol=1e-6)

    te_like = TECompatibleDotProductAttention(config, 1, AttnMaskType.causal, "self")
    torch.testing.assert_close(te_like(q, k, v, mask), _reference_attention(q, k, v, causal_mask, 1 / math.sqrt(hn)),
                               rtol=1e-5, atol=1e-6)
    assert "_extra_state" in te_like.state_dict() and "_extra_state" not in causal.state_dict()

    scaled = DotProductAttention(_config(num_query_groups=groups, apply_query_key_layer_scaling=True), 5,
                                 AttnMaskType.causal, "self")
    torch.testing.assert_close(scaled(q.half(), k.half(), v.half(), None).float(),
                               _reference_attention(q, k, v, causal_mask, 1 / math.sqrt(hn)), rtol=2e-2, atol=2e-2)


def test_attention_dropout_uses_tracker_and_is_reproducible():
    init_single_rank(seed=7)
    attention = DotProductAttention(_config(attention_dropout=0.5), 1, AttnMaskType.causal, "self")
    q = torch.randn(8, 2, 4, 8, device=get_torch_device_type())
    first = attention(q, q, q, None)
    init_single_rank(seed=7)
    torch.manual_seed(99)
    second = attention(q, q, q, None)
    torch.testing.assert_close(first, second)
    attention.eval()
    assert not torch.equal(attention(q, q, q, None), first)


def _reference_rope(x, positions, dim, base, interleaved):
    """Rotate pairs of channels by angle position * base^(-2i/dim) directly (x: [s, b, n, hn])."""
    out = x.clone()
    for i in range(dim // 2):
        theta = positions * base ** (-2 * i / dim)
        a, b_ = (2 * i, 2 * i + 1) if interleaved else (i, i + dim // 2)
        cos, sin = torch.cos(theta)[:, None, None], torch.sin(theta)[:, None, None]
        out[..., a] = x[..., a] * cos - x[..., b_] * sin
        out[..., b_] = x[..., b_] * cos + x[..., a] * sin
    return out


@pytest.mark.parametrize("interleaved, percent", [(False, 1.0), (True, 1.0), (False, 0.5), (True, 0.5)])
def test_rope_matches_direct_rotation(interleaved, percent):
    hn, s = 16, 10
    config = _config(rotary_interleaved=interleaved)
    rope = RotaryEmbedding(hn, percent, rotary_interleaved=interleaved, rotary_base=500, use_cpu_initialization=True)
    freqs = rope(s)
    rot_dim = int(hn * percent)
    assert freqs.shape == (s, 1, 1, rot_dim)
    x = torch.randn(s, 2, 3, hn, dtype=torch.float64)
    expected = _reference_rope(x, torch.arange(s, dtype=torch.float64), rot_dim, 500.0, interleaved)
    torch.testing.assert_close(apply_rotary_pos_emb(x, freqs.double(), config), expected, rtol=1e-5, atol=1e-5)
    offset = rope(4, offset=6)
    torch.testing.assert_close(offset, freqs[6:])
    assert "inv_freq" not in rope.state_dict()


def test_rope_llama3_scaling_and_interpolation():
    plain = RotaryEmbedding(64, 1.0, rotary_base=500000, use_cpu_initialization=True)
    scaled = RotaryEmbedding(64, 1.0, rotary_base=500000, rope_scaling=True, rope_scaling_factor=8.0,
                             use_cpu_initialization=True)
    wavelen = 2 * math.pi / plain.inv_freq
    high = wavelen < 8192 / 4
    low = wavelen > 8192
    torch.testing.assert_close(scaled.inv_freq[high], plain.inv_freq[high])
    torch.testing.assert_close(scaled.inv_freq[low], plain.inv_freq[low] / 8)
    medium = ~high & ~low
    assert medium.any()
    assert torch.all(scaled.inv_freq[medium] < plain.inv_freq[medium])
    assert torch.all(scaled.inv_freq[medium] > plain.inv_freq[medium] / 8)
    interpolated = RotaryEmbedding(8, 1.0, seq_len_interpolation_factor=2.0, use_cpu_initialization=True)
    torch.testing.assert_close(interpolated(4)[2], RotaryEmbedding(8, 1.0, use_cpu_initialization=True)(4)[1])


def test_norms_layernorm_1p_rmsnorm_and_sequence_parallel_attribute():
    x = torch.randn(5, 2, 16)
    config = _config(hidden_size=16, layernorm_zero_centered_gamma=True, layernorm_epsilon=1e-6)
    norm = WrappedTorchNorm(config, 16, eps=1e-6)
    assert isinstance(norm, LayerNorm) and torch.all(norm.weight == 0)
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 0.5)
        norm.bias.uniform_(-0.5, 0.5)
    torch.testing.assert_close(norm(x), F.layer_norm(x, (16,), 1 + norm.weight, norm.bias, 1e-6))
    assert norm.weight.sequence_parallel is False
    rms_config = _config(hidden_size=16, normalization="RMSNorm")
    rms = WrappedTorchNorm(rms_config, 16, eps=1e-5)
    assert isinstance(rms, RMSNorm) and rms.bias is None and torch.all(rms.weight == 1)
    with torch.no_grad():
        rms.weight.uniform_(0.5, 1.5)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * rms.weight
    torch.testing.assert_close(rms(x), expected, rtol=1e-5, atol=1e-6)
    sp_config = _config(hidden_size=16, tensor_model_parallel_size=2, sequence_parallel=True)
    sp_norm = WrappedTorchNorm(sp_config, 16)
    assert sp_norm.weight.sequence_parallel and sp_norm.bias.sequence_parallel
    l2 = L2Norm(16, eps=1e-6)
    torch.testing.assert_close(l2(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_fused_activations_match_unfused_with_gradients():
    x = torch.randn(4, 3, 12, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(12, dtype=torch.float64, requires_grad=True)
    out = bias_gelu_impl(x, bias)
    ref_x, ref_b = x.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    ref = F.gelu(ref_x + ref_b, approximate="tanh")
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, ref_x.grad)
    torch.testing.assert_close(bias.grad, ref_b.grad)
    x.grad = None
    out = bias_swiglu_impl(x, bias)
    ref_x.grad = None
    gate, up = torch.chunk(ref_x + ref_b, 2, -1)
    ref = F.silu(gate) * up
    torch.testing.assert_close(out, ref)
    out.backward(grad[..., :6])
    ref.backward(grad[..., :6])
    torch.testing.assert_close(x.grad, ref_x.grad)


@pytest.mark.parametrize("variant", ["gelu", "swiglu", "swiglu_fused", "squared_relu"])
def test_mlp_matches_manual_computation(variant):
    init_single_rank()
    kwargs = {
        "gelu": dict(),
        "swiglu": dict(activation_func=F.silu, gated_linear_unit=True, add_bias_linear=False),
        "swiglu_fused": dict(activation_func=F.silu, gated_linear_unit=True, bias_activation_fusion=True),
        "squared_relu": dict(activation_func=squared_relu),
    }[variant]
    config = _config(ffn_hidden_size=24, **kwargs)
    mlp = build_module(get_mlp_module_spec(use_te=False), config=config)
    x = torch.randn(6, 2, 32)
    out, out_bias = mlp(x)
    w1, w2 = mlp.linear_fc1.weight, mlp.linear_fc2.weight
    b1 = mlp.linear_fc1.bias if mlp.linear_fc1.bias is not None else 0
    h = x @ w1.t() + b1
    if config.gated_linear_unit:
        assert w1.shape == (48, 32)
        h = F.silu(h[..., :24]) * h[..., 24:]
    else:
        h = config.activation_func(h)
    expected = h @ w2.t()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert (out_bias is None) == (not config.add_bias_linear)


def test_rmsnorm_gradients_match_autograd_reference():
    config = _config(hidden_size=16, normalization="RMSNorm")
    norm = WrappedTorchNorm(config, 16, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(5, 3, 16, requires_grad=True)
    grad = torch.randn(5, 3, 16)
    norm(x).backward(grad)
    ref_x = x.detach().clone().requires_grad_()
    ref_w = norm.weight.detach().clone().requires_grad_()
    (ref_x * torch.rsqrt(ref_x.pow(2).mean(-1, keepdim=True) + 1e-5) * ref_w).backward(grad)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(norm.weight.grad, ref_w.grad, rtol=1e-5, atol=1e-5)
