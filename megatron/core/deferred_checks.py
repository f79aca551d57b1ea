"""Sanity checks on device values that are verified later, in one host synchronisation.

A NaN check such as "is this loss finite?" needs the value on the host, and reading a CUDA value
back stalls the host until the GPU has caught up: the GPU then idles while the host queues the next
kernels. Megatron pays this once per microbatch (loss) and once per gradient bucket (DDP). Here a
check can be *deferred*: the value stays on the device, and a flush evaluates every pending check
with one `.item()` and raises the first failure's error, with the same message the immediate check
would have raised.

The training loop enables deferral on CUDA and calls `step()` at the start of every iteration: it
launches the evaluation of the previous iteration's checks with an asynchronous copy of the verdicts
to pinned host memory, and reads the verdicts launched one `step()` earlier, waiting only on their
CUDA event (a plain `.item()` would wait for everything queued so far, since copies are stream-ordered).
It flushes everything before a checkpoint is saved and at the end of training. An error therefore surfaces at most two iterations late and never after a
checkpoint that contains its effects. On CPU, where a read costs nothing, checks stay immediate.
"""
from typing import Callable, Dict, List, Optional, Tuple

import torch


def not_finite(values: torch.Tensor) -> torch.Tensor:
    """Elementwise "is NaN or Inf" (the predicate of the gradient-norm checks)."""
    return ~torch.isfinite(values)


class DeferredChecks:
    """Queued checks: (device value, predicate marking failures, message builder), flushed together."""

    def __init__(self):
        self.enabled = False
        self.device_types = ("cuda",)
        """Devices whose values are worth deferring (a read of a CPU value costs nothing)."""
        self._pending: List[Tuple[torch.Tensor, Optional[Callable], Callable[[], str]]] = []
        self._in_flight: Optional[tuple] = None

    def should_defer(self, value) -> bool:
        """True when a check on `value` should be queued instead of read now (deferral on, device listed)."""
        return self.enabled and isinstance(value, torch.Tensor) and value.device.type in self.device_types

    def add(self, value: torch.Tensor, make_message: Callable[[], str],
            predicate: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        """Queue a check failing when any element of `predicate(value)` (or of `value` itself) is true.

        Pass a module-level `predicate` (such as `torch.isnan`): checks sharing one are evaluated in a
        single call at flush time, so queuing costs no kernel launch.
        """
        self._pending.append((value.detach().reshape(-1), predicate, make_message))  # [...] -> [n]

    def pending(self) -> int:
        """Number of checks not yet read on the host (queued, or evaluated and in flight)."""
        return len(self._pending) + (len(self._in_flight[2]) if self._in_flight else 0)

    def clear(self) -> None:
        """Drop every queued check without reading it."""
        self._pending = []
        self._in_flight = None

    def step(self) -> None:
        """Start a new iteration without waiting for the GPU.

        Raises for the checks whose results were copied to the host one `step()` ago (that copy was
        ordered after their iteration's work, which has long finished), then queues the evaluation of
        the checks added since the last `step()`: predicate kernels, and an asynchronous copy of the
        verdicts into pinned host memory marked by a CUDA event.
        """
        self._resolve_in_flight()
        entries, self._pending = self._pending, []
        if not entries:
            return
        failed, order = self._failed_flags(entries)
        if failed.is_cuda:
            host = torch.empty(failed.shape, dtype=failed.dtype, pin_memory=True)
            host.copy_(failed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._in_flight = (event, host, entries, order)
        else:
            self._in_flight = (None, failed, entries, order)

    def flush(self) -> None:
        """Evaluate every queued check now (one synchronisation); raise RuntimeError for the first failure."""
        self._resolve_in_flight()
        entries, self._pending = self._pending, []
        if entries:
            failed, order = self._failed_flags(entries)
            self._raise_first(failed.cpu(), order, entries)

    def _resolve_in_flight(self) -> None:
        if self._in_flight is None:
            return
        (event, host, entries, order), self._in_flight = self._in_flight, None
        if event is not None:
            event.synchronize()
        self._raise_first(host, order, entries)

    @staticmethod
    def _raise_first(failed: torch.Tensor, order: List[int], entries) -> None:
        """Raise the message of the earliest queued entry whose flag is set (`failed[j]` is entry `order[j]`'s)."""
        if bool(failed.any()):
            first = min(order[j] for j in torch.nonzero(failed).reshape(-1).tolist())
            raise RuntimeError(entries[first][2]())

    @staticmethod
    def _failed_flags(entries) -> Tuple[torch.Tensor, List[int]]:
        """(flags [len(entries)] bool on the entries' device, True where a check fails, in predicate-group order;
        the entry index of each flag). Grouped and concatenated on the device: scattering the flags back into
        queue order would index with a host list, whose copy from pageable memory stalls the host until the
        GPU has drained (once per group per iteration: GPU idle at every iteration start)."""
        groups: Dict[Optional[Callable], List[int]] = {}
        for index, (_, predicate, _) in enumerate(entries):
            groups.setdefault(predicate, []).append(index)
        flags_per_group, order = [], []
        for predicate, indices in groups.items():
            values = [entries[i][0] for i in indices]
            sizes = [v.numel() for v in values]
            joined = torch.cat(values)  # k x [n_i] -> [sum n_i]
            flags = joined.bool() if predicate is None else predicate(joined)
            if all(size == 1 for size in sizes):
                flags_per_group.append(flags)
            else:
                flags_per_group.append(torch.stack([chunk.any() for chunk in torch.split(flags, sizes)]))  # [k]
            order.extend(indices)
        return torch.cat(flags_per_group), order  # groups x [k_g] -> [len(entries)]


_DEFERRED_CHECKS = DeferredChecks()


def get_deferred_checks() -> DeferredChecks:
    """The process-wide queue used by the loss checks and the DDP gradient checks."""
    return _DEFERRED_CHECKS
