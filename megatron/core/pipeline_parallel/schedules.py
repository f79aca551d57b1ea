"""Megatron's forward/backward schedules: `get_forward_backward_func()` and the three schedules.

Each schedule builds its action list with a pure function of `schedule_table` and hands it to the
one runner in `executor`. The functions keep Megatron Core's keyword-only signature; they return
the per-microbatch loss reports on the last pipeline stage and `[]` elsewhere.
"""
import contextlib
from typing import Callable, Iterator, List, Optional, Union

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.executor import (
    GradSync,
    InterleavedGradSync,
    OneFOneBGradSync,
    ScheduleRun,
    run_schedule,
)
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedule_table import (
    convert_schedule_table_to_order,
    get_schedule_table,
    interleaved_schedule,
    no_pipelining_schedule,
    num_warmup_microbatches_1f1b,
    num_warmup_microbatches_interleaved,
    one_f_one_b_schedule,
)
from megatron.core.pipeline_parallel.step import (
    backward_step,
    check_first_val_step,
    custom_backward,
    deallocate_output_tensor,
    forward_step,
    forward_step_calc_loss,
    set_current_microbatch,
)
from megatron.core.tensor_parallel.wgrad_deferral import drain_embedding_wgrad_compute
from megatron.core.utils import get_attr_wrapped_model, get_model_config, get_model_type as _get_model_type

__all__ = [
    "get_forward_backward_func",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
    "forward_step",
    "backward_step",
    "custom_backward",
    "deallocate_output_tensor",
    "get_tensor_shapes",
    "check_first_val_step",
    "get_schedule_table",
    "convert_schedule_table_to_order",
    "get_pp_rank_microbatches",
    "forward_step_calc_loss",
    "set_current_microbatch",
    "clear_embedding_activation_buffer",
    "finish_embedding_wgrad_compute",
]


def get_forward_backward_func(pp_size: Optional[int] = None, vp_size: Optional[int] = None) -> Callable:
    """The schedule for the current parallel layout (sizes default to parallel_state's).

    PP == 1: `forward_backward_no_pipelining`; PP > 1 without a virtual pipeline: 1F1B
    (`forward_backward_pipelining_without_interleaving`); PP > 1 with one: interleaved 1F1B.
    """
    if pp_size is None:
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size() if vp_size is None else vp_size
    if pp_size > 1:
        if vp_size is not None:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


def get_pp_rank_microbatches(
    num_microbatches: int, num_model_chunks: int, microbatch_group_size_per_vp_stage: Optional[int],
    forward_only: bool = False,
):
    """(total virtual microbatches, all in warm-up?, warm-up count, remaining) for this pipeline rank."""
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    total = num_microbatches * num_model_chunks
    if forward_only:
        warmup = total
    elif pp_size == 1:
        warmup = 1
    elif parallel_state.get_virtual_pipeline_model_parallel_world_size() is None:
        warmup = num_warmup_microbatches_1f1b(pp_size, pp_rank, num_microbatches)
    else:
        group = microbatch_group_size_per_vp_stage or pp_size
        warmup = (pp_size - pp_rank - 1) * 2 + (num_model_chunks - 1) * group
    all_warmup = warmup >= total
    warmup = min(warmup, total)
    return total, all_warmup, warmup, total - warmup


def get_tensor_shapes(*, seq_length: int, micro_batch_size: int, decoder_seq_length: Optional[int] = None, config,
                      tp_size: Optional[int] = None, cp_size: Optional[int] = None) -> List[tuple]:
    """Shapes of the activations sent between stages: `[(s/cp [/tp with SP], b, h)]`."""
    cp_size = parallel_state.get_context_parallel_world_size() if cp_size is None else cp_size
    tp_size = parallel_state.get_tensor_model_parallel_world_size() if tp_size is None else tp_size
    seq = seq_length // cp_size
    if config.sequence_parallel:
        seq = seq // tp_size
    return [(seq, micro_batch_size, config.hidden_size)]


def get_model_type(model):
    """The model's `ModelType`, or None for a model that does not declare one."""
    try:
        return _get_model_type(model)
    except RuntimeError:
        return None


def _single(value, what: str):
    if isinstance(value, list):
        if len(value) != 1:
            raise ValueError(
                f"non-interleaved schedules take one {what} (or a 1-element list), got a list of {len(value)}; "
                "a list per model chunk needs a virtual pipeline (--num-layers-per-virtual-pipeline-stage)"
            )
        return value[0]
    return value


