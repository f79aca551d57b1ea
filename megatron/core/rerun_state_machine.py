"""Result validation for the training loop: the NaN/Inf loss check and the spiky-loss check.

This is the part of Megatron's rerun state machine that loss functions call (`validate_result`,
`is_unexpectedly_large`). It does not re-run iterations: in every mode a rejected fatal result raises a
`RuntimeError` naming the rank and iteration, and a rejected non-fatal result is logged. When the
training loop enables deferral (CUDA), a fatal check on a device tensor is queued in
`megatron.core.deferred_checks` and raised at the next flush instead of stalling the host now. The public
names, modes and call signatures are Megatron Core's, so loss functions written for Megatron work here.
"""
import logging
import math
import os
from enum import Enum
from typing import Any, Callable, Dict, Optional

import torch

from megatron.core.deferred_checks import get_deferred_checks

logger = logging.getLogger(__name__)


_ELEMENTWISE_PREDICATES = (torch.isnan, torch.isinf, torch.isposinf, torch.isneginf)


class RerunMode(str, Enum):
    """`--rerun-mode` values."""

    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_DETERMINISM_STATS = "report_stats"


class RerunState(Enum):
    """Where the state machine is within an iteration (this version only ever runs once)."""

    NOT_RUNNING_YET = 0
    INITIAL_RUN = 1


class RerunDiagnostic(str, Enum):
    """Outcome of a validation."""

    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


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
        self.error_injector = error_injector
        self.large_value_counts: Dict[str, int] = {}
        self.max_values: Dict[str, float] = {}
        self.rejected_count = 0

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
        """Checkpoint entry: the mode as plain data (no re-run state exists)."""
        return {"mode": self.mode.value, "sharded": {}}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Nothing to restore beyond the mode chosen on the command line."""


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
