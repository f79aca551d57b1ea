"""The one runner of pipeline schedules: executes an action list from `schedule_table`.

Compute actions call `forward_step` / `backward_step` on the right model chunk; consecutive p2p
actions with the same `batch` number become one batched exchange through `p2p_communication`.
Tensors are kept per (microbatch, chunk), so the runner needs no knowledge of which schedule
produced the list. The gradient-synchronisation hooks (`no_sync_func`, `grad_sync_func`,
`param_sync_func`) differ per schedule family and live in small `GradSync` classes.
"""
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import p2p_communication
from megatron.core.pipeline_parallel.schedule_table import (
    BACKWARD,
    FORWARD,
    RECV_BACKWARD,
    RECV_FORWARD,
    SEND_BACKWARD,
    SEND_FORWARD,
    Action,
)
from megatron.core.pipeline_parallel.step import (
    backward_step,
    check_first_val_step,
    deallocate_output_tensor,
    forward_step,
)
from megatron.core.utils import get_torch_device_type


class GradSync:
    """Enter/exit the models' `no_sync` context; the base policy used without pipelining.

    Microbatches 0..M-2 run inside `config.no_sync_func()`; the last one outside, so that DDP
    launches its gradient reduction during the last backward.
    """

    def __init__(self, config, models: Sequence[torch.nn.Module], num_microbatches: int, forward_only: bool):
        self.config, self.models = config, list(models)
        self.num_microbatches, self.forward_only = num_microbatches, forward_only
        self._context = None

    def _no_sync(self):
        func = self.config.no_sync_func
        if func is None:
            return contextlib.nullcontext()
        if isinstance(func, (list, tuple)):
            stack = contextlib.ExitStack()
            for chunk_func in func:
                stack.enter_context(chunk_func())
            return stack
        return func()

    def disable(self) -> None:
        if self._context is None:
            self._context = self._no_sync()
            self._context.__enter__()

    def enable(self) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None

    def start(self) -> None:
        self.disable()

    def before_forward(self, ordinal: int, action: Action) -> None:
        if action.microbatch == self.num_microbatches - 1:
            self.enable()

    def before_backward(self, ordinal: int, action: Action) -> None:
        return

    def after_backward(self, ordinal: int, action: Action) -> None:
        return

    def finish(self) -> None:
        self.enable()


class OneFOneBGradSync(GradSync):
    """1F1B: sync is re-enabled before the last backward (rank 0, or everywhere without grad_sync_func)."""

    def __init__(self, config, models, num_microbatches, forward_only, pp_rank: int):
        super().__init__(config, models, num_microbatches, forward_only)
        self.pp_rank = pp_rank

    def before_forward(self, ordinal, action):
        return

    def before_backward(self, ordinal, action):
        if action.microbatch == self.num_microbatches - 1:
            if self.config.grad_sync_func is None or self.pp_rank == 0:
                self.enable()

    def finish(self):
        if self._context is not None and not self.forward_only:
            self.enable()
            if self.config.grad_sync_func is not None:
                self.config.grad_sync_func(self.models[0].parameters())
        self.enable()


class InterleavedGradSync(GradSync):
    """Interleaved: per-chunk grad sync after each chunk's last backward, param sync ahead of forwards."""

    def __init__(self, config, models, num_microbatches, forward_only, pp_rank, table: List[Tuple[int, int]]):
        super().__init__(config, models, num_microbatches, forward_only)
        self.pp_rank, self.table = pp_rank, table
        self.chunks = len(self.models)
        self.synchronized = set()
        self.grad_sync = None if forward_only else self._per_chunk(config.grad_sync_func)
        self.param_sync = None if forward_only else self._per_chunk(config.param_sync_func)

    def _per_chunk(self, func):
        if func is None or isinstance(func, (list, tuple)):
            return func
        return [func] * self.chunks

    def _is_last_microbatch(self, virtual_id: int) -> bool:
        return 0 <= virtual_id < len(self.table) and self.table[virtual_id][0] == self.num_microbatches - 1

    def start(self):
        self.disable()
        if self.param_sync is not None:
            for chunk in range(min(2, self.chunks)):
                self.param_sync[chunk](self.models[chunk].parameters())

    def before_forward(self, ordinal, action):
        if self.param_sync is None:
            return
        sync_id = ordinal + self.pp_rank
        if sync_id < len(self.table) and self.table[sync_id][0] == 0:
            chunk = self.table[sync_id][1] + 1
            if 1 < chunk < self.chunks:
                self.param_sync[chunk](self.models[chunk].parameters())

    def before_backward(self, ordinal, action):
        if self.grad_sync is None and self._is_last_microbatch(ordinal):
            self.enable()
            self.synchronized.add(action.chunk)

    def after_backward(self, ordinal, action):
        if self.grad_sync is not None:
            sync_id = ordinal - self.pp_rank
            if self._is_last_microbatch(sync_id):
                chunk = self.chunks - 1 - self.table[sync_id][1]
                self.enable()
                self.grad_sync[chunk](self.models[chunk].parameters())
                self.synchronized.add(chunk)
        self.disable()

    def finish(self):
        self.enable()
        if self.forward_only or self.grad_sync is None:
            return
        for chunk in range(self.chunks):
            if chunk not in self.synchronized:
                self.grad_sync[chunk](self.models[chunk].parameters())
                self.synchronized.add(chunk)