def clear_embedding_activation_buffer(config, model, is_last_stage: Optional[bool] = None):
    """With `defer_embedding_wgrad_compute` on the last pipeline stage: empty the output layer's kept
    activations (none may be left from an earlier schedule) and return the module owning the output layer
    (the last model chunk's); else None. `is_last_stage` defaults to parallel_state's answer."""
    if is_last_stage is None:
        is_last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    if not (is_last_stage and config.defer_embedding_wgrad_compute):
        return None
    chunk = model[-1] if isinstance(model, list) else model
    embedding_module = get_attr_wrapped_model(chunk, "post_process", return_model_obj=True)
    embedding_module.embedding_activation_buffer.clear()
    return embedding_module


def finish_embedding_wgrad_compute(config, embedding_module, is_last_stage: Optional[bool] = None, tp_group=None):
    """With `defer_embedding_wgrad_compute` on the last pipeline stage: compute the output layer's deferred
    weight gradients into its `main_grad` (`drain_embedding_wgrad_compute`), before the grads are finalized."""
    if is_last_stage is None:
        is_last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    if not (is_last_stage and config.defer_embedding_wgrad_compute):
        return
    weight = embedding_module.output_layer.weight
    if weight is None:
        weight = embedding_module.shared_embedding_or_output_weight()
    tp_group = tp_group if tp_group is not None else getattr(embedding_module.output_layer, "tp_group", None)
    drain_embedding_wgrad_compute(config, embedding_module.embedding_activation_buffer,
                                  embedding_module.grad_output_buffer, weight, tp_group)


def _start_embedding_wgrad_deferral(config, model, forward_only):
    if config.finalize_model_grads_func is None or forward_only:
        return None
    return clear_embedding_activation_buffer(config, model)


def _finalize(config, models, total_num_tokens, forward_only, embedding_module=None):
    if config.finalize_model_grads_func is not None and not forward_only:
        finish_embedding_wgrad_compute(config, embedding_module)
        num_tokens = total_num_tokens if getattr(config, "calculate_per_token_loss", False) else None
        config.finalize_model_grads_func(models, num_tokens)


@contextlib.contextmanager
def _forward_backward_timer(config):
    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
    yield
    if config.timers is not None:
        config.timers("forward-backward").stop()


def forward_backward_no_pipelining(
    *,
    forward_step_func,
    data_iterator: Union[Iterator, List[Iterator]],
    model: Union[torch.nn.Module, List[torch.nn.Module]],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    adjust_tensor_shapes_fn: Optional[Callable] = None,
):
    """Forward and backward of every microbatch on one stage (PP=1); grads sync on the last one."""
    if adjust_tensor_shapes_fn is not None:
        raise ValueError("adjust_tensor_shapes_fn is not supported without pipeline parallelism")
    model = _single(model, "model")
    data_iterator = _single(data_iterator, "data iterator")
    config = get_model_config(model)
    run = ScheduleRun(
        forward_step_func=forward_step_func,
        data_iterators=[data_iterator],
        models=[model],
        config=config,
        num_microbatches=num_microbatches,
        grad_sync=GradSync(config, [model], num_microbatches, forward_only),
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step,
        model_type=get_model_type(model),
        cp_group_size=parallel_state.get_context_parallel_world_size(),
    )
    with _forward_backward_timer(config):
        store, total_num_tokens = run_schedule(no_pipelining_schedule(num_microbatches, forward_only), run)
        _finalize(config, [model], total_num_tokens, forward_only)
    return store


def _communicator(config, p2p_communicator: Optional[P2PCommunicator]) -> P2PCommunicator:
    if p2p_communicator is not None:
        return p2p_communicator
    return P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), config)


