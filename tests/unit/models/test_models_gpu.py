"""CUDA paths of the model (bf16 Float16Module, compiled fusions, CUDA RNG tracker under recompute).

Skipped where no GPU is present (CI). Runs single-process at TP=PP=1 on a one-rank gloo group.
"""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit.transformer.model_setup import init_single_rank, seed_all

VOCAB, SEQ, BATCH = 256, 64, 2


def _llama(**kwargs):
    base = dict(
        num_layers=2, hidden_size=128, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=256,
        normalization="RMSNorm", activation_func=F.silu, gated_linear_unit=True, add_bias_linear=False,
        qk_layernorm=True, bias_activation_fusion=True, use_cpu_initialization=True,
    )
    base.update(kwargs)
    return TransformerConfig(**base)


def _model(config):
    return GPTModel(config, get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True), vocab_size=VOCAB,
                    max_sequence_length=SEQ, position_embedding_type="rope")


def _batch(device):
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator).to(device)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator).to(device)
    return tokens, torch.arange(SEQ, device=device).expand(BATCH, SEQ), labels


@pytest.mark.gpu
def test_bf16_cuda_model_matches_fp32_cpu_model():
    init_single_rank()
    seed_all(3)
    cpu = _model(_llama(hidden_dropout=0.0, attention_dropout=0.0))
    seed_all(3)
    gpu_config = _llama(hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16)
    gpu = Float16Module(gpu_config, _model(gpu_config).cuda())
    gpu.module.load_state_dict({k: v for k, v in cpu.state_dict().items()}, strict=False)
    tokens, position_ids, labels = _batch("cpu")
    cpu_loss = cpu(tokens, position_ids, None, labels=labels)
    gpu_loss = gpu(*[t.cuda() for t in (tokens, position_ids)], None, labels=labels.cuda())
    assert gpu_loss.dtype == torch.float32
    torch.testing.assert_close(gpu_loss.cpu(), cpu_loss.detach(), rtol=3e-2, atol=3e-2)
    gpu_loss.mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in gpu.parameters())


@pytest.mark.gpu
def test_cuda_recompute_bitwise_with_dropout():
    init_single_rank()
    results = []
    for extra in ({}, dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
                  dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])):
        seed_all(5)
        model = _model(_llama(hidden_dropout=0.2, attention_dropout=0.2, **extra)).cuda()
        tokens, position_ids, labels = _batch("cuda")
        seed_all(9)
        loss = model(tokens, position_ids, None, labels=labels).sum()
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    for loss, grads in results[1:]:
        assert torch.equal(loss, results[0][0])
        assert all(torch.equal(a, b) for a, b in zip(grads, results[0][1]))


@pytest.mark.gpu
def test_compiled_fusions_match_eager_on_cuda():
    x = torch.randn(16, 4, 64, device="cuda", requires_grad=True)
    bias = torch.randn(64, device="cuda", requires_grad=True)
    out = bias_gelu_impl(x, bias)
    torch.testing.assert_close(out, F.gelu(x + bias, approximate="tanh"), rtol=1e-5, atol=1e-5)
    out.sum().backward()
    gate, up = torch.chunk(x + bias, 2, -1)
    torch.testing.assert_close(bias_swiglu_impl(x, bias), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
