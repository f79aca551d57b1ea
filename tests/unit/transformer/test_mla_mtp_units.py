"""YaRN rotary, multi-latent attention, multi-token prediction and their FLOPs against formulas written here."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.unit.transformer.model_setup import init_single_rank


def _yarn_inv_freq(d, base, s, L, beta_fast, beta_slow):
    """YaRN frequencies from the paper's definitions (independent of the implementation)."""
    def corr_dim(rotations):
        return d * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(math.floor(corr_dim(beta_fast)), 0), min(math.ceil(corr_dim(beta_slow)), d - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(d // 2):
        extra = base ** (-2 * i / d)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(extra / s * ramp + extra * (1 - ramp))
    return torch.tensor(out, dtype=torch.float64)


def _m(s, k):
    return 1.0 if s <= 1 else 0.1 * k * math.log(s) + 1.0


@pytest.mark.parametrize("d,base,s,L", [(64, 10000.0, 40.0, 4096), (16, 500.0, 4.0, 64), (8, 10000.0, 1.0, 32)])
def test_yarn_frequencies_angles_and_mscale(d, base, s, L):
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    rope = YarnRotaryEmbedding(d, rotary_base=base, scaling_factor=s, original_max_position_embeddings=L,
                               mscale=0.707, mscale_all_dim=0.5, use_cpu_initialization=True)
    want = _yarn_inv_freq(d, base, s, L, 32.0, 1.0)
    torch.testing.assert_close(rope.blended_inv_freq().double(), want, rtol=1e-6, atol=0)
    angles, mscale = rope(12)
    assert angles.shape == (12, 1, 1, d)
    positions = torch.arange(12, dtype=torch.float64)[:, None]
    torch.testing.assert_close(angles[:, 0, 0].double(), torch.cat([positions * want] * 2, dim=-1), rtol=1e-5,
                               atol=1e-5)
    assert mscale == pytest.approx(_m(s, 0.707) / _m(s, 0.5))
    cos, sin = rope.get_cached_cos_sin(12, dtype=torch.float64)
    torch.testing.assert_close(cos[:, 0, 0], torch.cos(angles[:, 0, 0].double()) * mscale, rtol=1e-6, atol=1e-6)


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope_deinterleaved(t, angles, m):
    """DeepSeek's rotation: pairs (2i, 2i+1) gathered into halves, then rotate-half with cos/sin * m."""
    t = torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)
    a, b = t.chunk(2, dim=-1)
    return t * torch.cos(angles) * m + torch.cat([-b, a], dim=-1) * torch.sin(angles) * m


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_mla_self_attention_matches_the_formula(q_lora_rank):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    init_single_rank()
    n, H, kv, dn, dr, dv, s_factor = 4, 16, 10, 6, 4, 5, 8.0
    config = MLATransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=n, q_lora_rank=q_lora_rank, kv_lora_rank=kv, qk_head_dim=dn,
        qk_pos_emb_head_dim=dr, v_head_dim=dv, rotary_scaling_factor=s_factor, mscale=0.9, mscale_all_dim=0.6,
        max_position_embeddings=16, qk_layernorm=True, normalization="RMSNorm", use_cpu_initialization=True,
        add_bias_linear=False, params_dtype=torch.float64, init_method_std=0.3, attention_dropout=0.0)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
    attn = build_module(spec.submodules.self_attention, config=config, layer_number=1)
    with torch.no_grad():
        for module in (getattr(attn, "q_layernorm", None), attn.kv_layernorm):
            if module is not None:
                module.weight.uniform_(0.5, 1.5)
    seq, b = 7, 2
    x = torch.randn(seq, b, H, dtype=torch.float64)
    out, _ = attn(x, None)

    eps = config.layernorm_epsilon
    if q_lora_rank is None:
        q = x @ attn.linear_q_proj.weight.T
    else:
        q = _rms(x @ attn.linear_q_down_proj.weight.T, attn.q_layernorm.weight, eps) @ attn.linear_q_up_proj.weight.T
    q = q.view(seq, b, n, dn + dr)
    ckv = x @ attn.linear_kv_down_proj.weight.T
    latent, k_pe = ckv[..., :kv], ckv[..., kv:]
    kvu = (_rms(latent, attn.kv_layernorm.weight, eps) @ attn.linear_kv_up_proj.weight.T).view(seq, b, n, dn + dv)
    inv = _yarn_inv_freq(dr, 10000.0, s_factor, 16, 32.0, 1.0)
    angles = torch.cat([torch.arange(seq, dtype=torch.float64)[:, None] * inv] * 2, dim=-1)[:, None, None, :]
    m_rope = _m(s_factor, 0.9) / _m(s_factor, 0.6)
    query = torch.cat([q[..., :dn], _rope_deinterleaved(q[..., dn:], angles, m_rope)], dim=-1)
    k_rot = _rope_deinterleaved(k_pe[:, :, None, :], angles, m_rope).expand(seq, b, n, dr)
    key = torch.cat([kvu[..., :dn], k_rot], dim=-1)
    value = kvu[..., dn:]
    scale = _m(s_factor, 0.9) ** 2 / math.sqrt(dn + dr)
    scores = torch.einsum("sbnd,tbnd->bnst", query, key) * scale
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    context = torch.einsum("bnst,tbnd->sbnd", F.softmax(scores, dim=-1), value).reshape(seq, b, n * dv)
    want = context @ attn.linear_proj.weight.T
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)  # the angles are fp32 (as in Megatron)