@dataclass
class ScheduleRun:
    """Everything the runner needs besides the action list."""

    forward_step_func: Callable
    """The user's `forward_step_func(data_iterator, model) -> (output, loss_func)`."""

    data_iterators: List[Any]
    """One data iterator per model chunk."""

    models: List[torch.nn.Module]
    """This rank's model chunks (one without a virtual pipeline)."""

    config: Any
    """The model's `TransformerConfig` (hooks, timers, p2p options)."""

    num_microbatches: int
    """Microbatches per iteration (per chunk)."""

    grad_sync: GradSync
    """Gradient/parameter synchronisation policy of the schedule family."""

    forward_only: bool = False
    """Evaluation: no backward, no gradient hooks, no finalisation."""

    collect_non_loss_data: bool = False
    """Call `loss_func(output, non_loss_data=True)` and store its result instead of the loss report."""

    first_val_step: Optional[bool] = None
    """Overrides `is_first_microbatch` during validation (TE weight caching)."""

    communicator: Optional[p2p_communication.P2PCommunicator] = None
    """Pipeline p2p endpoint; None without pipelining."""

    recv_shapes: List[Any] = field(default_factory=list)
    """Shapes of the activations received from the previous stage."""

    send_shapes: List[Any] = field(default_factory=list)
    """Shapes of the activations sent to the next stage (and of the gradients received back)."""

    pp_rank: int = 0
    """Pipeline rank of this process."""

    pp_size: int = 1
    """Pipeline-parallel size."""

    virtual: bool = False
    """Interleaved schedule: set parallel_state's virtual pipeline rank around each step."""

    model_type: Any = None
    """The model's `ModelType` (passed through to `backward_step`)."""

    cp_group_size: int = 1
    """Context-parallel size (legacy 2-tuple losses are multiplied by it)."""

    num_warmup: int = 0
    """Warm-up forwards of this rank (for partial activation checkpointing)."""


_TIMER_NAMES = {
    frozenset([RECV_FORWARD]): "forward-recv",
    frozenset([SEND_FORWARD]): "forward-send",
    frozenset([RECV_BACKWARD]): "backward-recv",
    frozenset([SEND_BACKWARD]): "backward-send",
    frozenset([SEND_FORWARD, RECV_BACKWARD]): "forward-send-backward-recv",
    frozenset([SEND_BACKWARD, RECV_FORWARD]): "backward-send-forward-recv",
    frozenset([SEND_FORWARD, RECV_FORWARD]): "forward-send-forward-recv",
    frozenset([SEND_BACKWARD, RECV_BACKWARD]): "backward-send-backward-recv",
}


def _timer_name(kinds) -> str:
    """Megatron's p2p timer name for a batched call made of these intents."""
    return _TIMER_NAMES.get(frozenset(kinds), "forward-backward-send-forward-backward-recv")


