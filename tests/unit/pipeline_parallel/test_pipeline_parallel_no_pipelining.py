"""forward_backward_no_pipelining and the step functions, in one process against direct autograd."""
import contextlib

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func, schedules
from megatron.core.pipeline_parallel.schedules import (
    backward_step,
    custom_backward,
    deallocate_output_tensor,
    forward_backward_no_pipelining,
)
from tests.unit.pipeline_parallel.toy_pipeline import (
    ToyStage,
    Wrapper,
    all_layer_params,
    assert_close,
    forward_step_func,
    legacy_forward_step_func,
    microbatches,
    reference,
    toy_config,
)

M, LAYERS = 3, 3


def _run(config, step_func=forward_step_func, forward_only=False, **kwargs):
    params = all_layer_params(LAYERS)
    model = Wrapper(ToyStage(config, range(LAYERS), params, True, True))
    batches = microbatches(M)
    losses = get_forward_backward_func()(
        forward_step_func=step_func,
        data_iterator=[iter(batches)],
        model=[model],
        num_microbatches=M,
        seq_length=6,
        micro_batch_size=2,
        forward_only=forward_only,
        **kwargs,
    )
    return losses, model.module, params, batches


def test_no_pipelining_matches_autograd_with_hooks():
    events = []

    @contextlib.contextmanager
    def no_sync():
        events.append("enter")
        yield
        events.append("exit")

    finalize_calls = []
    config = toy_config(num_layers=LAYERS, deallocate_pipeline_outputs=True)
    config.no_sync_func = no_sync
    config.grad_scale_func = lambda loss: loss * 4.0
    config.finalize_model_grads_func = lambda models, num_tokens: finalize_calls.append((models, num_tokens))
    calls = []

    def counting_step(data_iterator, model):
        calls.append(list(events))
        return forward_step_func(data_iterator, model)

    losses, model, params, batches = _run(config, counting_step)
    sums, counts, grads = reference(params, batches, grad_scale=4.0)
    assert [float(l["lm loss"][0]) for l in losses] == pytest.approx(sums, rel=1e-6)
    assert [int(l["lm loss"][1]) for l in losses] == counts
    for i, (w, b) in model.grads().items():
        assert_close(w, grads[i][0], what=f"layer {i} weight")
        assert_close(b, grads[i][1], what=f"layer {i} bias")
    assert events == ["enter", "exit"]
    assert calls == [["enter"], ["enter"], ["enter", "exit"]]
    assert len(finalize_calls) == 1 and finalize_calls[0][1] is None
    assert isinstance(finalize_calls[0][0], list) and len(finalize_calls[0][0]) == 1


def test_per_token_legacy_forward_only_and_non_loss_data():
    finalize_calls = []
    config = toy_config(num_layers=LAYERS, calculate_per_token_loss=True)
    config.finalize_model_grads_func = lambda models, num_tokens: finalize_calls.append(num_tokens)
    losses, model, params, batches = _run(config)
    _, counts, grads = reference(params, batches, per_token=True)
    assert int(finalize_calls[0]) == sum(counts)
    for i, (w, _) in model.grads().items():
        assert_close(w, grads[i][0], what=f"per-token layer {i}")

    config = toy_config(num_layers=LAYERS)
    losses, model, params, batches = _run(config, legacy_forward_step_func)
    sums, _, grads = reference(params, batches, legacy=True)
    assert [float(l["lm loss"]) for l in losses] == pytest.approx(sums, rel=1e-6)
    for i, (w, _) in model.grads().items():
        assert_close(w, grads[i][0], what=f"legacy layer {i}")

    finalize_calls.clear()
    config = toy_config(num_layers=LAYERS)
    config.finalize_model_grads_func = lambda models, num_tokens: finalize_calls.append(num_tokens)
    losses, model, _, _ = _run(config, forward_only=True)
    assert len(losses) == M and not finalize_calls
    assert all(l.weight.grad is None for l in model.layers)

    def non_loss_step(data_iterator, model):
        output = model(next(data_iterator)["x"])
        return output, lambda out, non_loss_data=False: {"mean": out.mean().item(), "flag": non_loss_data}

    losses, _, _, _ = _run(toy_config(num_layers=LAYERS), non_loss_step, forward_only=True, collect_non_loss_data=True)
    assert [l["flag"] for l in losses] == [True] * M


def test_schedule_argument_errors_and_custom_backward():
    config = toy_config(num_layers=LAYERS)
    model = ToyStage(config, range(LAYERS), all_layer_params(LAYERS), True, True)
    with pytest.raises(ValueError, match="1-element list"):
        forward_backward_no_pipelining(
            forward_step_func=forward_step_func, data_iterator=[iter([]), iter([])], model=[model, model],
            num_microbatches=1, seq_length=6, micro_batch_size=2,
        )
    x = torch.randn(4, 3, requires_grad=True)
    y = (x * 2.0).tanh()
    expected = torch.autograd.grad(y, x, torch.ones_like(y), retain_graph=True)[0]
    deallocate_output_tensor(y, deallocate_pipeline_outputs=True)
    assert y.numel() == 1
    custom_backward(y, torch.ones(4, 3))
    assert_close(x.grad, expected, what="custom_backward")
    view = torch.randn(4, 4, requires_grad=True).view(16)  # [4, 4] -> [16]
    with pytest.raises(RuntimeError, match="view"):
        deallocate_output_tensor(view, deallocate_pipeline_outputs=True)
    inp = torch.randn(2, 2, requires_grad=True)
    out = inp * 3.0
    grad = backward_step([inp], [out], [torch.ones(2, 2)], None, config)
    assert_close(grad[0], torch.full((2, 2), 3.0), what="backward_step input grad")


def test_get_forward_backward_func_dispatch():
    assert get_forward_backward_func() is schedules.forward_backward_no_pipelining
    parallel_state.set_pipeline_model_parallel_world_size(4)
    assert get_forward_backward_func() is schedules.forward_backward_pipelining_without_interleaving
    parallel_state.set_virtual_pipeline_model_parallel_world_size(2)
    assert get_forward_backward_func() is schedules.forward_backward_pipelining_with_interleaving
    parallel_state.destroy_model_parallel()
    assert get_forward_backward_func(pp_size=2) is schedules.forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(pp_size=2, vp_size=2) is schedules.forward_backward_pipelining_with_interleaving
    shapes = schedules.get_tensor_shapes(
        seq_length=32, micro_batch_size=3, config=toy_config(num_layers=2), tp_size=2, cp_size=2
    )
    assert shapes == [(16, 3, 8)]
    sp_config = toy_config(num_layers=2, num_attention_heads=2, tensor_model_parallel_size=2, sequence_parallel=True)
    assert schedules.get_tensor_shapes(seq_length=32, micro_batch_size=3, config=sp_config, tp_size=2, cp_size=2) == [
        (8, 3, 8)
    ]
