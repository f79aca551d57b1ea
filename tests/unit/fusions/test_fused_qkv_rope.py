"""The fused QKV split + rotary embedding (`fusions.fused_qkv_rope`, `fusions._triton_qkv_rope`).

- CPU (CI): self-attention with rotary embeddings takes the plain path there, with the values of the plain
  split followed by `apply_rotary_pos_emb`; the conditions under which the kernels would be taken.
- Where Triton is installed (not in CI): both kernels under TRITON_INTERPRET=1 against the formula in fp64
  (GQA and MHA groups, partial rotation, bf16, gradients with other strides).
- On a GPU: the custom ops against the formula, and a GQA + RoPE model (eager and compiled layers) against
  the same model on the plain path.
"""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions import fused_qkv_rope
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.harness import load_interpreted
from tests.unit.transformer.model_setup import apply_plan, init_single_rank, seed_all

# (seq, batch, groups, heads per group, head dim, rotated channels)
SHAPES = [(5, 3, 2, 2, 16, 16), (7, 2, 3, 1, 32, 16), (4, 2, 1, 3, 8, 6), (9, 1, 2, 4, 64, 64), (11, 3, 2, 1, 16, 16)]


def _freqs(seq, rot, seed):
    """Angles [s, 1, 1, rot] whose two halves differ (as a general `freqs` may), up to ~50 radians."""
    angles = torch.rand(seq, rot // 2, generator=torch.Generator().manual_seed(seed)) * 50
    return torch.cat((angles, angles * 0.7), -1)[:, None, None, :]


def _formula(qkv, cos, sin, heads_per_group, head_dim):
    """q, k, v in fp64 from `qkv` with the tables cos/sin [s, rot] (rounded to the activations' dtype, as the
    product builds them)."""
    seq, batch, width = qkv.shape
    groups = width // ((heads_per_group + 2) * head_dim)
    grouped = qkv.double().view(seq, batch, groups, (heads_per_group + 2) * head_dim)  # [s, b, ng*(np/ng+2)*hn] -> [s, b, ng, (np/ng+2)*hn]
    q, k, v = torch.split(grouped, [heads_per_group * head_dim, head_dim, head_dim], -1)
    q = q.reshape(seq, batch, -1, head_dim)  # [s, b, ng, np/ng*hn] -> [s, b, np, hn]
    half = cos.shape[-1] // 2
    cos, sin = (table.cpu().double()[:, None, None, :] for table in (cos, sin))  # [s, rot] -> [s, 1, 1, rot]

    def rotate(t):
        x1, x2, rest = t[..., :half], t[..., half: 2 * half], t[..., 2 * half:]
        return torch.cat((x1 * cos[..., :half] - x2 * sin[..., :half],
                          x2 * cos[..., half:] + x1 * sin[..., half:], rest), -1)
    return rotate(q), rotate(k), v


def _tables(freqs, dtype, device="cpu"):
    """cos/sin [s, rot] in `dtype`, computed on the CPU (the same values for the kernel and the formula)."""
    angles = freqs[:, 0, 0, :]
    return tuple(f(angles).to(dtype).contiguous().to(device) for f in (torch.cos, torch.sin))


def _assert_within(got, want, dtype):
    """fp32: a few fp32 roundings of the terms; bf16/fp16: also one rounding of the result."""
    relative = 0.0 if dtype == torch.float32 else 2 ** -7
    assert got.shape == want.shape
    assert ((got.cpu().double() - want).abs() <= want.abs() * relative + 1e-5).all()


def _check_kernels(kernels, shape, dtype, device):
    seq, batch, groups, per_group, head_dim, rot = shape
    gen = torch.Generator().manual_seed(sum(shape))
    qkv = torch.randn(seq, batch, groups * (per_group + 2) * head_dim, generator=gen).to(device=device, dtype=dtype)
    freqs = _freqs(seq, rot, sum(shape))
    cos, sin = _tables(freqs, dtype, device)
    leaf = qkv.cpu().double().requires_grad_(True)
    reference = _formula(leaf, cos, sin, per_group, head_dim)
    for got, want in zip(kernels.forward(qkv, cos, sin, per_group, head_dim), reference):
        assert got.is_contiguous() and got.dtype == dtype
        _assert_within(got, want.detach(), dtype)
    grads = [torch.randn(t.shape, generator=gen).to(device=device, dtype=dtype) for t in reference]
    # the query gradient as the attention's backward leaves it: [s, b, np, hn] viewed from a [b, np, s, hn] buffer
    grads[0] = grads[0].permute(1, 2, 0, 3).contiguous().permute(2, 0, 1, 3)
    got = kernels.backward(*grads, cos, sin, per_group)
    torch.autograd.backward(reference, [g.cpu().double() for g in grads])
    _assert_within(got, leaf.grad, dtype)


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    from megatron.core.fusions import _triton_qkv_rope

    return load_interpreted(_triton_qkv_rope.__file__, "_triton_qkv_rope_interpreted")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"s{s[0]}-g{s[2]}x{s[3]}-hn{s[4]}-rot{s[5]}" for s in SHAPES])
