"""Time the collectives of the GPT-1.3B benchmark on this host's GPUs (not part of the product).

  torchrun --nproc-per-node 2 benchmarks/gpu/collective_bench.py [--tag NAME]

all_gather / reduce_scatter of the sequence-parallel activations (tokens 16384 x hidden 2048, bf16, split
over the ranks) and all_reduce of one DDP bucket (40 M fp32 gradients). Prints one JSON line from rank 0:
median ms of 20 calls after warm-up and the bus bandwidth in GB/s (NCCL's definition), plus the NCCL_*
environment, so runs with different NCCL settings can be compared.
"""
import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist


def timed(fn, iters=20, warmup=5):
    """Median ms of `iters` calls after `warmup`; the ranks start the timed calls together."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    world = dist.get_world_size()
    full = torch.empty(16384, 2048, device="cuda", dtype=torch.bfloat16)
    shard = torch.randn(16384 // world, 2048, device="cuda", dtype=torch.bfloat16)
    bucket = torch.randn(40_000_000, device="cuda", dtype=torch.float32)
    factor = (world - 1) / world
    row = {"tag": args.tag, "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}
    ms = timed(lambda: dist.all_gather_into_tensor(full, shard))
    row["all_gather_64MB"] = dict(ms=round(ms, 3), busbw=round(full.numel() * 2 * factor / ms / 1e6, 1))
    ms = timed(lambda: dist.reduce_scatter_tensor(shard, full))
    row["reduce_scatter_64MB"] = dict(ms=round(ms, 3), busbw=round(full.numel() * 2 * factor / ms / 1e6, 1))
    ms = timed(lambda: dist.all_reduce(bucket))
    row["all_reduce_160MB_fp32"] = dict(ms=round(ms, 3), busbw=round(bucket.numel() * 4 * 2 * factor / ms / 1e6, 1))
    if dist.get_rank() == 0:
        print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
