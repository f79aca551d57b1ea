"""Megatron Core's rerun state machine: result validation (NaN/Inf, spiky loss) and the attribution of a
rejected result by re-running the iteration (`--rerun-mode`, `--error-injection-rate/-type`).

Modes:
- `disabled` (default): `validate_result` raises a `RuntimeError` naming rank, node, device and iteration
  whenever `rejection_func` rejects the result, fatal or not (Megatron 0.13.1's behaviour). When the training
  loop enables deferral (CUDA), a check on a device tensor is queued in `megatron.core.deferred_checks` and
  raised at the next flush instead of stalling the host now.
- `validate_results`: from the second iteration on, a rejected result (or an injected error) makes every rank
  re-run the iteration in place from the saved RNG states and the replayed microbatches (`RerunDataIterator`).
  A result that differs within `tolerance` is a transient error: checkpoint and exit with
  `EXIT_CODE_FAILED_ON_RESULT_VALIDATION` (17). One that repeats: checkpoint and exit with
  `EXIT_CODE_RESUME_TO_DISAMBIGUATE` (16); the job resumed from that checkpoint on another GPU re-runs the
  iteration once more (rescheduled on the same GPU: exit 16 again): a different result there is a persistent
  error of the first GPU (exit 17), the same result a correct one (training continues when non-fatal).
- `report_stats` (`report_determinism_stats`): every iteration runs twice and the relative difference of each
  validated result between the runs goes into a `QuickStats` per message, logged every 2 iterations.

Checkpoint state (Megatron Core 0.13.1's layout, so checkpoints move both ways): `state_dict()` is
`{"mode": RerunMode, "sharded": {"state": RerunState, "current_iteration", "rerun_requested", ...,
"error_injector_checkpoint", "large_value_counts", "max_values"}}`; for `torch_dist` the "sharded" part
is the ShardedObject `rerun_state_machine_state` on the (PP, TP) grid, one replica per DP rank. The
enums are pickled under these module paths, as Megatron's are.
"""
import datetime
import logging
import math
import os
import random
from collections import defaultdict
from enum import Enum
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple, Union

import numpy as np
import torch

from megatron.core import parallel_state
from megatron.core.deferred_checks import get_deferred_checks
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.rerun_tracking import QuickStats, skipped_iterations

logger = logging.getLogger(__name__)

EXIT_CODE_RESUME_TO_DISAMBIGUATE: int = 16
"""Exit code asking to resume the job from the checkpoint just saved (on another GPU) to finish a diagnostic."""

EXIT_CODE_FAILED_ON_RESULT_VALIDATION: int = 17
"""Exit code of a job stopped by a failed result validation."""

COMPARISON_MATCH: float = 0.0
COMPARISON_MISMATCH: float = math.inf

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
    """Where the state machine is: before/after an iteration, in its initial run, re-running it in place,
    about to re-run it from a checkpoint (saved before exiting), re-running it from that checkpoint, or
    rescheduled on the suspicious GPU again."""

    NOT_RUNNING_YET = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    WILL_RERUN_FROM_CHECKPOINT = 3
    RERUNNING_FROM_CHECKPOINT = 4
    RERUNNING_AGAIN_FROM_CHECKPOINT = 5


class RerunDiagnostic(str, Enum):
    """Attribution of a rejected result (also the kinds of error the injector can fake)."""

    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


class RerunValidationStatus(str, Enum):
    """Status of a line of the result-rejected tracker file (`--result-rejected-tracker-filename`)."""

    RERUN_DISABLED = "rerun_disabled"
    INITIAL_RUN = "initial_run"
    FIRST_RERUN_NOT_REPRODUCIBLE = "first_rerun_not_reproducible"
    FIRST_RERUN_REPRODUCIBLE = "first_rerun_reproducible"
    SECOND_RERUN_NOT_REPRODUCIBLE = "second_rerun_not_reproducible"
    SECOND_RERUN_REPRODUCIBLE = "second_rerun_reproducible"


