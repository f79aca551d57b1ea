"""Number of microbatches per global batch, with optional batch-size ramp-up.

This module owns the one process-wide microbatch calculator (Megatron keeps it here, outside
`parallel_state`, and user scripts import these functions by name). A calculator turns
`global_batch_size`, `micro_batch_size` and the data-parallel size into the number of microbatches
each data-parallel rank runs per step. With `--rampup-batch-size <start> <increment> <samples>` the
global batch size grows from `start` by `increment` every `samples / ((gbs - start) / increment)`
consumed samples until it reaches `global_batch_size`.

Note "running" batch size: with `decrease_batch_size_if_needed` the batch actually run is the
requested one rounded down to a multiple of `micro_batch_size * data_parallel_size`.
"""
import logging
from abc import ABC, abstractmethod
from typing import List, Optional

logger = logging.getLogger(__name__)

_GLOBAL_NUM_MICROBATCHES_CALCULATOR: Optional["NumMicroBatchesCalculator"] = None


def get_num_microbatches() -> int:
    """Number of microbatches per step for the current global batch size."""
    return _get_calculator().get()


def get_current_global_batch_size() -> int:
    """Global batch size requested for the current step (ramp-up aware)."""
    return _get_calculator().get_current_global_batch_size()


def get_micro_batch_size() -> int:
    """Micro-batch size the calculator was configured with."""
    return _get_calculator().get_micro_batch_size()


def get_current_running_global_batch_size() -> int:
    """Global batch size actually run (rounded down when decreasing is allowed)."""
    return _get_calculator().get_current_running_global_batch_size()


def update_num_microbatches(consumed_samples: int, consistency_check: bool = True, verbose: bool = False) -> None:
    """Advance the ramp-up to `consumed_samples`; a no-op for a constant batch size."""
    _get_calculator().update(consumed_samples, consistency_check, verbose)


