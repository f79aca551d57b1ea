"""Result validation for the training loop: the NaN/Inf loss check and the spiky-loss check.

This is the part of Megatron's rerun state machine that loss functions call (`validate_result`,
`is_unexpectedly_large`). It does not re-run iterations: in every mode a rejected fatal result raises a
`RuntimeError` naming the rank and iteration, and a rejected non-fatal result is logged. When the
training loop enables deferral (CUDA), a fatal check on a device tensor is queued in
`megatron.core.deferred_checks` and raised at the next flush instead of stalling the host now. The public
names, modes and call signatures are Megatron Core's, so loss functions written for Megatron work here.

Checkpoint state (Megatron Core 0.13.1's layout, so checkpoints move both ways): `state_dict()` is
`{"mode": RerunMode, "sharded": {"state": RerunState, "current_iteration", "rerun_requested", ...,
"error_injector_checkpoint", "large_value_counts", "max_values"}}`; for `torch_dist` the "sharded" part
is the ShardedObject `rerun_state_machine_state` on the (PP, TP) grid, one replica per DP rank. The
enums are pickled under these module paths, as Megatron's are.
"""
import logging
import math
import os
from enum import Enum
from typing import Any, Callable, Dict, NamedTuple, Optional

import torch

from megatron.core import parallel_state
from megatron.core.deferred_checks import get_deferred_checks
from megatron.core.dist_checkpointing.mapping import ShardedObject

logger = logging.getLogger(__name__)


_ELEMENTWISE_PREDICATES = (torch.isnan, torch.isinf, torch.isposinf, torch.isneginf)


class RerunMode(str, Enum):
    """Operating mode (`--rerun-mode`); the values are Megatron's, as pickled into its checkpoints."""

    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_DETERMINISM_STATS = "report_determinism_stats"

    @classmethod
    def _missing_(cls, value):
        # `--rerun-mode report_stats` is the command-line spelling of REPORT_DETERMINISM_STATS.
        return cls.REPORT_DETERMINISM_STATS if value == "report_stats" else None


class RerunState(Enum):
    """Where the state machine is within an iteration (Megatron's states; this version only ever reaches the
    first two, the others come from Megatron checkpoints)."""

    NOT_RUNNING_YET = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    WILL_RERUN_FROM_CHECKPOINT = 3
    RERUNNING_FROM_CHECKPOINT = 4
    RERUNNING_AGAIN_FROM_CHECKPOINT = 5


class RerunDiagnostic(str, Enum):
    """Outcome of a validation."""

    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


class Caller(NamedTuple):
    """Where `validate_result` was called from (part of a failed validation in Megatron checkpoints)."""

    message: str
    """The validation's message."""
    rank: int
    """Global rank of the caller."""


class Call(NamedTuple):
    """One call of `validate_result`."""

    caller: Caller
    """Who called."""
    sequence: int
    """How many times that caller had validated in the iteration."""