class Caller(NamedTuple):
    """Who called `validate_result` (part of a failed validation in Megatron checkpoints)."""

    message: str
    """The validation's message."""
    rank: int
    """Global rank of the caller."""


class Call(NamedTuple):
    """One call of `validate_result`."""

    caller: Caller
    """Who called."""
    sequence: int
    """How many times that caller had validated in the iteration (1 for the first)."""


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def _node_name() -> str:
    """This host's name (where a suspicious result was reproduced)."""
    return os.uname()[1]


def _device_name():
    """The current CUDA device index (Megatron's `device=`), or "cpu"."""
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


def _as_float(value: Any) -> float:
    return value.item() if isinstance(value, torch.Tensor) else float(value)


def _is_scalar(value: Any) -> bool:
    return not isinstance(value, torch.Tensor) or value.numel() == 1


def _describe(result: Any):
    return _as_float(result) if _is_scalar(result) else result


def _compare_floats(a: Any, b: Any) -> float:
    """Default comparison of two scalar results: 0 when equal (NaN == NaN), inf when one is NaN/inf and the
    other is not, else the relative difference |a - b| / mean(a, b)."""
    af, bf = _as_float(a), _as_float(b)
    if af == bf or (math.isnan(af) and math.isnan(bf)):
        return COMPARISON_MATCH
    if math.isnan(af) or math.isnan(bf) or math.isinf(af) or math.isinf(bf):
        return COMPARISON_MISMATCH
    return math.fabs((af - bf) / (af + bf) * 2)


