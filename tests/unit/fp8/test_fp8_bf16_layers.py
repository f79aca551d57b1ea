"""`--first-last-layers-bf16` / `--num-layers-at-start-in-bf16` / `--num-layers-at-end-in-bf16`: the edge layers
keep bf16 GEMMs (asserted per layer, by state and by output against the model without FP8), the middle layers
run FP8, the model trains; Megatron's rules for the flags (not with delayed scaling, counts per pipeline stage)."""
import pytest
import torch

from megatron.core.fp8.recipe import Fp8Recipe, fp8_config_problems
from tests.unit.transformer.model_setup import apply_plan, init_single_rank, seed_all


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=4, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                  use_cpu_initialization=True)
    fields.update(overrides)
    return TransformerConfig(**fields)


def _gpt(**overrides):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    seed_all(11)
    model = GPTModel(_config(**overrides), get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=32)
    return apply_plan(model)[0]


def _linears_fp8(layer):
    from megatron.core.tensor_parallel.layers import _ParallelLinearBase

    return [sub.fp8 is not None for sub in layer.modules() if isinstance(sub, _ParallelLinearBase)]


def _batch():
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 128, (2, 32), generator=generator)
    return tokens, torch.arange(32).expand(2, 32), torch.randint(0, 128, (2, 32), generator=generator)


def test_is_bf16_layer_counts_global_layers():
    recipe = Fp8Recipe("hybrid", "tensorwise", num_layers_at_start_in_bf16=2, num_layers_at_end_in_bf16=1,
                       num_layers=6)
    assert [recipe.is_bf16_layer(i) for i in range(6)] == [True, True, False, False, False, True]
    assert not recipe.is_bf16_layer(-1)
    assert not any(Fp8Recipe("hybrid").is_bf16_layer(i) for i in range(6))  # no edges without the flag
    config = _config(fp8="hybrid", fp8_recipe="tensorwise", first_last_layers_bf16=True,
                     num_layers_at_start_in_bf16=2, num_layers_at_end_in_bf16=0)
    assert Fp8Recipe.from_config(config).num_layers_at_start_in_bf16 == 2
    assert Fp8Recipe.from_config(_config(fp8="hybrid", num_layers_at_start_in_bf16=3)).num_layers_at_start_in_bf16 == 0


def test_megatron_rules_for_the_flags():
    delayed = _config(fp8="hybrid", first_last_layers_bf16=True)
    assert any("--fp8-recipe delayed" in problem for problem in fp8_config_problems(delayed))
    too_many = _config(fp8="hybrid", fp8_recipe="tensorwise", first_last_layers_bf16=True,
                       num_layers_at_start_in_bf16=3, num_layers_at_end_in_bf16=-1, pipeline_model_parallel_size=2,
                       pipeline_dtype=torch.float32)
    text = " ".join(fp8_config_problems(too_many))
    assert "--num-layers-at-start-in-bf16 (num_layers_at_start_in_bf16 (3))" in text and "(2)" in text
    assert "--num-layers-at-end-in-bf16 (num_layers_at_end_in_bf16 (-1))" in text
    fine = _config(fp8="hybrid", fp8_recipe="tensorwise", first_last_layers_bf16=True)
    assert fp8_config_problems(fine) == []


def test_edge_layers_stay_bf16_per_layer_and_the_model_trains():
    init_single_rank()
    plain = _gpt()
    model = _gpt(fp8="hybrid", fp8_recipe="tensorwise", first_last_layers_bf16=True, num_layers_at_start_in_bf16=1,
                 num_layers_at_end_in_bf16=2)
    layers = model.decoder.layers
    assert [layer.layer_number for layer in layers] == [1, 2, 3, 4]
    assert [all(_linears_fp8(layer)) for layer in layers] == [False, True, False, False]
    assert [any(_linears_fp8(layer)) for layer in layers] == [False, True, False, False]
    hidden = torch.randn(32, 2, 64, generator=torch.Generator().manual_seed(5))
    for index, (layer, reference) in enumerate(zip(layers, plain.decoder.layers)):
        with torch.no_grad():
            out, ref = layer(hidden, attention_mask=None)[0], reference(hidden, attention_mask=None)[0]
        if index == 1:  # the FP8 layer differs by the FP8 rounding, the bf16 ones not at all
            assert not torch.equal(out, ref) and (out - ref).norm() < 0.1 * ref.norm()
        else:
            assert torch.equal(out, ref), index
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    tokens, positions, labels = _batch()
    losses = []
    for _ in range(6):
        optimizer.zero_grad()
        loss = model(tokens, positions, None, labels=labels).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.1, losses


def test_plan_shows_the_bf16_edges():
    from megatron.core.optimization_plan.resolve import DeviceFacts, PlanError, resolve_plan

    plan = resolve_plan(_config(fp8="e4m3", fp8_recipe="tensorwise", first_last_layers_bf16=True), DeviceFacts())
    assert "first 1 / last 1 layers in bf16" in plan.fp8.shown
    with pytest.raises(PlanError, match="delayed scaling does not support"):
        resolve_plan(_config(fp8="e4m3", first_last_layers_bf16=True), DeviceFacts())
