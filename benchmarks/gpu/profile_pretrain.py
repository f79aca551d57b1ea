"""Profile iterations of the real `pretrain_gpt.py` path and write kernel tables (not part of the product).

Runs `pretrain_gpt.py` in this process with its own `--profile --use-pytorch-profiler` window and replaces
only what happens to the trace: instead of a TensorBoard trace, two text tables go to `--profile-out`
(GPU kernels by total time, and by input shapes), small enough to read back from a lease.

  python benchmarks/gpu/profile_pretrain.py --profile-out $OUT/profile.txt -- <pretrain_gpt.py flags>
      --profile --use-pytorch-profiler --profile-step-start 10 --profile-step-end 12
"""
import os
import runpy
import sys

import torch

from megatron.training import training_hooks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _writer(path):
    def on_trace_ready(prof):
        sort = "self_device_time_total"
        with open(path, "w") as f:
            f.write(prof.key_averages().table(sort_by=sort, row_limit=70, max_name_column_width=90))
            f.write("\n\nby input shape\n")
            f.write(prof.key_averages(group_by_input_shape=True).table(
                sort_by=sort, row_limit=40, max_name_column_width=60, max_shapes_column_width=70))
        print(f"profile tables written to {path}", flush=True)

    return on_trace_ready


def main():
    if "--" not in sys.argv:
        raise SystemExit("usage: profile_pretrain.py --profile-out PATH -- <pretrain_gpt.py flags>")
    split = sys.argv.index("--")
    own, flags = sys.argv[1:split], sys.argv[split + 1:]
    out = own[own.index("--profile-out") + 1] if "--profile-out" in own else "profile.txt"

    def start(self):
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        self.torch_profiler = torch.profiler.profile(activities=activities, record_shapes=True,
                                                     on_trace_ready=_writer(out))
        self.torch_profiler.__enter__()

    training_hooks.TrainingHooks._start_torch_profiler = start
    sys.argv = [os.path.join(ROOT, "pretrain_gpt.py")] + flags
    sys.path.insert(0, ROOT)
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
