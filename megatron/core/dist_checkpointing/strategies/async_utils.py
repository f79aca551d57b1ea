"""Asynchronous saves: an `AsyncRequest` (background write + finalize steps) and the
`AsyncCallsQueue` the training loop polls (Megatron Core's `strategies/async_utils` names).

The write runs in a background thread on data already staged to CPU, so training may change the
model meanwhile. The finalize steps (collectives, `.metadata`, `metadata.json`) run in the caller's
thread once every rank's write is done, so a checkpoint looks complete only after its data is durable.
"""
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

from megatron.core.dist_checkpointing.mapping import CheckpointingException
from megatron.core.dist_checkpointing.strategies._collectives import all_true


@dataclass
class AsyncRequest:
    """`async_fn(*async_fn_args)` runs in the background; `finalize_fns` run afterwards on every rank."""

    async_fn: Optional[Callable]
    """The background work (None: nothing to run in the background)."""
    async_fn_args: Tuple
    """Arguments of async_fn."""
    finalize_fns: List[Callable]
    """Called in order, in the main thread, after async_fn finished on every rank."""
    preload_fn: Optional[Callable] = None
    """Called before scheduling (staging data to CPU)."""
    is_frozen: bool = False
    """Set once scheduled; no more finalize steps may be added."""

    def add_finalize_fn(self, fn: Callable) -> None:
        """Append a finalize step."""
        if self.is_frozen:
            raise RuntimeError("cannot add a finalize step to an AsyncRequest that is already scheduled")
        self.finalize_fns.append(fn)

    def execute_sync(self) -> None:
        """Run everything now, in this thread."""
        if self.preload_fn is not None:
            self.preload_fn()
        if self.async_fn is not None:
            self.async_fn(*self.async_fn_args)
        for fn in self.finalize_fns:
            fn()

    def freeze(self) -> "AsyncRequest":
        """Mark as scheduled."""
        self.is_frozen = True
        return self


@dataclass
class _ScheduledCall:
    idx: int
    request: AsyncRequest
    thread: threading.Thread
    errors: List[BaseException] = field(default_factory=list)


class AsyncCallsQueue:
    """Runs AsyncRequests one after another in background threads and finalizes them in order."""

    def __init__(self, persistent: bool = False):
        self.persistent = persistent
        self._calls: List[_ScheduledCall] = []
        self._next_idx = 0

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Start the request's background work; returns its call index."""
        async_request.freeze()
        if async_request.preload_fn is not None:
            async_request.preload_fn()
        call = _ScheduledCall(self._next_idx, async_request, threading.Thread(daemon=True))
        call.thread = threading.Thread(target=self._run, args=(call,), name=f"async-ckpt-{call.idx}", daemon=True)
        call.thread.start()
        self._calls.append(call)
        self._next_idx += 1
        return call.idx

    @staticmethod
    def _run(call: _ScheduledCall) -> None:
        try:
            if call.request.async_fn is not None:
                call.request.async_fn(*call.request.async_fn_args)
        except BaseException as exc:  # reported by maybe_finalize_async_calls in the main thread
            call.errors.append(exc)

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> List[int]:
        """Finalize the calls whose background work is done on every rank (all of them if `blocking`).

        Collective unless `no_dist`: every rank must call it at the same point. Returns the indices
        of the finalized calls. Raises CheckpointingException when a background write failed.
        """
        finalized = []
        while self._calls:
            call = self._calls[0]
            if blocking:
                call.thread.join()
            done = not call.thread.is_alive()
            if not no_dist:
                done = all_true(done)
            if not done:
                break
            call.thread.join()
            self._calls.pop(0)
            if call.errors:
                raise CheckpointingException(
                    f"asynchronous checkpoint write {call.idx} failed: {call.errors[0]!r}"
                ) from call.errors[0]
            for fn in call.request.finalize_fns:
                fn()
            finalized.append(call.idx)
        return finalized

    def get_num_unfinalized_calls(self) -> int:
        """Number of scheduled calls not finalized yet."""
        return len(self._calls)

    def close(self) -> None:
        """Finish and finalize everything scheduled."""
        self.maybe_finalize_async_calls(blocking=True)
