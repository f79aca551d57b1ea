"""CUDA paths of the hybrid Mamba model: a bf16 CUDA model (Float16Module, `ssm_impl="auto"`: the Triton kernels
when they import) against the fp32 CPU model (reference ops), loss and gradients within bf16 noise.

Skipped where no GPU is present (CI). Single-process on a one-rank gloo group.
"""
import copy

import pytest
import torch

from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
from megatron.core.models.mamba.mamba_model import MambaModel
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit.transformer.model_setup import init_single_rank, seed_all

VOCAB, SEQ, BATCH = 256, 300, 2  # 300 steps: three 128-chunks, the last one partial


def _config(**kwargs):
    base = dict(num_layers=4, hidden_size=128, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=256,
                mamba_state_dim=32, mamba_head_dim=32, mamba_num_groups=2, normalization="RMSNorm",
                add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True)
    base.update(kwargs)
    return TransformerConfig(**base)


def _model(config):
    return MambaModel(config, mamba_stack_spec, VOCAB, SEQ, hybrid_override_pattern="M*M-",
                      position_embedding_type="none")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_cuda_hybrid_model_matches_fp32_cpu_model():
    init_single_rank()
    seed_all(0)
    cpu = _model(_config())
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    cpu_loss = cpu(tokens, positions, None, labels=labels).mean()
    cpu_loss.backward()
    gpu_config = _config(bf16=True, params_dtype=torch.bfloat16)
    gpu_model = _model(gpu_config)
    gpu_model.load_state_dict(copy.deepcopy(cpu.state_dict()))
    gpu = Float16Module(gpu_config, gpu_model.cuda())
    gpu_loss = gpu(tokens.cuda(), positions.cuda(), None, labels=labels.cuda()).mean()
    gpu_loss.backward()
    assert abs(gpu_loss.item() - cpu_loss.item()) < 2e-2 * abs(cpu_loss.item())
    for (name, p_cpu), p_gpu in zip(cpu.named_parameters(), gpu_model.parameters()):
        g_cpu, g_gpu = p_cpu.grad, p_gpu.grad.float().cpu()
        rel = (g_gpu - g_cpu).norm() / g_cpu.norm().clamp_min(1e-12)
        assert rel < 0.1, (name, rel.item())