class RerunErrorInjector:
    """Megatron's result-injection engine (`--error-injection-rate/-type`), kept for its checkpoint state: this
    version injects nothing."""

    def __init__(self, error_injection_rate: int = 0,
                 error_injection_type: "RerunDiagnostic" = RerunDiagnostic.TRANSIENT_ERROR):
        self.error_injection_rate = error_injection_rate
        self.error_injection_type = RerunDiagnostic(error_injection_type)
        self.injected_error_type: Optional[RerunDiagnostic] = None

    def state_dict(self) -> Dict[str, Any]:
        """Megatron's `error_injector_checkpoint` entry."""
        return {"error_injection_rate": self.error_injection_rate, "error_injection_type": self.error_injection_type,
                "injected_error_type": self.injected_error_type}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore `state_dict()`."""
        self.error_injection_rate = state_dict["error_injection_rate"]
        self.error_injection_type = RerunDiagnostic(state_dict["error_injection_type"])
        self.injected_error_type = state_dict.get("injected_error_type")


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def _as_float(value: Any) -> float:
    return value.item() if isinstance(value, torch.Tensor) else float(value)


class RerunDataIterator:
    """Wraps a data iterator the way Megatron does; batches pass through unchanged."""

    def __init__(self, iterable: Any):
        self.iterable = iterable

    def __iter__(self):
        return self

    def __next__(self) -> Any:
        return next(self.iterable)

    def advance(self) -> None:
        """Kept for API compatibility: without re-runs there is nothing to replay."""

    def state_dict(self) -> Dict[str, Any]:
        """No replay buffer to save."""
        return {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """No replay buffer to restore."""


class RerunStateMachine:
    """Validates results produced inside an iteration (loss values, gradients)."""

    def __init__(self, mode: RerunMode = RerunMode.DISABLED, error_injector: Any = None,
                 result_rejected_tracker_filename: Optional[str] = None):
        self.mode = RerunMode(mode)
        self.state = RerunState.NOT_RUNNING_YET
        self.current_iteration = -1
        self.result_rejected_tracker_filename = result_rejected_tracker_filename
        self.error_injector = error_injector if error_injector is not None else RerunErrorInjector()
        self.large_value_counts: Dict[str, int] = {}
        self.max_values: Dict[str, float] = {}
        self.rejected_count = 0
        # Megatron's re-run bookkeeping, saved in and restored from checkpoints; never set by this version.
        self.rerun_requested = False
        self.checkpoint_requested = False
        self.restart_again_requested = False
        self.continue_requested = False
        self.failed_validation_call: Optional[Call] = None
        self.initial_result: Any = None
        self.suspicious_node: Optional[str] = None
        self.suspicious_device: Optional[int] = None
        self.data_iterator_checkpoints: Optional[list] = None

    def set_mode(self, mode: RerunMode) -> None:
        """Switch mode (evaluation disables validation and restores it afterwards)."""
        self.mode = RerunMode(mode)

    def get_mode(self) -> RerunMode:
        """The current mode."""
        return self.mode

    def should_run_forward_backward(self, data_iterator: Any) -> bool:
        """True exactly once per iteration: this version never re-runs a step."""
        if self.state == RerunState.INITIAL_RUN:
            self.state = RerunState.NOT_RUNNING_YET
            return False
        self.state = RerunState.INITIAL_RUN
        self.current_iteration += 1
        return True

    def should_checkpoint_and_exit(self):
        """(should_checkpoint, should_exit, exit_code): never requested without re-runs."""
        return False, False, 0

    def validate_result(self, result: Any, rejection_func: Callable[[Any], Any], message: str = "unexpected result",
                        comparison_func: Optional[Callable] = None, tolerance: float = 0.0,
                        fatal: bool = True) -> None:
        """Reject `result` when `rejection_func(result)` is true: raise when fatal, log otherwise.

        `comparison_func` and `tolerance` belong to Megatron's re-run comparison and are accepted for
        compatibility; with no re-runs there is nothing to compare against.
        """
        if self.mode == RerunMode.DISABLED and not fatal:
            return
        deferred = get_deferred_checks()
        iteration = self.current_iteration
        if fatal and rejection_func in _ELEMENTWISE_PREDICATES and deferred.should_defer(result):
            deferred.add(result, lambda: self._reject(result, message, iteration), predicate=rejection_func)
            return
        rejected = rejection_func(result)
        if fatal and deferred.should_defer(rejected):
            deferred.add(rejected, lambda: self._reject(result, message, iteration))
            return
        if isinstance(rejected, torch.Tensor):
            rejected = bool(rejected.any().item())
        if not rejected:
            return
        full_message = self._reject(result, message, self.current_iteration)
        if fatal:
            raise RuntimeError(full_message)
        logger.warning(full_message)

    def _reject(self, result: Any, message: str, iteration: int) -> str:
        """Count and record a rejected result; return the error message."""
        self.rejected_count += 1
        full_message = (
            f"Rank {_rank()}, node {os.uname()[1]}, iteration {iteration}: "
            f"Unexpected result {_as_float(result) if _is_scalar(result) else result} (message='{message}')"
        )
        self._record_rejection(full_message)
        return full_message

    def _record_rejection(self, message: str) -> None:
        if self.result_rejected_tracker_filename is None:
            return
        with open(self.result_rejected_tracker_filename, "a") as f:
            f.write(message + "\n")

    def is_unexpectedly_large(self, result: Any, threshold: float, context: str, num_samples: int = 100,
                              resample: bool = False) -> bool:
        """True when `result` exceeds `threshold` times the largest of the first `num_samples` values.

        The first `num_samples` results of a context only build the reference; they are never rejected.
        Like Megatron, the check is off (always False) when the mode is `disabled`.
        """
        if self.mode == RerunMode.DISABLED:
            return False
        value = abs(_as_float(result))
        count = self.large_value_counts.get(context, 0)
        if count < num_samples or resample:
            self.large_value_counts[context] = count + 1
            self.max_values[context] = max(self.max_values.get(context, 0.0), value)
            return False
        reference = self.max_values.get(context, 0.0)
        return math.isfinite(value) and reference > 0.0 and value > threshold * reference

    def state_dict(self, data_iterator: Any = None, ckpt_format: str = "torch", force: bool = False):
        """Checkpoint entry in Megatron's layout (see the module docstring); for `torch_dist` the per-rank part
        is a ShardedObject on the (PP, TP) grid with the DP rank as replica id."""
        data_iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        checkpoints = [d.state_dict() for d in data_iterators if isinstance(d, RerunDataIterator)]
        sharded = {
            "state": self.state,
            "current_iteration": self.current_iteration,
            "rerun_requested": self.rerun_requested,
            "checkpoint_requested": self.checkpoint_requested,
            "restart_again_requested": self.restart_again_requested,
            "continue_requested": self.continue_requested,
            "error_injector_checkpoint": self.error_injector.state_dict(),
            "failed_validation_call": self.failed_validation_call,
            "initial_result": self.initial_result,
            "suspicious_node": self.suspicious_node,
            "suspicious_device": self.suspicious_device,
            "data_iterator_checkpoints": checkpoints if self.mode != RerunMode.DISABLED and checkpoints else None,
            "large_value_counts": dict(self.large_value_counts),
            "max_values": dict(self.max_values),
        }
        if ckpt_format == "torch_dist":
            sharded = ShardedObject(
                "rerun_state_machine_state", sharded,
                (parallel_state.get_pipeline_model_parallel_world_size(),
                 parallel_state.get_tensor_model_parallel_world_size()),
                (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()),
                replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))
        return {"mode": self.mode, "sharded": sharded}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore `state_dict()` (Megatron's too). As in Megatron, nothing is restored when this run's mode is
        `disabled` (the checkpoint's state only matters for re-runs, which that mode never does)."""
        if self.mode == RerunMode.DISABLED or not state_dict or not isinstance(state_dict.get("sharded"), dict):
            return
        sharded = state_dict["sharded"]
        self.mode = RerunMode(state_dict["mode"])
        self.state = RerunState(sharded["state"])
        self.current_iteration = sharded["current_iteration"]
        for name in ("rerun_requested", "checkpoint_requested", "restart_again_requested", "continue_requested",
                     "failed_validation_call", "initial_result", "suspicious_node", "suspicious_device",
                     "data_iterator_checkpoints"):
            setattr(self, name, sharded.get(name, getattr(self, name)))
        self.error_injector.load_state_dict(sharded["error_injector_checkpoint"])
        self.large_value_counts = dict(sharded.get("large_value_counts") or {})
        self.max_values = dict(sharded.get("max_values") or {})


def _is_scalar(value: Any) -> bool:
    return not isinstance(value, torch.Tensor) or value.numel() == 1


_GLOBAL_RERUN_STATE_MACHINE: Optional[RerunStateMachine] = None


def initialize_rerun_state_machine(**kwargs) -> None:
    """Create the process-wide state machine (`mode=`, `result_rejected_tracker_filename=`, ...)."""
    global _GLOBAL_RERUN_STATE_MACHINE
    _GLOBAL_RERUN_STATE_MACHINE = RerunStateMachine(**kwargs)


def get_rerun_state_machine() -> RerunStateMachine:
    """The process-wide state machine (created in `disabled` mode on first use)."""
    global _GLOBAL_RERUN_STATE_MACHINE
    if _GLOBAL_RERUN_STATE_MACHINE is None:
        _GLOBAL_RERUN_STATE_MACHINE = RerunStateMachine()
    return _GLOBAL_RERUN_STATE_MACHINE


def destroy_rerun_state_machine() -> None:
    """Forget the state machine (tests)."""
    global _GLOBAL_RERUN_STATE_MACHINE
    _GLOBAL_RERUN_STATE_MACHINE = None