class RerunErrorInjector:
    """Fakes rejected results to exercise the state machine (`--error-injection-rate N`: about one validation
    in N is rejected; `--error-injection-type`: what the re-runs then see).

    A transient error compares as different on the in-place re-run; a persistent error or a correct result
    compares as equal there, and on the re-run from the checkpoint as different (persistent) or equal (correct).
    """

    _ERROR_NAMES = {RerunDiagnostic.CORRECT_RESULT: "Expected result",
                    RerunDiagnostic.TRANSIENT_ERROR: "Transient error",
                    RerunDiagnostic.PERSISTENT_ERROR: "Persistent error"}

    def __init__(self, error_injection_rate: int = 0,
                 error_injection_type: RerunDiagnostic = RerunDiagnostic.TRANSIENT_ERROR) -> None:
        if not isinstance(error_injection_type, RerunDiagnostic):
            raise ValueError(f"error_injection_type ({error_injection_type!r}) must be a RerunDiagnostic: "
                             f"--error-injection-type takes correct_result, transient_error or persistent_error.")
        self.error_injection_rate: int = error_injection_rate
        self.error_injection_type: RerunDiagnostic = error_injection_type
        self.should_inject_errors: bool = error_injection_rate > 0
        self.injected_error_type: Optional[RerunDiagnostic] = None

    def maybe_inject(self) -> bool:
        """True (and remember the injection) with probability 1/rate, at most once until it is resolved."""
        if not self.should_inject_errors or self.injected_error_type is not None:
            return False
        draw = (random.randint(0, self.error_injection_rate - 1) + _rank()) % self.error_injection_rate
        if draw != 0:
            return False
        self.injected_error_type = self.error_injection_type
        logger.warning("Injecting error type %s", self._ERROR_NAMES[self.error_injection_type])
        return True

    def maybe_miscompare(self, comparison_func: Callable[[Any, Any], float], initial_result: Any, result: Any,
                         state: RerunState) -> float:
        """`comparison_func(initial_result, result)`, unless an injected error decides the outcome."""
        injected = self.injected_error_type
        if injected is None:
            return comparison_func(initial_result, result)
        if state == RerunState.RERUNNING_IN_PLACE:
            if injected == RerunDiagnostic.TRANSIENT_ERROR:
                self.injected_error_type = None
                return COMPARISON_MISMATCH
            return COMPARISON_MATCH
        if state == RerunState.RERUNNING_FROM_CHECKPOINT:
            self.injected_error_type = None
            if injected == RerunDiagnostic.PERSISTENT_ERROR:
                return COMPARISON_MISMATCH
            if injected == RerunDiagnostic.CORRECT_RESULT:
                return COMPARISON_MATCH
        raise RuntimeError(f"no comparison is made in state {state} with an injected {injected}")

    def state_dict(self) -> Dict[str, Any]:
        """Megatron's `error_injector_checkpoint` entry."""
        return {"error_injection_rate": self.error_injection_rate, "error_injection_type": self.error_injection_type,
                "injected_error_type": self.injected_error_type}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore `state_dict()`."""
        self.error_injection_rate = state_dict["error_injection_rate"]
        self.error_injection_type = RerunDiagnostic(state_dict["error_injection_type"])
        self.should_inject_errors = self.error_injection_rate > 0
        injected = state_dict.get("injected_error_type")
        self.injected_error_type = RerunDiagnostic(injected) if injected is not None else None


class RerunDataIterator:
    """Wraps a data iterator so that an iteration can be replayed: outside `disabled` mode it keeps the
    microbatches read since the last `advance()`, and after `rewind()` returns them again in order."""

    def __init__(self, iterable: Iterable[Any]) -> None:
        self.iterable = iterable
        self.saved_microbatches: List[Any] = []
        self.replaying: bool = False
        self.replay_pos: int = 0

    def __iter__(self):
        return self

    def __next__(self) -> Any:
        if self.replaying:
            if self.replay_pos >= len(self.saved_microbatches):
                raise RuntimeError("No more batches to replay: the re-run reads more microbatches than the "
                                   "initial run (the iteration's control flow must be deterministic)")
            batch = self.saved_microbatches[self.replay_pos]
            self.replay_pos += 1
            return batch
        batch = next(self.iterable)
        if get_rerun_state_machine().get_mode() != RerunMode.DISABLED:
            self.saved_microbatches.append(batch)
        return batch

    def rewind(self) -> None:
        """Replay from the first microbatch of the iteration."""
        self.replaying, self.replay_pos = True, 0

    def advance(self) -> None:
        """Drop the kept microbatches and read new ones (next iteration)."""
        self.replaying, self.saved_microbatches = False, []

    def state_dict(self) -> Dict[str, Any]:
        """The kept microbatches and the replay position."""
        return {"saved_microbatches": self.saved_microbatches, "replaying": self.replaying,
                "replay_pos": self.replay_pos}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore `state_dict()`."""
        self.saved_microbatches = state_dict["saved_microbatches"]
        self.replaying = state_dict["replaying"]
        self.replay_pos = state_dict["replay_pos"]


DataIteratorArgType = Optional[Union[RerunDataIterator, List[RerunDataIterator]]]


