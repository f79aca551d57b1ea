"""Per-iteration side jobs of the training loop: the profiler window and manual garbage collection.

`--profile` profiles iterations [--profile-step-start, --profile-step-end) on --profile-ranks: with
`--use-pytorch-profiler` through `torch.profiler` (traces written to --tensorboard-dir), otherwise by
opening an nsys capture range (`cudaProfilerStart/Stop`, GPU only). `--manual-gc` turns off automatic
garbage collection and collects every --manual-gc-interval iterations, so that collection pauses happen
at the same iteration on every rank.
"""
import gc

import torch


class TrainingHooks:
    """Profiler and GC handling for `train`; call `before_step(it)` and `after_step(it)` every iteration."""

    def __init__(self, args, rank: int):
        self.args = args
        self.profiling = bool(args.profile) and rank in (args.profile_ranks or [0])
        self.torch_profiler = None
        self.nvtx = None
        if args.manual_gc:
            gc.disable()
            gc.collect()

    def _start_torch_profiler(self):
        from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        handler = tensorboard_trace_handler(self.args.tensorboard_dir) if self.args.tensorboard_dir else None
        self.torch_profiler = profile(activities=activities, record_shapes=True, with_stack=True,
                                      on_trace_ready=handler)
        self.torch_profiler.__enter__()

    def before_step(self, iteration: int) -> None:
        """Open the profiling window at --profile-step-start."""
        if not self.profiling or iteration != self.args.profile_step_start:
            return
        if self.args.use_pytorch_profiler:
            self._start_torch_profiler()
        elif torch.cuda.is_available():
            torch.cuda.cudart().cudaProfilerStart()
            self.nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self.nvtx.__enter__()

    def after_step(self, iteration: int) -> None:
        """Close the profiling window at --profile-step-end; run the manual GC on its interval."""
        if self.profiling and iteration == self.args.profile_step_end:
            self.close()
        interval = getattr(self.args, "manual_gc_interval", 0)
        if self.args.manual_gc and interval and iteration % interval == 0:
            gc.collect()

    def around_eval(self) -> None:
        """With --manual-gc-eval, collect before and after evaluation."""
        if self.args.manual_gc and getattr(self.args, "manual_gc_eval", True):
            gc.collect()

    def close(self) -> None:
        """Stop any open profiler (end of window or end of training)."""
        if self.torch_profiler is not None:
            self.torch_profiler.__exit__(None, None, None)
            self.torch_profiler = None
        if self.nvtx is not None:
            self.nvtx.__exit__(None, None, None)
            self.nvtx = None
            torch.cuda.cudart().cudaProfilerStop()