class _Runner:
    """Per-call state of one schedule execution: tensors keyed by (microbatch, chunk)."""

    def __init__(self, run: ScheduleRun):
        self.run = run
        self.chunks = len(run.models)
        self.inputs: Dict[Tuple[int, int], list] = {}
        self.out_grads: Dict[Tuple[int, int], list] = {}
        self.saved: Dict[Tuple[int, int], Tuple[list, list]] = {}
        self.to_send_next: Dict[Tuple[int, int], list] = {}
        self.to_send_prev: Dict[Tuple[int, int], list] = {}
        self.forward_data_store: list = []
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=get_torch_device_type())
        self.forward_ordinal = 0
        self.backward_ordinal = 0

    def is_first(self, chunk: int) -> bool:
        return self.run.pp_rank == 0 and chunk == 0

    def is_last(self, chunk: int) -> bool:
        return self.run.pp_rank == self.run.pp_size - 1 and chunk == self.chunks - 1

    def _set_chunk(self, chunk: int) -> None:
        if self.run.virtual:
            parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)

    def _checkpoint_flag(self) -> Optional[bool]:
        limit = getattr(self.run.config, "num_microbatches_with_partial_activation_checkpoints", None)
        if limit is None or self.run.communicator is None:
            return None
        return (self.forward_ordinal % (self.run.num_warmup + 1)) >= limit

    def forward(self, action: Action) -> None:
        run, key, chunk = self.run, (action.microbatch, action.chunk), action.chunk
        self._set_chunk(chunk)
        run.grad_sync.before_forward(self.forward_ordinal, action)
        if self.is_first(chunk):
            input_tensor = [None] * max(1, len(run.recv_shapes))
        elif key in self.inputs:
            input_tensor = self.inputs.pop(key)
        else:
            raise RuntimeError(f"pipeline schedule bug: forward of {key} on rank {run.pp_rank} before its input arrived")
        output_tensor, num_tokens = forward_step(
            run.forward_step_func,
            run.data_iterators[chunk],
            run.models[chunk],
            run.num_microbatches,
            input_tensor,
            self.forward_data_store,
            run.config,
            collect_non_loss_data=run.collect_non_loss_data,
            checkpoint_activations_microbatch=self._checkpoint_flag(),
            is_first_microbatch=check_first_val_step(run.first_val_step, run.forward_only, action.microbatch == 0),
            current_microbatch=action.microbatch,
            vp_stage=chunk if run.virtual else None,
            is_last_stage=self.is_last(chunk),
            cp_group_size=run.cp_group_size,
        )
        if self.is_last(chunk):
            # Only the last stage counts tokens; elsewhere num_tokens is a host zero, and copying it from
            # pageable memory would synchronise the host with the GPU once per micro-batch.
            self.total_num_tokens += torch.as_tensor(num_tokens).to(self.total_num_tokens.device, torch.int)
        self.forward_ordinal += 1
        if not self.is_last(chunk):
            self.to_send_next[key] = output_tensor
        if not run.forward_only:
            self.saved[key] = (input_tensor, output_tensor)

    def backward(self, action: Action) -> None:
        run, key, chunk = self.run, (action.microbatch, action.chunk), action.chunk
        self._set_chunk(chunk)
        run.grad_sync.before_backward(self.backward_ordinal, action)
        input_tensor, output_tensor = self.saved.pop(key)
        output_grad = self.out_grads.pop(key, None) or [None] * len(output_tensor)
        input_grad = backward_step(input_tensor, output_tensor, output_grad, run.model_type, run.config)
        if not self.is_first(chunk):
            self.to_send_prev[key] = input_grad
        run.grad_sync.after_backward(self.backward_ordinal, action)
        self.backward_ordinal += 1

    def communicate(self, call: List[Action]) -> None:
        run = self.run
        by_kind = {a.kind: (a.microbatch, a.chunk) for a in call}
        if len(by_kind) != len(call):
            raise RuntimeError(f"a batched p2p call may hold one action of each kind, got {call}")
        sent = self.to_send_next.pop(by_kind[SEND_FORWARD]) if SEND_FORWARD in by_kind else []
        grads = self.to_send_prev.pop(by_kind[SEND_BACKWARD]) if SEND_BACKWARD in by_kind else []
        recv_prev_shapes = run.recv_shapes if RECV_FORWARD in by_kind else []
        recv_next_shapes = run.send_shapes if RECV_BACKWARD in by_kind else []
        timers = run.config.timers
        if timers is not None:
            timers(_timer_name(by_kind), log_level=2).start()
        from_prev, from_next = p2p_communication.exchange(
            run.communicator, sent, grads, recv_prev_shapes, recv_next_shapes
        )
        if timers is not None:
            timers(_timer_name(by_kind)).stop()
        if RECV_FORWARD in by_kind:
            self.inputs[by_kind[RECV_FORWARD]] = from_prev
        if RECV_BACKWARD in by_kind:
            self.out_grads[by_kind[RECV_BACKWARD]] = from_next
        if sent and not run.forward_only:
            deallocate_output_tensor(sent[0], run.config.deallocate_pipeline_outputs)


def run_schedule(actions: Sequence[Action], run: ScheduleRun) -> Tuple[list, torch.Tensor]:
    """Execute `actions`; returns (per-microbatch loss reports, total number of tokens)."""
    runner = _Runner(run)
    previous_vp_rank = parallel_state.get_virtual_pipeline_model_parallel_rank() if run.virtual else None
    run.grad_sync.start()
    i = 0
    while i < len(actions):
        action = actions[i]
        if action.kind == FORWARD:
            runner.forward(action)
            i += 1
        elif action.kind == BACKWARD:
            runner.backward(action)
            i += 1
        else:
            j = i
            while j < len(actions) and actions[j].is_p2p and actions[j].batch == action.batch:
                j += 1
            runner.communicate(list(actions[i:j]))
            i = j
    run.grad_sync.finish()
    if run.virtual:
        parallel_state.set_virtual_pipeline_model_parallel_rank(previous_vp_rank)
    return runner.forward_data_store, runner.total_num_tokens