def test_kernels_interpreted_against_the_formula(interpreted, shape, dtype):
    _check_kernels(interpreted, shape, dtype, "cpu")


def _rope_model(**plan_flags):
    seed_all(5)
    config = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=8, num_query_groups=2,
                               hidden_dropout=0.0, attention_dropout=0.0, gated_linear_unit=True,
                               activation_func=F.silu, bias_activation_fusion=True, add_bias_linear=False,
                               use_cpu_initialization=True, **plan_flags)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=256, max_sequence_length=32,
                    position_embedding_type="rope")


def test_plain_path_on_cpu_matches_split_then_rotate():
    """On the CPU the attention splits and rotates the plain way; its result is exactly split + rotate."""
    init_single_rank()
    model = _rope_model()
    attention = model.decoder.layers[0].self_attention
    hidden = torch.randn(32, 2, 128, generator=torch.Generator().manual_seed(3))
    freqs = model.rotary_pos_emb(32)
    mixed_qkv, _ = attention.linear_qkv(hidden)
    assert not fused_qkv_rope.fused_path_applies(mixed_qkv, freqs, attention.config)
    assert fused_qkv_rope.try_fused_qkv_rope(mixed_qkv, freqs, 4, 16, attention.config) is None
    for rotary in (freqs, (freqs, freqs)):
        query, key, value = attention._rotated_query_key_value(hidden, None, rotary, None)
        q, k, v = attention.get_query_key_value_tensors(hidden)
        assert torch.equal(query, apply_rotary_pos_emb(q, freqs, attention.config))
        assert torch.equal(key, apply_rotary_pos_emb(k, freqs, attention.config))
        assert torch.equal(value, v)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_custom_ops_on_cuda_against_the_formula(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("triton")
    from megatron.core.fusions import _triton_qkv_rope

    for shape in SHAPES + [(256, 2, 8, 2, 128, 128)]:
        _check_kernels(_triton_qkv_rope, shape, dtype, "cuda")
    qkv = torch.randn(16, 2, 2 * 4 * 32, device="cuda", dtype=dtype)
    cos, sin = _tables(_freqs(16, 32, 0), dtype, "cuda")
    assert _triton_qkv_rope.usable(qkv, cos, 2, 32)
    assert not _triton_qkv_rope.usable(qkv, cos.float() if dtype != torch.float32 else cos.half(), 2, 32)
    assert not _triton_qkv_rope.usable(qkv[:8], cos, 2, 32)  # tables for another sequence length
    assert not _triton_qkv_rope.usable(qkv.transpose(0, 1), cos, 2, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", ["off", "on"], ids=["eager-layers", "compiled-layers"])
def test_gqa_rope_model_on_cuda_matches_the_plain_path(compiled):
    """fp32 model, fused path (custom ops; inside compiled layers too) against `--fusion-kernels eager`."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("triton")
    init_single_rank()
    results = []
    for kernels in ("eager", "compiled"):
        torch._dynamo.reset()
        model = _rope_model(fusion_kernels=kernels, compile_layers=compiled if kernels == "compiled" else "off")
        apply_plan(model.cuda())
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 256, (2, 32), generator=generator).cuda()
        position_ids = torch.arange(32, device="cuda").expand(2, 32)
        loss = model(tokens, position_ids, None, labels=tokens).mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-4, atol=1e-5, msg=name)