def forward_backward_pipelining_without_interleaving(
    *,
    forward_step_func,
    data_iterator: Union[Iterator, List[Iterator]],
    model: Union[torch.nn.Module, List[torch.nn.Module]],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    adjust_tensor_shapes_fn: Optional[Callable] = None,
    p2p_communicator: Optional[P2PCommunicator] = None,
):
    """1F1B: warm-up forwards, steady one-forward-one-backward, cool-down backwards.

    `p2p_communicator` (an addition of newer Megatron Core) selects the pipeline group explicitly;
    by default it is parallel_state's.
    """
    model = _single(model, "model")
    data_iterator = _single(data_iterator, "data iterator")
    config = get_model_config(model)
    if config.overlap_p2p_comm:
        raise ValueError(
            "overlap_p2p_comm=True needs the interleaved schedule: the non-interleaved pipeline schedule does not "
            "overlap p2p communication (pass --no-overlap-p2p-communication or use a virtual pipeline)"
        )
    comm = _communicator(config, p2p_communicator)
    recv_shapes = get_tensor_shapes(
        seq_length=seq_length, micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length, config=config
    )
    send_shapes = list(recv_shapes)
    if adjust_tensor_shapes_fn is not None:
        recv_shapes, send_shapes = adjust_tensor_shapes_fn(recv_shapes, send_shapes)
    run = ScheduleRun(
        forward_step_func=forward_step_func,
        data_iterators=[data_iterator],
        models=[model],
        config=config,
        num_microbatches=num_microbatches,
        grad_sync=OneFOneBGradSync(config, [model], num_microbatches, forward_only, comm.pp_rank),
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step,
        communicator=comm,
        recv_shapes=list(recv_shapes),
        send_shapes=list(send_shapes),
        pp_rank=comm.pp_rank,
        pp_size=comm.pp_size,
        model_type=get_model_type(model),
        cp_group_size=parallel_state.get_context_parallel_world_size(),
        num_warmup=num_warmup_microbatches_1f1b(comm.pp_size, comm.pp_rank, num_microbatches),
    )
    actions = one_f_one_b_schedule(comm.pp_size, comm.pp_rank, num_microbatches, forward_only)
    with _forward_backward_timer(config):
        embedding_module = _start_embedding_wgrad_deferral(config, model, forward_only)
        store, total_num_tokens = run_schedule(actions, run)
        _finalize(config, [model], total_num_tokens, forward_only, embedding_module)
    return store


def forward_backward_pipelining_with_interleaving(
    *,
    forward_step_func,
    data_iterator: Union[Iterator, List[Iterator]],
    model: Union[torch.nn.Module, List[torch.nn.Module]],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    adjust_tensor_shapes_fn: Optional[Callable] = None,
    p2p_communicator: Optional[P2PCommunicator] = None,
):
    """Interleaved 1F1B over the model chunks of this rank (`model` and `data_iterator` are lists).

    Order: Megatron's `get_schedule_table(M, chunks, microbatch_group_size_per_vp_stage)`; warm-up
    `(PP - rank - 1) * 2 + (chunks - 1) * group`. `overlap_p2p_comm` is accepted and runs the same
    order with blocking exchanges.
    """
    if not isinstance(model, list) or not isinstance(data_iterator, list):
        raise ValueError("the interleaved schedule needs a list of model chunks and a list of data iterators")
    if len(model) != len(data_iterator):
        raise ValueError(f"got {len(model)} model chunks but {len(data_iterator)} data iterators: pass one per chunk")
    config = get_model_config(model[0])
    if config.overlap_p2p_comm and config.batch_p2p_comm:
        raise ValueError("overlap_p2p_comm and batch_p2p_comm are mutually exclusive: turn one of them off")
    if adjust_tensor_shapes_fn is not None:
        raise ValueError("adjust_tensor_shapes_fn is not supported by the interleaved pipeline schedule")
    comm = _communicator(config, p2p_communicator)
    chunks = len(model)
    group = config.microbatch_group_size_per_vp_stage or comm.pp_size
    actions = interleaved_schedule(comm.pp_size, chunks, num_microbatches, comm.pp_rank, group, forward_only)
    shapes = get_tensor_shapes(seq_length=seq_length, micro_batch_size=micro_batch_size, config=config)
    table = get_schedule_table(num_microbatches, chunks, group)
    run = ScheduleRun(
        forward_step_func=forward_step_func,
        data_iterators=list(data_iterator),
        models=list(model),
        config=config,
        num_microbatches=num_microbatches,
        grad_sync=InterleavedGradSync(config, model, num_microbatches, forward_only, comm.pp_rank, table),
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step,
        communicator=comm,
        recv_shapes=shapes,
        send_shapes=list(shapes),
        pp_rank=comm.pp_rank,
        pp_size=comm.pp_size,
        virtual=True,
        model_type=get_model_type(model[0]),
        cp_group_size=parallel_state.get_context_parallel_world_size(),
        num_warmup=num_warmup_microbatches_interleaved(
            comm.pp_size, comm.pp_rank, num_microbatches, chunks, group, forward_only
        ),
    )
    with _forward_backward_timer(config):
        embedding_module = _start_embedding_wgrad_deferral(config, model, forward_only)
        store, total_num_tokens = run_schedule(actions, run)
        _finalize(config, list(model), total_num_tokens, forward_only, embedding_module)
    return store
