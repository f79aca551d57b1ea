"""Compiled transformer layers (the plan's `--compile-layers` / `--compile-linears`): a compiled block computes
what the eager block computes, and a compiler failure is an error naming the layer and the flag.

The compiled runs use dynamo's 'eager' / 'aot_eager' backends (graph capture without code generation) so the
test stays cheap on CPU; CUDA with the inductor backend is covered by tests/unit/fusions/test_fusions_gpu.py.
The `auto` rule itself is tested on the plan (tests/unit/optimization_plan/test_plan.py).
"""
import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimization_plan.resolve import Decision
from megatron.core.transformer.layer_compile import LayerCompileError, compile_forward
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit.transformer.model_setup import apply_plan, init_single_rank, seed_all


def _model(**overrides):
    seed_all(11)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=True, **overrides)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)


def test_compiled_block_matches_eager_and_a_compile_failure_names_the_flag():
    init_single_rank()
    eager, plan = apply_plan(_model())
    assert plan.compile_layers.value is False  # auto: never on CPU
    assert not any(getattr(layer, "is_compiled", False) for layer in eager.decoder.layers)
    compiled, plan = apply_plan(_model(compile_layers="on"), compile_backend="eager")
    assert plan.compile_layers == Decision(True, "--compile-layers on")
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

    def broken_backend(graph_module, example_inputs):
        raise RuntimeError("no code for this graph")

    layer = torch.nn.Linear(4, 4)
    layer.layer_number = 7
    compile_forward(layer, backend=broken_backend)
    with pytest.raises(LayerCompileError, match=r"torch.compile of Linear 7 failed \(turn layer compilation off "
                                                r"with --compile-layers off"):
        layer(torch.ones(2, 4))


@pytest.mark.parametrize("trace_linears", ["off", "on"])
def test_compiled_layers_with_ddp_main_grad_match_eager(trace_linears):
    """With DDP's `main_grad` and gradient-accumulation fusion, compiled layers (AOTAutograd included) give
    the eager model's `main_grad`. With `--compile-linears off` (auto) the linears run eagerly inside the
    compiled layer (the graph is split at each of them); with `on` they are traced: one graph, no break (an
    attribute set inside their backward once made dynamo give up on them)."""
    from torch._dynamo.utils import counters

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    init_single_rank()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    position_ids = torch.arange(16).expand(2, 16)
    grads = []
    for compile_layers in ("off", "on"):
        torch._dynamo.reset()
        counters.clear()
        model = _model(compile_layers=compile_layers, compile_linears=trace_linears, gradient_accumulation_fusion=True)
        _, plan = apply_plan(model, compile_backend="aot_eager")
        assert plan.compile_linears.value is (compile_layers == "on" and trace_linears == "on")
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
        ddp.zero_grad_buffer()
        ddp(tokens, position_ids, None, labels=tokens).float().mean().backward()
        grads.append({name: param.main_grad.clone() for name, param in model.named_parameters()})
        if compile_layers == "on":
            breaks = sum(counters["graph_break"].values())
            assert (breaks == 0) if trace_linears == "on" else (breaks > 0), dict(counters["graph_break"])
    for name, grad in grads[0].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)
