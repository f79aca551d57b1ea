"""Named wall-clock timers with log levels, reduced across ranks for the training log (Megatron's `Timers`).

`timers(name, log_level)` returns a real `Timer` when `log_level <= --timing-log-level`, else a shared
`DummyTimer`, so call sites never branch on the level. On a GPU, start/stop synchronise the device so
that the measured time covers the queued kernels; on CPU there is nothing to synchronise.
"""
import sys
import time
from abc import ABC, abstractmethod
from typing import Dict, List, Optional

import torch


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class TimerBase(ABC):
    """Interface shared by real and dummy timers."""

    def __init__(self, name: str):
        self.name = name

    @abstractmethod
    def start(self, barrier: bool = False):
        """Start the timer (optionally after a barrier over the timer's group)."""

    @abstractmethod
    def stop(self, barrier: bool = False):
        """Stop the timer and add the interval to the elapsed total."""

    @abstractmethod
    def reset(self):
        """Clear the elapsed total."""

    @abstractmethod
    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Seconds accumulated so far; a running timer is stopped and restarted around the read."""


class DummyTimer(TimerBase):
    """A timer for levels above `--timing-log-level`: every call is a no-op."""

    def __init__(self):
        super().__init__("dummy timer")

    def start(self, barrier: bool = False):
        return

    def stop(self, barrier: bool = False):
        return

    def reset(self):
        return

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        raise RuntimeError("dummy timer should not be used to calculate elapsed time")

    def active_time(self) -> float:
        raise RuntimeError("dummy timer should not be used to calculate active time")


class Timer(TimerBase):
    """A start/stop timer accumulating elapsed seconds; `active_time` is never reset."""

    def __init__(self, name: str):
        super().__init__(name)
        self._elapsed = 0.0
        self._active_time = 0.0
        self._started = False
        self._barrier_group = None
        self._start_time = time.time()

    def set_barrier_group(self, barrier_group):
        """Process group used for `barrier=True` (default: the world)."""
        self._barrier_group = barrier_group

    def _barrier(self, barrier: bool):
        if barrier and _dist_ready():
            torch.distributed.barrier(group=self._barrier_group)

    def start(self, barrier: bool = False):
        if self._started:
            raise RuntimeError(f"timer {self.name} has already been started")
        self._barrier(barrier)
        _synchronize()
        self._start_time = time.time()
        self._started = True

    def stop(self, barrier: bool = False):
        if not self._started:
            raise RuntimeError(f"timer {self.name} is not started")
        self._barrier(barrier)
        _synchronize()
        interval = time.time() - self._start_time
        self._elapsed += interval
        self._active_time += interval
        self._started = False

    def reset(self):
        self._elapsed = 0.0
        self._started = False

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        was_started = self._started
        if was_started:
            self.stop(barrier=barrier)
        elapsed = self._elapsed
        if reset:
            self.reset()
        if was_started:
            self.start(barrier=barrier)
        return elapsed

    def active_time(self) -> float:
        """Total seconds this timer has been running, across resets."""
        return self._active_time


class Timers:
    """The group of named timers of one process (Megatron's `Timers(log_level, log_option)`)."""

    def __init__(self, log_level: int, log_option: str):
        if log_option not in ("max", "minmax", "all"):
            raise ValueError(
                f"--timing-log-option ({log_option!r}) must be one of 'max', 'minmax', 'all': pick one of them."
            )
        self._log_level = log_level
        self._log_option = log_option
        self._timers: Dict[str, Timer] = {}
        self._log_levels: Dict[str, int] = {}
        self._dummy_timer = DummyTimer()
        self._max_log_level = 2

    def __call__(self, name: str, log_level: Optional[int] = None):
        """The timer `name`; a `DummyTimer` when its level is above the configured one."""
        if name in self._timers:
            if log_level is not None and log_level != self._log_levels[name]:
                raise ValueError(
                    f"timer {name!r} was created with log level {self._log_levels[name]} "
                    f"and requested again with {log_level}: use one level per timer name."
                )
            return self._timers[name]
        if log_level is None:
            log_level = self._max_log_level
        if log_level > self._max_log_level:
            raise ValueError(f"timer log level {log_level} is above the maximum {self._max_log_level}.")
        if log_level > self._log_level:
            return self._dummy_timer
        self._timers[name] = Timer(name)
        self._log_levels[name] = log_level
        return self._timers[name]

    def _get_elapsed_time_all_ranks(self, names: List[str], reset: bool, barrier: bool) -> torch.Tensor:
        """A [world_size, len(names)] tensor of elapsed seconds (0 where a rank lacks the timer)."""
        if barrier and _dist_ready():
            torch.distributed.barrier()
        world_size = torch.distributed.get_world_size() if _dist_ready() else 1
        device = "cuda" if _dist_ready() and torch.distributed.get_backend() == "nccl" else "cpu"
        local = torch.zeros(len(names), dtype=torch.float, device=device)
        for i, name in enumerate(names):
            if name in self._timers:
                local[i] = self._timers[name].elapsed(reset=reset)
        if world_size == 1:
            return local.unsqueeze(0)  # [n] -> [1, n]
        gathered = [torch.zeros_like(local) for _ in range(world_size)]
        torch.distributed.all_gather(gathered, local)
        return torch.stack(gathered, dim=0)  # world_size x [n] -> [world_size, n]

    def _get_global_min_max_time(self, names, reset, barrier, normalizer):
        """{name: (min_seconds, max_seconds)} over the ranks that ran the timer."""
        if normalizer <= 0.0:
            raise ValueError(f"timer normalizer ({normalizer}) must be positive.")
        all_times = self._get_elapsed_time_all_ranks(names, reset, barrier)
        result = {}
        for i, name in enumerate(names):
            column = all_times[:, i]
            ran = column[column > 0.0]
            if ran.numel() > 0:
                result[name] = (ran.min().item() / normalizer, ran.max().item() / normalizer)
        return result

    def _get_global_min_max_time_string(self, names, reset, barrier, normalizer, max_only):
        min_max = self._get_global_min_max_time(names, reset, barrier, normalizer)
        if not min_max:
            return None
        out = "max time across ranks (ms):" if max_only else "(min, max) time across ranks (ms):"
        for name, (min_time, max_time) in min_max.items():
            label = (name + " ").ljust(48, ".")
            if max_only:
                out += "\n    {}: {:.2f}".format(label, max_time * 1000.0)
            else:
                out += "\n    {}: ({:.2f}, {:.2f})".format(label, min_time * 1000.0, max_time * 1000.0)
        return out

    def _get_all_ranks_time_string(self, names, reset, barrier, normalizer):
        all_times = self._get_elapsed_time_all_ranks(names, reset, barrier) / normalizer
        out = "times across ranks (ms):"
        any_printed = False
        for i, name in enumerate(names):
            out += "\n  {}:".format(name)
            for rank in range(all_times.shape[0]):
                if all_times[rank, i] > 0:
                    any_printed = True
                    out += "\n     rank {:2d}: {:.2f}".format(rank, all_times[rank, i].item() * 1000.0)
        return out if any_printed else None

    def get_all_timers_string(self, names: Optional[List[str]] = None, normalizer: float = 1.0,
                              reset: bool = True, barrier: bool = False):
        """The timing report in the configured `--timing-log-option` format (None when nothing ran)."""
        if names is None:
            names = list(self._timers.keys())
        if self._log_option in ("max", "minmax"):
            return self._get_global_min_max_time_string(
                names, reset, barrier, normalizer, max_only=self._log_option == "max"
            )
        return self._get_all_ranks_time_string(names, reset, barrier, normalizer)

    def log(self, names: List[str], rank: Optional[int] = None, normalizer: float = 1.0,
            reset: bool = True, barrier: bool = False):
        """Print the timing report on `rank` (default: the last rank). Every rank must call this."""
        out = self.get_all_timers_string(names, normalizer, reset, barrier)
        if rank is None:
            rank = torch.distributed.get_world_size() - 1 if _dist_ready() else 0
        my_rank = torch.distributed.get_rank() if _dist_ready() else 0
        if out is not None and rank == my_rank:
            # One write for the whole block, so output of other ranks sharing the stream never splits it.
            sys.stdout.write(out + "\n")
            sys.stdout.flush()

    def write(self, names: List[str], writer, iteration: int, normalizer: float = 1.0,
              reset: bool = False, barrier: bool = False):
        """Write `<name>-time` (max across ranks, seconds) scalars to a TensorBoard-style writer."""
        min_max = self._get_global_min_max_time(names, reset, barrier, normalizer)
        if writer is not None:
            for name, (_, max_time) in min_max.items():
                writer.add_scalar(name + "-time", max_time, iteration)
