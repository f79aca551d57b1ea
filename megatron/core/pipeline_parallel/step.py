"""One microbatch's forward and backward on one model chunk (Megatron's `forward_step` / `backward_step`).

`forward_step` runs the user's `forward_step_func(data_iterator, model)` and, on the last stage,
normalises the loss (the schedule's part of the loss chain, see the glossary in
`megatron/core/README.md`): a `(loss, num_tokens, report)` result is divided by `num_tokens` and
by `num_microbatches` unless `config.calculate_per_token_loss`; a legacy `(loss, report)` result is
multiplied by the context-parallel size and divided by `num_microbatches`.
"""
import contextlib
from typing import List, Optional

import torch
from torch.autograd import Variable

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.utils import set_aux_loss_scales
from megatron.core.utils import get_attr_wrapped_model, get_torch_device_type


def deallocate_output_tensor(out: Optional[torch.Tensor], deallocate_pipeline_outputs: bool = False) -> None:
    """Free an output that was sent to the next stage, keeping its autograd graph.

    Only `.grad_fn` is needed for the backward pass, so `.data` is swapped for a 1-element tensor.
    """
    if out is None or not deallocate_pipeline_outputs:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"expected a tensor to deallocate, got {type(out).__name__}")
    if out._base is not None:
        raise RuntimeError(
            "cannot free a pipeline output that is a view of another tensor: "
            "wrap the stage output with megatron.core.utils.make_viewless_tensor"
        )
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def custom_backward(output: torch.Tensor, grad_output: Optional[torch.Tensor]) -> None:
    """Backward through torch's engine directly, so a deallocated `output` (1-element data) is allowed.

    `torch.autograd.backward` checks that `grad_output` has `output`'s shape, which a freed output no
    longer has; the C++ engine only checks against the graph's recorded shapes.
    """
    if grad_output is None:
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)
    Variable._execution_engine.run_backward(
        (output,),
        (grad_output,),
        False,  # keep_graph
        False,  # create_graph
        (),  # inputs
        True,  # allow_unreachable
        True,  # accumulate_grad
    )


def check_first_val_step(first_val_step, forward_only: bool, cond: bool) -> bool:
    """Whether this is the first microbatch for TE's weight caching (validation may override)."""
    if first_val_step is not None and forward_only:
        return first_val_step and cond
    return cond


def set_current_microbatch(model, microbatch_id: int) -> None:
    """Record the microbatch index on every decoder layer (used by FP8 weight caching)."""
    try:
        decoder = get_attr_wrapped_model(model, "decoder")
    except RuntimeError:
        return
    if decoder is None:
        return
    for layer in getattr(decoder, "layers", []):
        layer.current_microbatch = microbatch_id


def _autocast(config):
    if getattr(config, "enable_autocast", False):
        return torch.autocast(get_torch_device_type(), dtype=config.autocast_dtype)
    return contextlib.nullcontext()


def forward_step_calc_loss(
    output_tensor, loss_func, num_microbatches, forward_data_store, config, collect_non_loss_data, cp_group_size
):
    """Apply the loss function on the last stage; returns (loss to backprop, num_tokens)."""
    num_tokens = torch.tensor(0, dtype=torch.int)
    if not collect_non_loss_data:
        outputs = loss_func(output_tensor)
        if len(outputs) == 3:
            output_tensor, num_tokens, loss_reduced = outputs
            if not getattr(config, "calculate_per_token_loss", False):
                output_tensor = output_tensor / num_tokens
                output_tensor = output_tensor / num_microbatches
        elif len(outputs) == 2:
            output_tensor, loss_reduced = outputs
            output_tensor = output_tensor * cp_group_size
            output_tensor = output_tensor / num_microbatches
        else:
            raise ValueError(
                f"loss_func returned {len(outputs)} values: it must return (loss, num_tokens, report_dict) "
                "or (loss, report_dict)"
            )
        forward_data_store.append(loss_reduced)
    else:
        forward_data_store.append(loss_func(output_tensor, non_loss_data=True))
    return output_tensor, num_tokens


def forward_step(
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    input_tensor,
    forward_data_store: list,
    config,
    cp_group_size: Optional[int] = None,
    collect_non_loss_data: bool = False,
    checkpoint_activations_microbatch: Optional[bool] = None,
    is_first_microbatch: bool = False,
    current_microbatch: Optional[int] = None,
    vp_stage: Optional[int] = None,
    is_last_stage: Optional[bool] = None,
):
    """Forward one microbatch; on the last stage also compute and normalise the loss.

    Returns `(output_tensor, num_tokens)`; `output_tensor` is a list when `input_tensor` was a list.
    `cp_group_size` and `is_last_stage` default to parallel_state's values.
    """
    if config.timers is not None:
        config.timers("forward-compute", log_level=2).start()
    if is_first_microbatch and hasattr(model, "set_is_first_microbatch"):
        model.set_is_first_microbatch()
    if current_microbatch is not None:
        set_current_microbatch(model, current_microbatch)
    unwrap_output_tensor = not isinstance(input_tensor, list)
    if unwrap_output_tensor:
        input_tensor = [input_tensor]
    get_attr_wrapped_model(model, "set_input_tensor")(input_tensor)
    with _autocast(config):
        if checkpoint_activations_microbatch is None:
            output_tensor, loss_func = forward_step_func(data_iterator, model)
        else:
            output_tensor, loss_func = forward_step_func(data_iterator, model, checkpoint_activations_microbatch)
    if is_last_stage is None:
        is_last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    num_tokens = torch.tensor(0, dtype=torch.int)
    if is_last_stage:
        if cp_group_size is None:
            cp_group_size = parallel_state.get_context_parallel_world_size()
        output_tensor, num_tokens = forward_step_calc_loss(
            output_tensor, loss_func, num_microbatches, forward_data_store, config, collect_non_loss_data,
            cp_group_size,
        )
    if config.timers is not None:
        config.timers("forward-compute").stop()
    if isinstance(output_tensor, torch.Tensor):
        set_aux_loss_scales(config, output_tensor.device, num_microbatches)
    if unwrap_output_tensor:
        return output_tensor, num_tokens
    return [output_tensor], num_tokens


def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
    """Backward one microbatch; returns the gradient of the input (a list if the input was a list).

    On the last stage (no `output_tensor_grad`) the loss is first scaled by `config.grad_scale_func`.
    """
    if config.timers is not None:
        config.timers("backward-compute", log_level=2).start()
    unwrap_input_tensor_grad = not isinstance(input_tensor, list)
    if unwrap_input_tensor_grad:
        input_tensor = [input_tensor]
    for x in input_tensor:
        if x is not None:
            x.retain_grad()
    output_tensor = list(output_tensor) if isinstance(output_tensor, list) else [output_tensor]
    output_tensor_grad = output_tensor_grad if isinstance(output_tensor_grad, list) else [output_tensor_grad]
    if output_tensor_grad[0] is None and config.grad_scale_func is not None:
        output_tensor[0] = config.grad_scale_func(output_tensor[0])
    if config.deallocate_pipeline_outputs:
        custom_backward(output_tensor[0], output_tensor_grad[0])
    else:
        torch.autograd.backward(output_tensor[0], grad_tensors=output_tensor_grad[0])
    input_tensor_grad: List[Optional[torch.Tensor]] = [None if x is None else x.grad for x in input_tensor]
    if config.timers is not None:
        config.timers("backward-compute").stop()
    return input_tensor_grad[0] if unwrap_input_tensor_grad else input_tensor_grad
