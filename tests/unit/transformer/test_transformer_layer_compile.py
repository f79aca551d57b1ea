"""The layer-compile wrapper: the switch, and a compiled block computing what the eager block computes.

The compiled run uses dynamo's 'eager' backend (graph capture without code generation) so the test stays
cheap on CPU; CUDA with the inductor backend is covered by tests/unit/fusions/test_fusions_gpu.py.
"""
import functools

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import layer_compile, transformer_block
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit.transformer.model_setup import init_single_rank, seed_all


def _model():
    seed_all(11)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=True)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)


def test_layer_compile_switch_and_compiled_block_matches_eager(monkeypatch):
    init_single_rank()
    monkeypatch.delenv("MEGATRON_COMPILE_LAYERS", raising=False)
    eager = _model()
    assert not any(getattr(layer, "is_compiled", False) for layer in eager.decoder.layers)  # auto: never on CPU
    monkeypatch.setenv("MEGATRON_COMPILE_LAYERS", "sometimes")
    with pytest.raises(ValueError, match="MEGATRON_COMPILE_LAYERS"):
        _model()

    monkeypatch.setenv("MEGATRON_COMPILE_LAYERS", "1")
    monkeypatch.setattr(transformer_block, "compile_forward",
                        functools.partial(layer_compile.compile_forward, backend="eager"))
    compiled = _model()
    assert all(layer.is_compiled for layer in compiled.decoder.layers)
    assert compiled.state_dict().keys() == eager.state_dict().keys()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(16).expand(2, 16)
    losses = []
    for model in (eager, compiled):
        loss = model(tokens, position_ids, None, labels=tokens).mean()
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0])
    for a, b in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_auto_compiles_only_large_cuda_layers(monkeypatch):
    monkeypatch.delenv("MEGATRON_COMPILE_LAYERS", raising=False)

    class FakeBlock(torch.nn.Module):
        def __init__(self, hidden_size, on_cuda, tp=1, sp=False):
            super().__init__()
            self.config = type("Config", (), {"hidden_size": hidden_size, "tensor_model_parallel_size": tp,
                                              "sequence_parallel": sp})()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.on_cuda = on_cuda

        def parameters(self, recurse=True):
            weight = type("P", (), {"is_cuda": self.on_cuda})()
            return iter([weight])

    assert layer_compile.layer_compile_requested(FakeBlock(2048, True))
    assert not layer_compile.layer_compile_requested(FakeBlock(1024, True))
    assert not layer_compile.layer_compile_requested(FakeBlock(4096, False))
    # tensor + sequence parallel layers only when forced (see the module docstring)
    assert layer_compile.layer_compile_requested(FakeBlock(2048, True, tp=2))
    assert not layer_compile.layer_compile_requested(FakeBlock(2048, True, tp=2, sp=True))
    monkeypatch.setenv("MEGATRON_COMPILE_LAYERS", "1")
    assert layer_compile.layer_compile_requested(FakeBlock(2048, True, tp=2, sp=True))
    monkeypatch.setenv("MEGATRON_COMPILE_LAYERS", "0")
    assert not layer_compile.layer_compile_requested(FakeBlock(2048, True))


@pytest.mark.parametrize("trace_linears", ["0", "1"])
def test_compiled_layers_with_ddp_main_grad_match_eager(monkeypatch, trace_linears):
    """With DDP's `main_grad` and gradient-accumulation fusion, compiled layers (AOTAutograd included) give
    the eager model's `main_grad`. By default the linears run eagerly inside the compiled layer (the graph
    is split at each of them); with MEGATRON_COMPILE_LINEARS=1 they are traced: one graph, no break (an
    attribute set inside their backward once made dynamo give up on them)."""
    from torch._dynamo.utils import counters

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    init_single_rank()
    monkeypatch.setenv("MEGATRON_COMPILE_LINEARS", trace_linears)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    position_ids = torch.arange(16).expand(2, 16)
    grads = []
    for mode in ("0", "1"):
        monkeypatch.setenv("MEGATRON_COMPILE_LAYERS", mode)
        monkeypatch.setattr(transformer_block, "compile_forward",
                            functools.partial(layer_compile.compile_forward, backend="aot_eager"))
        torch._dynamo.reset()
        counters.clear()
        model = _model()
        model.config.gradient_accumulation_fusion = True
        for module in model.modules():
            if hasattr(module, "gradient_accumulation_fusion"):
                module.gradient_accumulation_fusion = True
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
        ddp.zero_grad_buffer()
        ddp(tokens, position_ids, None, labels=tokens).float().mean().backward()
        grads.append({name: param.main_grad.clone() for name, param in model.named_parameters()})
        if mode == "1":
            breaks = sum(counters["graph_break"].values())
            assert (breaks == 0) if trace_linears == "1" else (breaks > 0), dict(counters["graph_break"])
    for name, grad in grads[0].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)
