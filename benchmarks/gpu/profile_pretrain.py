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


def _union_us(intervals):
    """Total length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def timeline_summary(prof) -> str:
    """GPU busy time, idle time, and how much of the NCCL kernel time overlaps compute kernels."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return "no GPU kernels recorded\n"
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    comm = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" in e.name.lower()]
    compute = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower()]
    wall = max(end for _, end in spans) - min(start for start, _ in spans)
    busy, comm_t, compute_t = _union_us(spans), _union_us(comm), _union_us(compute)
    overlap = comm_t + compute_t - busy
    return (f"timeline (ms over the profiled window): wall {wall / 1e3:.1f}, GPU busy {busy / 1e3:.1f}, "
            f"idle {(wall - busy) / 1e3:.1f}, compute kernels {compute_t / 1e3:.1f}, nccl kernels "
            f"{comm_t / 1e3:.1f}, nccl overlapped with compute {overlap / 1e3:.1f}, nccl exposed "
            f"{(comm_t - overlap) / 1e3:.1f}\n")


def idle_gaps(prof, top: int = 12, min_us: float = 50.0) -> str:
    """The largest GPU idle gaps (>= min_us) grouped by the kernels on either side, biggest total first."""
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    groups, end, previous = {}, None, None
    for event in kernels:
        if end is not None and event.time_range.start - end >= min_us:
            key = (previous.name[:60], event.name[:60])
            total, count = groups.get(key, (0.0, 0))
            groups[key] = (total + event.time_range.start - end, count + 1)
        if end is None or event.time_range.end > end:
            end, previous = event.time_range.end, event
    rows = sorted(groups.items(), key=lambda item: -item[1][0])[:top]
    lines = [f"  {total / 1e3:7.2f} ms in {count:3d} gaps: after {before} -> before {after}"
             for (before, after), (total, count) in rows]
    return f"idle gaps >= {min_us:.0f} us (total ms, count, neighbouring kernels):\n" + "\n".join(lines) + "\n"


def _writer(path):
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        path = f"{path}.rank{rank}"

    def on_trace_ready(prof):
        sort = "self_device_time_total"
        with open(path, "w") as f:
            f.write(timeline_summary(prof))
            f.write(idle_gaps(prof))
            f.write(prof.key_averages().table(sort_by=sort, row_limit=70, max_name_column_width=90))
            f.write("\n\nhost (CPU) time by op, self time\n")
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=90))
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