def unset_num_microbatches_calculator() -> None:
    """Forget the global calculator (tests and re-initialisation)."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = None


def destroy_num_microbatches_calculator() -> None:
    """Forget the global calculator (same as `unset_num_microbatches_calculator`)."""
    unset_num_microbatches_calculator()


def init_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: Optional[List[int]],
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
    decrease_batch_size_if_needed: bool = False,
) -> None:
    """Create the global calculator; a second call (without destroy) raises, as Megatron's assertion does,
    and leaves the first calculator in place."""
    _configure_global_num_microbatches_calculator(
        rank,
        rampup_batch_size,
        global_batch_size,
        micro_batch_size,
        data_parallel_size,
        decrease_batch_size_if_needed,
        init=True,
    )


def reconfigure_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: Optional[List[int]],
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
    decrease_batch_size_if_needed: bool = False,
) -> None:
    """Replace the global calculator (e.g. a different batch size for evaluation)."""
    _configure_global_num_microbatches_calculator(
        rank,
        rampup_batch_size,
        global_batch_size,
        micro_batch_size,
        data_parallel_size,
        decrease_batch_size_if_needed,
        init=False,
    )


def _get_calculator() -> "NumMicroBatchesCalculator":
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
        raise RuntimeError(
            "the num-microbatches calculator is not initialized: call "
            "init_num_microbatches_calculator(...) first (initialize_megatron does this)"
        )
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR


class CalculatorAlreadyInitializedError(RuntimeError, AssertionError):
    """Raised by a second `init_num_microbatches_calculator` call. Megatron asserts there, so code written
    for it (e.g. `pytest.raises(AssertionError)`) catches this too."""


def _configure_global_num_microbatches_calculator(
    rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed, init
):
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    if init and _GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None:
        raise CalculatorAlreadyInitializedError(
            "num microbatches calculator is already initialized: call destroy_num_microbatches_calculator() "
            "first, or reconfigure_num_microbatches_calculator(...) to replace it"
        )
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = _build_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed
    )


def _build_num_microbatches_calculator(
    rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed
) -> "NumMicroBatchesCalculator":
    if rampup_batch_size is None:
        calculator = ConstantNumMicroBatchesCalculator(
            global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed, rank
        )
        if rank == 0:
            logger.info("setting number of microbatches to constant %d", calculator.get())
        return calculator
    if len(rampup_batch_size) != 3:
        raise ValueError(
            f"--rampup-batch-size takes 3 values <start batch size> <batch size increment> <ramp-up samples>, "
            f"got {list(rampup_batch_size)}: pass e.g. --rampup-batch-size 16 16 1000000"
        )
    start, increment, samples = (int(v) for v in rampup_batch_size)
    if rank == 0:
        logger.info(
            "will use batch size rampup starting from global batch size %d to global batch size %d with "
            "batch size increments %d over %d samples.",
            start,
            global_batch_size,
            increment,
            samples,
        )
    return RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size,
        micro_batch_size,
        data_parallel_size,
        decrease_batch_size_if_needed,
        rank,
        start,
        increment,
        samples,
    )


def _round(batch_size: int, divisor: int) -> int:
    """`batch_size` rounded down to a multiple of `divisor`."""
    return (batch_size // divisor) * divisor


class NumMicroBatchesCalculator(ABC):
    """Base class: holds the current counts; subclasses decide how they change with consumed samples."""

    def __init__(self) -> None:
        self.num_micro_batches: Optional[int] = None
        self.current_global_batch_size: Optional[int] = None
        self.micro_batch_size: Optional[int] = None
        self.current_running_global_batch_size: Optional[int] = None

    def get(self) -> int:
        """Number of microbatches per step."""
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        """Requested global batch size at the current point of training."""
        return self.current_global_batch_size

    def get_micro_batch_size(self) -> int:
        """Micro-batch size."""
        return self.micro_batch_size

    def get_current_running_global_batch_size(self) -> int:
        """Global batch size actually run (a multiple of micro_batch_size * data_parallel_size)."""
        return self.current_running_global_batch_size

    @abstractmethod
    def update(self, consumed_samples: int, consistency_check: bool, verbose: bool = False) -> None:
        """Recompute the counts for `consumed_samples` samples seen so far."""


def _check_positive(values: dict) -> List[str]:
    return [f"{name} ({value}) must be > 0" for name, value in values.items() if value is None or value <= 0]


class ConstantNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """Fixed global batch size: `num_microbatches = gbs // (mbs * dp)`."""

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        decrease_batch_size_if_needed: bool,
        rank: int,
    ) -> None:
        super().__init__()
        errors = _check_positive(
            {
                "--global-batch-size": global_batch_size,
                "--micro-batch-size": micro_batch_size,
                "data parallel size": data_parallel_size,
            }
        )
        if errors:
            raise ValueError("invalid batch configuration: " + "; ".join(errors))
        mbs_times_dp = micro_batch_size * data_parallel_size
        if decrease_batch_size_if_needed:
            running = _round(global_batch_size, mbs_times_dp)
            if rank == 0 and running != global_batch_size:
                logger.info(
                    "decreasing batch size from %d to %d to keep divisibility by micro_batch_size=%d * "
                    "data_parallel_size=%d",
                    global_batch_size,
                    running,
                    micro_batch_size,
                    data_parallel_size,
                )
        else:
            if global_batch_size % mbs_times_dp != 0:
                raise ValueError(
                    f"--global-batch-size ({global_batch_size}) is not divisible by --micro-batch-size "
                    f"({micro_batch_size}) times data parallel size ({data_parallel_size}): choose a global batch "
                    f"size that is a multiple of {mbs_times_dp}, or pass --decrease-batch-size-if-needed"
                )
            running = global_batch_size
        self.num_micro_batches = running // mbs_times_dp
        if self.num_micro_batches < 1:
            raise ValueError(
                f"--global-batch-size ({global_batch_size}) is smaller than --micro-batch-size ({micro_batch_size}) "
                f"times data parallel size ({data_parallel_size}), which leaves 0 microbatches: raise the global "
                f"batch size to at least {mbs_times_dp}"
            )
        self.current_global_batch_size = global_batch_size
        self.current_running_global_batch_size = running
        self.micro_batch_size = micro_batch_size

    def update(self, consumed_samples: int, consistency_check: bool, verbose: bool = False) -> None:
        """The batch size never changes."""


class RampupBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """Linear batch-size ramp-up from `start_global_batch_size` to `global_batch_size`.

    After `consumed` samples the batch size is
    `start + floor(consumed / (ramup_samples / ((gbs - start) / increment))) * increment`,
    and `global_batch_size` once `consumed > ramup_samples`.
    """

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        decrease_batch_size_if_needed: bool,
        rank: int,
        start_global_batch_size: int,
        batch_size_increment: int,
        ramup_samples: int,
    ) -> None:
        super().__init__()
        errors = _check_positive(
            {
                "--global-batch-size": global_batch_size,
                "--micro-batch-size": micro_batch_size,
                "data parallel size": data_parallel_size,
                "--rampup-batch-size start": start_global_batch_size,
                "--rampup-batch-size increment": batch_size_increment,
            }
        )
        if ramup_samples < 0:
            errors.append(f"--rampup-batch-size samples ({ramup_samples}) must be >= 0")
        diff = global_batch_size - start_global_batch_size
        if not errors and diff < 0:
            errors.append(
                f"--global-batch-size ({global_batch_size}) must be >= the --rampup-batch-size start "
                f"({start_global_batch_size})"
            )
        if not errors and diff % batch_size_increment != 0:
            errors.append(
                f"--global-batch-size minus the --rampup-batch-size start ({diff}) must be divisible by the "
                f"--rampup-batch-size increment ({batch_size_increment})"
            )
        if errors:
            raise ValueError("invalid batch size ramp-up: " + "; ".join(errors) + ": fix --rampup-batch-size")
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.decrease_batch_size_if_needed = decrease_batch_size_if_needed
        self.rank = rank
        self.start_global_batch_size = start_global_batch_size
        self.batch_size_increment = batch_size_increment
        self.ramup_samples = ramup_samples
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        num_increments = diff // batch_size_increment
        self.rampup_samples_per_increment = self.ramup_samples / num_increments if num_increments > 0 else None
        self.update(0, consistency_check=False, verbose=True)

    def _batch_size_at(self, consumed_samples: int) -> int:
        if consumed_samples > self.ramup_samples or not self.rampup_samples_per_increment:
            return self.global_batch_size
        steps = int(consumed_samples / self.rampup_samples_per_increment)
        return min(self.start_global_batch_size + steps * self.batch_size_increment, self.global_batch_size)

    def update(self, consumed_samples: int, consistency_check: bool, verbose: bool = False) -> None:
        """Set the batch size for `consumed_samples`; check divisibility unless decreasing is allowed."""
        old = self.current_global_batch_size
        self.current_global_batch_size = self._batch_size_at(consumed_samples)
        changed = old != self.current_global_batch_size
        if verbose and changed and self.rank == 0:
            if old is None:
                logger.info("setting initial batch size to %d", self.current_global_batch_size)
            else:
                logger.info("ramping up batch size from %d to %d", old, self.current_global_batch_size)
        mbs_times_dp = self.micro_batch_times_data_parallel_size
        if consistency_check and not self.decrease_batch_size_if_needed:
            if self.current_global_batch_size % mbs_times_dp != 0:
                raise ValueError(
                    f"current global batch size ({self.current_global_batch_size}) is not divisible by "
                    f"--micro-batch-size ({self.micro_batch_size}) times data parallel size "
                    f"({self.data_parallel_size}): make --rampup-batch-size start and increment multiples of "
                    f"{mbs_times_dp}, or pass --decrease-batch-size-if-needed"
                )
        running = _round(self.current_global_batch_size, mbs_times_dp)
        if self.decrease_batch_size_if_needed and running < mbs_times_dp:
            raise ValueError(
                f"current global batch size ({self.current_global_batch_size}) is smaller than --micro-batch-size "
                f"({self.micro_batch_size}) times data parallel size ({self.data_parallel_size}): raise the "
                f"--rampup-batch-size start to at least {mbs_times_dp}"
            )
        if verbose and changed and self.rank == 0 and running != self.current_global_batch_size:
            logger.info(
                "decreasing batch size from %d to %d to keep divisibility by micro_batch_size=%d * "
                "data_parallel_size=%d",
                self.current_global_batch_size,
                running,
                self.micro_batch_size,
                self.data_parallel_size,
            )
        self.current_running_global_batch_size = running
        self.num_micro_batches = running // mbs_times_dp


__all__ = [
    "init_num_microbatches_calculator",
    "reconfigure_num_microbatches_calculator",
    "destroy_num_microbatches_calculator",
    "unset_num_microbatches_calculator",
    "get_num_microbatches",
    "get_current_global_batch_size",
    "get_current_running_global_batch_size",
    "get_micro_batch_size",
    "update_num_microbatches",
    "NumMicroBatchesCalculator",
    "ConstantNumMicroBatchesCalculator",
    "RampupBatchsizeNumMicroBatchesCalculator",
]
