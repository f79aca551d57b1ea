"""CUDA graphs of static-shape decode steps (`--enable-cuda-graph` for inference).

A decode step of batch-1 generation launches hundreds of small kernels per token; replayed as one CUDA graph
it costs one launch. The contexts provide a static-shape decode path: every tensor a decode forward reads
(token ids, positions, the write slots and the chunk table of the paged cache) lives in a buffer that is
allocated once per batch-size bucket and refilled before each step, the current position is a device tensor
(never a Python int), and attention runs over the whole cache window of the bucket with a mask built on the
device. A decode forward over those buffers is therefore the same sequence of kernels with the same
addresses at every step, which is what a CUDA graph needs.

`DecodeGraphRunner.run(key, fn)` calls `fn()` (which reads the caller's buffers of `key` and returns the
logits). On CUDA the first call of a key warms `fn` up on a side stream (`warmup_steps` times: this is where
`torch.compile` and cuBLAS pick their kernels), captures it into a graph and replays it; later calls only
replay. A warm-up or replay writes the same keys/values into the same cache slots as the eager step would,
so warming up on the real step is harmless. All graphs share one memory pool; their outputs are consumed
before the next step, which makes sharing safe. Off CUDA (or with `capture=False`) `fn()` runs eagerly: the
same static-shape path, which the CPU tests compare with the ordinary eager step.

Compiled layers (`--compile-layers`, applied by the optimisation plan at the first forward) specialise on
shapes, and inference shapes change at every eager step (prompt lengths, the growing cache window). So the
wrappers run eager forwards under `eager_forwards()` (torch's `eager_on_recompile` stance: code compiled for
matching shapes is used, nothing new is compiled), and the graph warm-up of a key under the default stance:
the compiled layers specialise once per graph key and are then replayed inside the graph.

`batch_bucket(n, limit)`: the smallest power of two >= n, at most `limit` (the graph keys).
"""
import contextlib
from typing import Callable, Dict, Hashable, Optional

import torch


def _stance(name: str):
    set_stance = getattr(torch.compiler, "set_stance", None)
    return contextlib.nullcontext() if set_stance is None else set_stance(name)


def eager_forwards():
    """Context of eager inference forwards: no (re)compilation for the step's shapes."""
    return _stance("eager_on_recompile")


def batch_bucket(count: int, limit: int) -> int:
    """The smallest power of two >= `count`, capped at `limit` (`count <= limit`)."""
    if count < 1 or count > limit:
        raise ValueError(f"batch_bucket: count {count} outside 1..{limit}")
    bucket = 1
    while bucket < count:
        bucket *= 2
    return min(bucket, limit)


class DecodeGraphRunner:
    """Captured decode graphs, one per key (batch-size bucket, cache window)."""

    def __init__(self, device: torch.device, warmup_steps: int = 2, capture: Optional[bool] = None,
                 compile_step: bool = False):
        self.device = torch.device(device)
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and not torch.cuda.is_available():
            raise ValueError("CUDA-graph decode needs a CUDA device (drop --enable-cuda-graph)")
        self.warmup_steps = max(int(warmup_steps), 1)
        self.compile_step = compile_step
        self._graphs: Dict[Hashable, tuple] = {}
        self._compiled: Dict[Hashable, Callable] = {}
        self._pool = None
        self.replays = 0
        self.eager_calls = 0

    @property
    def keys(self):
        """Keys with a captured graph (CUDA) or seen so far (eager mode)."""
        return sorted(set(self._graphs) | set(self._compiled))

    def _step_fn(self, key: Hashable, fn: Callable) -> Callable:
        if not self.compile_step:
            return fn
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = torch.compile(fn, dynamic=False)
        return compiled

    def run(self, key: Hashable, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`fn()`'s result, replayed from the graph of `key` (captured at the first call of `key`)."""
        step = self._step_fn(key, fn)
        if not self.capture:
            self.eager_calls += 1
            if not self.compile_step:
                self._compiled.setdefault(key, fn)
            with _stance("default"):
                return step()
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(step)
        graph, output = entry
        graph.replay()
        self.replays += 1
        return output

    def _capture(self, step: Callable[[], torch.Tensor]):
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), _stance("default"):
            for _ in range(self.warmup_steps):
                step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=side):
            output = step()
        self._pool = graph.pool()
        return graph, output

    def reset(self) -> None:
        """Drop every graph (after the model or the cache buffers changed)."""
        self._graphs.clear()
        self._compiled.clear()
        self._pool = None


__all__ = ["DecodeGraphRunner", "batch_bucket", "eager_forwards"]
