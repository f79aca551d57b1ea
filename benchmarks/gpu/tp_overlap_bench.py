"""Sequence-parallel linear layers at TP=2: NCCL all-gather/reduce-scatter then matmul, against torch's
symmetric-memory fused (micro-pipelined) versions. Not part of the product; decides whether the fused ops pay.

  torchrun --nproc-per-node 2 benchmarks/gpu/tp_overlap_bench.py

Shapes are GPT-1.3B's (tokens 16384 = seq 2048 x micro-batch 8, hidden 2048, ffn 8192) split over TP=2.
Prints one JSON line per case from rank 0: ms per call (median of 20 after warm-up) and the max
difference between the two results.
"""
import json
import os

import torch
import torch.distributed as dist

from collective_bench import timed  # same folder (the script's directory is on sys.path)


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    group = dist.group.WORLD
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group
    enable_symm_mem_for_group(group.group_name)
    tokens, hidden = 16384, 2048
    torch.manual_seed(rank)
    x_shard = torch.randn(tokens // world, hidden, device="cuda", dtype=torch.bfloat16)
    gathered = torch.empty(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    cases = {"qkv": 3 * hidden // world, "fc1": 4 * hidden // world}
    for name, out_features in cases.items():
        weight = torch.randn(out_features, hidden, device="cuda", dtype=torch.bfloat16) * 0.02

        def plain():
            dist.all_gather_into_tensor(gathered, x_shard, group=group)
            return gathered @ weight.t()

        def fused():
            return torch.ops.symm_mem.fused_all_gather_matmul(x_shard, [weight.t()], 0, group.group_name)[1][0]

        diff = (plain() - fused()).abs().max().item()
        row = dict(case=f"all_gather+matmul {name}", plain_ms=timed(plain), fused_ms=timed(fused),
                   mm_only_ms=timed(lambda: gathered @ weight.t()), max_diff=diff)
        if rank == 0:
            print(json.dumps(row), flush=True)
    for name, in_features in {"proj": hidden // world, "fc2": 4 * hidden // world}.items():
        act = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(hidden, in_features, device="cuda", dtype=torch.bfloat16) * 0.02
        out = torch.empty(tokens // world, hidden, device="cuda", dtype=torch.bfloat16)

        def plain():
            dist.reduce_scatter_tensor(out, act @ weight.t(), group=group)
            return out

        def fused():
            return torch.ops.symm_mem.fused_matmul_reduce_scatter(act, weight.t(), "sum", 0, group.group_name)

        diff = (plain().clone() - fused()).abs().max().item()
        row = dict(case=f"matmul+reduce_scatter {name}", plain_ms=timed(plain), fused_ms=timed(fused),
                   mm_only_ms=timed(lambda: act @ weight.t()), max_diff=diff)
        if rank == 0:
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