def test_mtp_roll_and_loss_scaler():
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, roll_tensor

    t = torch.arange(6.0).view(2, 3)
    rolled, total = roll_tensor(t)
    assert rolled.tolist() == [[1.0, 2.0, 0.0], [4.0, 5.0, 0.0]] and total.item() == 12.0
    hidden = torch.ones(3, requires_grad=True)
    loss = torch.tensor(2.0, requires_grad=True)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(0.25))
    (MTPLossAutoScaler.apply(hidden, loss * 3) * 2).sum().backward()
    assert hidden.grad.tolist() == [2.0, 2.0, 2.0] and loss.grad.item() == pytest.approx(0.75)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))


def _flops_args(**overrides):
    args = dict(num_layers=4, hidden_size=64, num_attention_heads=8, seq_length=32, padded_vocab_size=128,
                ffn_hidden_size=96, swiglu=True, group_query_attention=False, num_query_groups=None, kv_channels=8,
                num_experts=8, moe_layer_freq=[0, 1, 1, 1], moe_router_topk=2, moe_ffn_hidden_size=24,
                moe_shared_expert_intermediate_size=24, multi_latent_attention=True, q_lora_rank=16,
                kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, mtp_num_layers=1,
                is_hybrid_model=False)
    args.update(overrides)
    return SimpleNamespace(**args)


@pytest.mark.parametrize("q_lora_rank,mtp", [(16, 1), (None, None)])
def test_mla_mtp_flops_follow_megatron(q_lora_rank, mtp):
    from megatron.training.training_log import num_floating_point_operations

    a = _flops_args(q_lora_rank=q_lora_rank, mtp_num_layers=mtp)
    B, s, H, n, V = 3, a.seq_length, a.hidden_size, a.num_attention_heads, a.padded_vocab_size
    D = mtp or 0
    layers = a.num_layers + D  # the MTP layer repeats the last (MoE) layer
    dense, moe = 1, 3 + D
    q = H * n * (8 + 4) if q_lora_rank is None else 16 * (H + n * (8 + 4) + 1)
    attn = 6 * layers * (q + 12 * (H + n * (8 + 8) + 1) + H * 4 + n * 8 * H + s * n * (8 + 4) / 2 + s * n * 8 / 2)
    mlp = 12 * layers * H * (96 * 1.5 * dense / layers + 24 * 2 * 1.5 * moe / layers + 24 * 1.5 * moe / layers)
    mtp_terms = 6 * D * (3 * H + 2 * H * H)
    logits = 6 * H * V * (D + 1)
    want = B * s * (mlp + attn + mtp_terms + logits)
    assert num_floating_point_operations(a, B) == pytest.approx(want, rel=1e-12)


def test_mla_up_proj_recompute_keeps_outputs_and_gradients():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    init_single_rank()
    results = []
    for recompute in (False, True):
        torch.manual_seed(0)
        config = MLATransformerConfig(
            num_layers=1, hidden_size=16, num_attention_heads=4, q_lora_rank=8, kv_lora_rank=8, qk_head_dim=4,
            qk_pos_emb_head_dim=4, v_head_dim=4, qk_layernorm=True, normalization="RMSNorm",
            use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0, params_dtype=torch.float64,
            recompute_granularity="selective" if recompute else None,
            recompute_modules=["mla_up_proj"] if recompute else None)
        layer = build_module(get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True,
                                                      normalization="RMSNorm"), config=config, layer_number=1)
        assert getattr(layer.self_attention.up_projection, "__name__", "") == ("method" if recompute else
                                                                                "up_projection")
        x = torch.randn(6, 2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1),
                        requires_grad=True)
        out, _ = layer(x)
        out.square().sum().backward()
        results.append((out.detach(), x.grad, [p.grad for p in layer.parameters()]))
    (o1, g1, p1), (o2, g2, p2) = results
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(g1, g2)
    for a, b in zip(p1, p2):
        torch.testing.assert_close(a, b)