class RerunStateMachine:
    """Validates results produced inside an iteration and re-runs it to attribute a rejected one (see the
    module docstring). Use the process-wide instance (`initialize_rerun_state_machine`, `get_rerun_state_machine`).

    Args:
        state_save_func: returns extra state to restore before a re-run (Python, NumPy, torch and CUDA RNG
            states are saved anyway); the training loop saves the model-parallel RNG tracker's states.
        state_restore_func: restores what `state_save_func` returned.
        mode: `RerunMode`.
        error_injector: a `RerunErrorInjector` (default: injects nothing).
        result_rejected_tracker_filename: file to which rejected results are appended (must be writable).
    """

    REPORTING_INTERVAL_ITERATIONS: int = 2

    def __init__(self, state_save_func: Optional[Callable[[], Any]] = None,
                 state_restore_func: Optional[Callable[[Any], None]] = None, mode: RerunMode = RerunMode.DISABLED,
                 error_injector: Optional[RerunErrorInjector] = None,
                 result_rejected_tracker_filename: Optional[str] = None) -> None:
        self.mode = RerunMode(mode)
        self.state = RerunState.NOT_RUNNING_YET
        self.current_iteration = -1
        self.first_iteration_complete = False
        self.rerun_requested = False
        self.checkpoint_requested = False
        self.restart_again_requested = False
        self.continue_requested = False
        self.logged_sdc_enabled = False
        self.error_injector = error_injector or RerunErrorInjector()
        self.validation_counts: Dict[Caller, int] = defaultdict(int)
        self.failed_validation_call: Optional[Call] = None
        self.initial_result: Any = None
        self.suspicious_node: Optional[str] = None
        self.suspicious_device: Any = None
        self.result_rejected_tracker_filename = result_rejected_tracker_filename
        if result_rejected_tracker_filename is not None:
            try:
                with open(result_rejected_tracker_filename, "a"):
                    pass
            except OSError as error:
                raise RuntimeError(f"RerunStateMachine result validation log cannot be appended to! ({error})")
        self.saved_state: Optional[Dict[str, Any]] = None
        self.state_save_func = state_save_func
        self.state_restore_func = state_restore_func
        self.data_iterator_checkpoints: Optional[list] = None
        self.large_value_counts: Dict[str, int] = {}
        self.max_values: Dict[str, float] = {}
        self.saved_results: Dict[Call, Any] = {}
        self.stats: Dict[Caller, QuickStats] = defaultdict(QuickStats)
        if self.mode != RerunMode.DISABLED and _rank() == 0:
            logger.warning("RerunStateMachine initialized in mode %s", self.mode)

    def set_mode(self, mode: RerunMode) -> None:
        """Switch mode (evaluation disables validation and restores it afterwards)."""
        self.mode = RerunMode(mode)

    def get_mode(self) -> RerunMode:
        """The current mode."""
        return self.mode

    # ------------------------------------------------------------------ iteration control
    def should_run_forward_backward(self, data_iterator: DataIteratorArgType) -> bool:
        """Whether to (re)run the iteration's forward-backward pass: `while machine.should_run_forward_backward(
        it): zero grads; forward_backward(...)`. Collective (an all-reduce) outside `disabled` mode."""
        self.validation_counts = defaultdict(int)
        data_iterators = self._sanitize_data_iterators(data_iterator)
        if self.state == RerunState.NOT_RUNNING_YET:
            return self._start_iteration(data_iterators)
        if self.state == RerunState.INITIAL_RUN:
            return self._after_initial_run(data_iterators)
        if self.state == RerunState.RERUNNING_IN_PLACE:
            return self._after_rerun_in_place(data_iterators)
        if self.state == RerunState.WILL_RERUN_FROM_CHECKPOINT:
            self.state = RerunState.RERUNNING_FROM_CHECKPOINT
            return True
        if self.state == RerunState.RERUNNING_FROM_CHECKPOINT:
            return self._after_rerun_from_checkpoint()
        raise RuntimeError(f"should_run_forward_backward called in state {self.state}: the job must exit")

    def _start_iteration(self, data_iterators: List[RerunDataIterator]) -> bool:
        self.current_iteration += 1
        self.state = RerunState.INITIAL_RUN
        if self.mode == RerunMode.DISABLED:
            return True
        if self.data_iterator_checkpoints is not None:
            if len(self.data_iterator_checkpoints) != len(data_iterators):
                raise RuntimeError(f"the checkpoint holds {len(self.data_iterator_checkpoints)} data iterator "
                                   f"states but the run has {len(data_iterators)} data iterators")
            for iterator, checkpoint in zip(data_iterators, self.data_iterator_checkpoints):
                iterator.load_state_dict(checkpoint)
            self.data_iterator_checkpoints = None
        self._save_state()
        for iterator in data_iterators:
            iterator.advance()
        self.rerun_requested = self.checkpoint_requested = False
        self.restart_again_requested = self.continue_requested = False
        return True

    def _after_initial_run(self, data_iterators: List[RerunDataIterator]) -> bool:
        if self.mode == RerunMode.DISABLED or not self._reduce_any([self.rerun_requested])[0]:
            self.state = RerunState.NOT_RUNNING_YET
            return False
        if self.mode == RerunMode.VALIDATE_RESULTS and _rank() == 0:
            logger.warning("Need to rerun step to check reproducibility of initial result")
        self.state = RerunState.RERUNNING_IN_PLACE
        self._rewind(data_iterators)
        return True

    def _after_rerun_in_place(self, data_iterators: List[RerunDataIterator]) -> bool:
        if self.mode == RerunMode.REPORT_DETERMINISM_STATS:
            self.state = RerunState.NOT_RUNNING_YET
            self._maybe_report_stats()
            self.saved_results = {}
            return False
        if self._reduce_any([self.checkpoint_requested])[0]:
            self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
        self._rewind(data_iterators)
        return False

    def _after_rerun_from_checkpoint(self) -> bool:
        restart_again, carry_on = self._reduce_any([self.restart_again_requested, self.continue_requested])
        if restart_again:
            if _rank() == 0:
                logger.warning("Need to restart job from the same checkpoint because it was scheduled on the "
                               "same node/GPU")
            self.state = RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT
        elif carry_on:
            if _rank() == 0:
                logger.warning("Continuing normal execution because failed validation was not fatal")
            self.state = RerunState.NOT_RUNNING_YET
        return False

    def _rewind(self, data_iterators: List[RerunDataIterator]) -> None:
        self._restore_state()
        for iterator in data_iterators:
            iterator.rewind()

    _EXITS = {
        RerunState.RERUNNING_IN_PLACE: (True, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
                                        "Exiting now. A checkpoint at the last iteration is being saved if further "
                                        "examination is needed"),
        RerunState.WILL_RERUN_FROM_CHECKPOINT: (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE,
                                                "Saving a checkpoint and exiting now. Please resume the job from the "
                                                "checkpoint to rerun the last iteration and establish a diagnostic"),
        RerunState.RERUNNING_FROM_CHECKPOINT: (False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
                                               "Exiting now. A checkpoint at the last iteration already exists if "
                                               "further examination is needed"),
        RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT: (False, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE,
                                                     "Exiting now. Please resume the job from the same checkpoint to "
                                                     "rerun the last iteration and establish a diagnostic"),
    }

    def should_checkpoint_and_exit(self) -> Tuple[bool, bool, int]:
        """(save a checkpoint?, exit?, exit code), asked once the iteration's forward-backward loop is done."""
        self.first_iteration_complete = True
        if self.mode != RerunMode.VALIDATE_RESULTS or self.state not in self._EXITS:
            return False, False, 0
        checkpoint, exit_now, code, message = self._EXITS[self.state]
        if _rank() == 0:
            logger.warning(message)
        return checkpoint, exit_now, code

    # ------------------------------------------------------------------ validation
    def validate_result(self, result: Any, rejection_func: Callable[[Any], Any], message: str = "unexpected result",
                        comparison_func: Optional[Callable[[Any, Any], float]] = None, tolerance: float = 0.0,
                        fatal: bool = True) -> None:
        """Check `result` with `rejection_func` (true: rejected) inside the forward-backward pass.

        `disabled` mode raises on a rejection (fatal or not). Otherwise a rejection starts the re-run
        diagnostic, where `comparison_func(initial, rerun)` (default: relative difference of two scalars) above
        `tolerance` counts as "not reproduced"; `fatal=False` lets training continue once the result is found
        correct. In `report_stats` mode every result is only recorded and compared with its re-run.
        """
        if self.mode == RerunMode.DISABLED:
            self._validate_disabled(result, rejection_func, message)
            return
        comparison_func = comparison_func or _compare_floats
        if self.state == RerunState.NOT_RUNNING_YET:
            raise RuntimeError("validate_result should not be called outside of the forward-backward pass")
        call = self._get_validation_call_info(message)
        if self.mode == RerunMode.REPORT_DETERMINISM_STATS:
            self._record_for_stats(call, result, comparison_func, message)
            return
        if not self.logged_sdc_enabled:
            self.logged_sdc_enabled = True
            if _rank() == 0:
                logger.warning("Result validation enabled")
        if self.state == RerunState.INITIAL_RUN and not self.rerun_requested:
            self._check_initial_result(call, result, rejection_func, message)
        elif self.state in (RerunState.RERUNNING_IN_PLACE, RerunState.RERUNNING_FROM_CHECKPOINT) \
                and call == self.failed_validation_call:
            comparison = self.error_injector.maybe_miscompare(comparison_func, self.initial_result, result, self.state)
            if self.state == RerunState.RERUNNING_IN_PLACE:
                self._judge_rerun_in_place(comparison > tolerance, result, message)
            else:
                self._judge_rerun_from_checkpoint(comparison > tolerance, result, message, fatal)

    def _validate_disabled(self, result, rejection_func, message) -> None:
        deferred = get_deferred_checks()
        iteration = self.current_iteration
        if rejection_func in _ELEMENTWISE_PREDICATES and deferred.should_defer(result):
            deferred.add(result, lambda: self._reject_disabled(result, message, iteration), predicate=rejection_func)
            return
        rejected = rejection_func(result)
        if deferred.should_defer(rejected):
            deferred.add(rejected, lambda: self._reject_disabled(result, message, iteration))
            return
        if isinstance(rejected, torch.Tensor):
            rejected = bool(rejected.any().item())
        if rejected:
            raise RuntimeError(self._reject_disabled(result, message, iteration))

    def _reject_disabled(self, result: Any, message: str, iteration: int) -> str:
        """Record a rejection in `disabled` mode and return the error message."""
        self._log_validation_error_to_file(RerunValidationStatus.RERUN_DISABLED, _describe(result), message,
                                           iteration)
        return (f"Rank {_rank()}, node {_node_name()}, device {_device_name()}, iteration {iteration}: "
                f"Unexpected result {_describe(result)} (message='{message}')")

    def _record_for_stats(self, call: Call, result, comparison_func, message: str) -> None:
        if self.state == RerunState.INITIAL_RUN:
            self.rerun_requested = True
            self.saved_results[call] = result
        elif self.state == RerunState.RERUNNING_IN_PLACE:
            if call not in self.saved_results:
                raise RuntimeError(f"no initial result for {call}: the re-run validates results the initial run "
                                   f"did not (the iteration's control flow must be deterministic)")
            self.stats[Caller(message=message, rank=0)].record(comparison_func(self.saved_results[call], result))

    def _check_initial_result(self, call: Call, result, rejection_func, message: str) -> None:
        # No validation in the first iteration: a checkpoint needs one optimizer step behind it.
        if not self.first_iteration_complete:
            return
        rejected = self.error_injector.maybe_inject() or rejection_func(result)
        if isinstance(rejected, torch.Tensor):
            rejected = bool(rejected.any().item())
        if not rejected:
            return
        self.failed_validation_call = call
        self.initial_result = result
        self.rerun_requested = True
        self._log_validation_error_to_file(RerunValidationStatus.INITIAL_RUN, _describe(result), message)
        logger.error("Unexpected result %s on rank %d at iteration #%d invocation #%d (message='%s')",
                     _describe(result), _rank(), self.current_iteration, call.sequence, message)

    def _log_failure(self, text: str) -> None:
        logger.error("Rank %d, node %s, device %s: %s!", _rank(), _node_name(), _device_name(), text)

    def _judge_rerun_in_place(self, differs: bool, result, message: str) -> None:
        if differs:
            logger.warning("First rerun: unexpected result is not reproducible within the tolerance (%s != %s)",
                           _describe(result), _describe(self.initial_result))
            self._log_validation_error_to_file(RerunValidationStatus.FIRST_RERUN_NOT_REPRODUCIBLE, _describe(result),
                                               message)
            self._log_failure("Possible transient error")
            return
        self.checkpoint_requested = True
        # Remembered so that the re-run from the checkpoint can tell whether it landed on the same GPU.
        self.suspicious_node = _node_name()
        self.suspicious_device = _device_name()
        self._log_validation_error_to_file(RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE, _describe(result), message)
        logger.warning("First rerun: unexpected result is reproducible within the tolerance (%s = %s). Need to "
                       "rerun on a different GPU to verify correctness", _describe(result),
                       _describe(self.initial_result))

    def _judge_rerun_from_checkpoint(self, differs: bool, result, message: str, fatal: bool) -> None:
        if _node_name() == self.suspicious_node and _device_name() == self.suspicious_device:
            logger.error("Got rescheduled on the same GPU. Need to resume again from the same checkpoint (node: %s, "
                         "gpu: %s)", self.suspicious_node, self.suspicious_device)
            self.restart_again_requested = True
        elif differs:
            self._log_validation_error_to_file(RerunValidationStatus.SECOND_RERUN_NOT_REPRODUCIBLE,
                                               _describe(result), message)
            logger.warning("Second rerun: unexpected result is not reproducible on a different GPU, therefore was "
                           "likely incorrect (%s != %s)", _describe(result), _describe(self.initial_result))
            self._log_failure("Possible persistent error")
        else:
            self._log_validation_error_to_file(RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE, _describe(result),
                                               message)
            logger.warning("Second rerun: unexpected result is reproducible on a different GPU, therefore it was "
                           "likely correct (%s = %s)", _describe(result), _describe(self.initial_result))
            self._log_failure(f"Correct result (but possible Application error) ({message})")
            if not fatal:
                self.continue_requested = True

    def is_unexpectedly_large(self, result: Any, threshold: float, context: str, num_samples: int = 100,
                              resample: bool = False) -> bool:
        """A rejection function for spikes: True when |result| >= `threshold` times the largest |value| among
        the first `num_samples` values of `context` (which only build the reference; `resample` restarts it).
        NaN and inf are never flagged (the NaN/Inf checks catch them)."""
        value = math.fabs(_as_float(result))
        if math.isnan(value) or math.isinf(value):
            return False
        if resample or context not in self.large_value_counts:
            self.large_value_counts[context] = 0
        if self.large_value_counts[context] < num_samples:
            self.large_value_counts[context] += 1
            self.max_values[context] = max(self.max_values.get(context, 0.0), value)
            if self.large_value_counts[context] == num_samples:
                logger.warning("Max value for %s: %s", context, self.max_values[context])
            return False
        return value >= self.max_values[context] * threshold

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self, data_iterator: DataIteratorArgType = None, ckpt_format: str = "torch", force: bool = False):
        """Checkpoint entry in Megatron's layout (see the module docstring); for `torch_dist` the per-rank part
        is a ShardedObject on the (PP, TP) grid with the DP rank as replica id."""
        checkpoints = [d.state_dict() for d in self._sanitize_data_iterators(data_iterator)]
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
            "data_iterator_checkpoints": checkpoints or None,
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
        `disabled`, or when the checkpoint's was (the CLI's rerun arguments then apply)."""
        if self.mode == RerunMode.DISABLED or not state_dict or not isinstance(state_dict.get("sharded"), dict):
            return
        if RerunMode(state_dict["mode"]) == RerunMode.DISABLED:
            if _rank() == 0:
                logger.warning("RerunStateMachine disabled in checkpoint but enabled via CLI, ignoring machine "
                               "state saved in checkpoint")
            return
        if _rank() == 0:
            logger.warning("Getting RerunStateMachine state from checkpoint, CLI rerun args ignored")
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

    # ------------------------------------------------------------------ helpers
    def _sanitize_data_iterators(self, data_iterator: DataIteratorArgType) -> List[RerunDataIterator]:
        if self.mode == RerunMode.DISABLED:
            return []
        iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        iterators = [d for d in iterators if d is not None]
        for iterator in iterators:
            if not isinstance(iterator, RerunDataIterator):
                raise TypeError(f"--rerun-mode {self.mode.value} needs data iterators wrapped in RerunDataIterator "
                                f"(got {type(iterator).__name__})")
        return iterators

    def _get_validation_call_info(self, message: str) -> Call:
        caller = Caller(message=message, rank=_rank())
        self.validation_counts[caller] += 1
        return Call(caller=caller, sequence=self.validation_counts[caller])

    def _reduce_any(self, values: List[bool]) -> Tuple[bool, ...]:
        """Element-wise OR of `values` over all ranks (an int32 all-reduce on the collectives' device)."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return tuple(bool(v) for v in values)
        device = "cpu"
        if torch.distributed.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        flags = torch.tensor([int(bool(v)) for v in values], dtype=torch.int32, device=device)
        torch.distributed.all_reduce(flags)
        return tuple(x > 0 for x in flags.tolist())

    def _save_state(self) -> None:
        """Save what a re-run restores: Python, NumPy, torch (and CUDA) RNG states plus `state_save_func()`."""
        rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
               "torch_rng_state": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda_rng_state"] = torch.cuda.get_rng_state()
        self.saved_state = {"rng_state": rng,
                            "other_state": self.state_save_func() if self.state_save_func else None}

    def _restore_state(self) -> None:
        rng = self.saved_state["rng_state"]
        random.setstate(rng["random_rng_state"])
        np.random.set_state(rng["np_rng_state"])
        torch.set_rng_state(rng["torch_rng_state"])
        if "cuda_rng_state" in rng:
            torch.cuda.set_rng_state(rng["cuda_rng_state"])
        if self.saved_state["other_state"] and self.state_restore_func:
            self.state_restore_func(self.saved_state["other_state"])

    def _maybe_report_stats(self) -> None:
        """Every REPORTING_INTERVAL_ITERATIONS iterations, log the determinism statistics (rank 0 merges all
        ranks', which then start afresh). Collective when distributed."""
        if self.current_iteration % self.REPORTING_INTERVAL_ITERATIONS != 0:
            return
        stats = self.stats
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
            gathered = [None] * torch.distributed.get_world_size() if rank == 0 else None
            torch.distributed.gather_object(dict(self.stats), gathered, dst=0)
            if rank != 0:
                for quick_stats in self.stats.values():
                    quick_stats.reset()
                return
            for caller in {c for per_rank in gathered for c in per_rank}:
                self.stats[caller].combine([s[caller] for s in gathered[1:] if caller in s])
        logger.info("Stats on computation determinism in validation calls")
        for caller, quick_stats in stats.items():
            logger.info("  From %s:", caller.message)
            logger.info("    %s", quick_stats.print_stats())

    def _log_validation_error_to_file(self, status: RerunValidationStatus, result: Any, message: str,
                                      iteration: Optional[int] = None) -> None:
        if self.result_rejected_tracker_filename is None:
            return
        iteration = self.current_iteration if iteration is None else iteration
        try:
            with open(self.result_rejected_tracker_filename, "a") as f:
                f.write(f"ts={datetime.datetime.now()} node={_node_name()} device={_device_name()} "
                        f"jobID={os.getenv('SLURM_JOBID', 'N/A')} rank={_rank()} iteration={iteration} "
                        f"status={status!s} result={result} message='{message}'\n")
        except OSError as error:
            logger.error("Could not log validation error! (%s)", error)

    @classmethod
    def get_skipped_iterations_from_tracker_file(cls, tracker_file_name: str) -> List[int]:
        """Iterations to skip (`--iterations-to-skip`) read from a tracker file: see
        `rerun_tracking.skipped_iterations`."""
        return skipped_iterations(tracker_file_name)


_GLOBAL_RERUN_STATE_MACHINE: Optional[RerunStateMachine] = None


def initialize_rerun_state_machine(**kwargs) -> None:
    """Create the process-wide state machine (keywords of `RerunStateMachine`)."""
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
