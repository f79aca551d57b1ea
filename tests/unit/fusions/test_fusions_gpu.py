"""CUDA paths of the fast path against their eager / reference versions (skipped without a GPU).

Compiled lean cross-entropy, compiled bias+residual add, compiled RoPE, the cuDNN-first SDPA order, and
a GPT model with compiled transformer layers against the same model run eagerly.
"""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.fusions import fused_cross_entropy
from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import rope_utils
from megatron.core.transformer.dot_product_attention import sdpa_backend_priority
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit.transformer.model_setup import apply_plan, init_single_rank, seed_all


@pytest.mark.gpu
def test_cuda_fused_cross_entropy_bf16_against_reference(monkeypatch):
    init_single_rank()
    # 209 rows per chunk: four full chunks and a shorter last one, each shape its own compiled kernels
    monkeypatch.setattr(fused_cross_entropy, "_CHUNK_ELEMENTS", 1 << 20)
    torch.manual_seed(0)
    logits = (torch.randn(300, 3, 5003, device="cuda") * 3).bfloat16().requires_grad_(True)
    target = torch.randint(0, 5003, (300, 3), device="cuda")
    weights = torch.rand(300, 3, device="cuda")
    loss = fused_vocab_parallel_cross_entropy(logits, target)
    ref_logits = logits.detach().float().requires_grad_(True)
    ref = F.cross_entropy(ref_logits.view(-1, 5003), target.view(-1), reduction="none").view(300, 3)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    (loss * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad, rtol=1e-2, atol=1e-4)


@pytest.mark.gpu
def test_cuda_compiled_bda_rope_and_sdpa_order():
    torch.manual_seed(1)
    x, bias, residual = (torch.randn(64, 2, 256, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = get_bias_dropout_add(True, fused=True)((x, bias[0, 0]), residual, 0.0)
    torch.testing.assert_close(out, residual + (x + bias[0, 0]), rtol=1e-2, atol=1e-2)

    class _Config:
        rotary_interleaved = False

    t = torch.randn(128, 2, 4, 64, device="cuda", requires_grad=True)
    freqs = torch.randn(128, 1, 1, 64, device="cuda")
    fused = rope_utils.apply_rotary_pos_emb(t, freqs, _Config())
    eager = rope_utils._apply_rotary_pos_emb_bshd(t, freqs)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
    grad_fused, = torch.autograd.grad(fused.square().sum(), t)
    grad_eager, = torch.autograd.grad(eager.square().sum(), t)
    torch.testing.assert_close(grad_fused, grad_eager, rtol=1e-5, atol=1e-5)

    q = torch.randn(2, 8, 512, 128, device="cuda", dtype=torch.bfloat16)
    with sdpa_backend_priority(q):
        fast = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    reference = F.scaled_dot_product_attention(q.float(), q.float(), q.float(), is_causal=True)
    torch.testing.assert_close(fast.float(), reference, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 4, 5632), (3, 1500), (7, 24)])
def test_triton_swiglu_backward_against_the_formula(shape):
    """The Triton SwiGLU backward against the fp32 formula and the compiled kernel it replaces (both compute in
    fp32 and round once: they may differ by one bf16 rounding step), and the fallbacks for operands it does
    not take."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("triton")
    from megatron.core.fusions import _triton_swiglu, fused_bias_swiglu

    generator = torch.Generator(device="cuda").manual_seed(shape[-1])
    y = torch.randn(*shape[:-1], 2 * shape[-1], device="cuda", generator=generator).to(torch.bfloat16)
    g = torch.randn(*shape, device="cuda", generator=generator).to(torch.bfloat16)
    assert _triton_swiglu.usable(g, y)
    fast = fused_bias_swiglu.swiglu_back_triton(g, y)
    reference = fused_bias_swiglu.swiglu_back(g.float(), y.float())
    torch.testing.assert_close(fast.float(), reference, rtol=8e-3, atol=1e-2)
    compiled = fused_bias_swiglu._swiglu_back(g, y)
    ulp = reference.abs().clamp_min(1e-3) * 2 ** -7
    assert ((fast.float() - compiled.float()).abs() <= ulp).all()
    assert not _triton_swiglu.usable(g.float(), y)  # mixed dtypes
    assert not _triton_swiglu.usable(g, torch.cat([y, y], -1)[..., : y.shape[-1]])  # not contiguous
    y.requires_grad_(True)
    fused_bias_swiglu.bias_swiglu_impl(y, None).backward(g)
    assert torch.equal(y.grad, fast)


@pytest.mark.gpu
@pytest.mark.parametrize("glu", [False, True], ids=["gelu", "swiglu"])
def test_cuda_compiled_layers_match_eager_model(glu):
    init_single_rank()
    results = []
    for mode in ("off", "on"):
        seed_all(7)
        activation = dict(gated_linear_unit=True, activation_func=F.silu) if glu else {}
        config = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4, hidden_dropout=0.0,
                                   attention_dropout=0.0, bias_activation_fusion=True, compile_layers=mode,
                                   **activation)
        model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=512, max_sequence_length=64).cuda()
        apply_plan(model)
        assert all(getattr(layer, "is_compiled", False) == (mode == "on") for layer in model.decoder.layers)
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 512, (2, 64), generator=generator).cuda()
        labels = torch.randint(0, 512, (2, 64), generator=generator).cuda()
        position_ids = torch.arange(64, device="cuda").expand(2, 64)
        loss = model(tokens, position_ids, None, labels=labels).mean()
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-4, atol=1e-4)
    for compiled, eager in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(compiled, eager, rtol=1e-3, atol=1e-4)
