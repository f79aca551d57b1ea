"""The FP8 parameter all-gather of the distributed optimizer (`--fp8-param-gather`).

An FP8 parameter (`param.fp8_param`, set by the FP8 linears under the recipe's `fp8_param`) has a bucket of
its own. After the optimizer step this rank's updated piece of the weight (its fp32 master shard) is
quantized to E4M3 with the scale of the whole weight (its amax: a MAX all-reduce of the pieces' amaxes over
the group the optimizer is sharded over) into a uint8 buffer, and the uint8 buffer is all-gathered: one byte
per value instead of two (bf16).
The gathered bytes and their scale become the weight's FP8 primary copy (`fp8.params.Fp8WeightCopy`, used by
the FP8 GEMMs as they are) and their dequantized values the parameter's own data (so checkpoints and any
bf16 reader see the weight the FP8 GEMMs use). Master weights stay in the optimizer, in fp32.

The piece is quantized from the fp32 master shard where the optimizer registered it (`param.fp8_main_shard`),
else from the parameter buffer. The scale is the weight's own amax (current scaling) over the data-parallel
shards; a tensor-parallel weight is scaled per TP shard (the amax is not reduced over TP).
"""
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.fp8 import kernels
from megatron.core.fp8.params import Fp8WeightCopy, quantize_shard


class _PendingFp8Gather:
    """An FP8 all-gather in flight; `wait()` completes it and publishes the FP8 copy."""

    def __init__(self, handle, finish):
        self._handle, self._finish = handle, finish

    def wait(self) -> None:
        if self._handle is not None:
            self._handle.wait()
        self._finish()


def is_fp8_param_bucket(params, ddp_config) -> bool:
    """Whether a bucket of `params` gathers FP8 bytes: one FP8 parameter, the distributed optimizer and
    `fp8_param_gather`."""
    return (bool(ddp_config.fp8_param_gather) and bool(ddp_config.use_distributed_optimizer) and len(params) == 1
            and bool(getattr(params[0], "fp8_param", False)))


def start_fp8_param_gather(bucket, group, group_size: int, group_rank: int, all_gather, async_op: bool
                           ) -> Optional[_PendingFp8Gather]:
    """Quantize this rank's piece of the bucket's FP8 parameter and all-gather the FP8 bytes over `group`
    (`all_gather(output, input, group, async_op)`); returns the pending gather (None once done, without
    `async_op`)."""
    param = bucket.params_list[0]
    lo, hi = bucket.fp8_param_range
    shard_size = bucket.param_data.numel() // group_size
    shard_lo = group_rank * shard_size
    start, end = max(lo, shard_lo), min(hi, shard_lo + shard_size)
    piece = bucket.param_data[start:max(start, end)]
    master = getattr(param, "fp8_main_shard", None)
    if master is not None and master.numel() == piece.numel():
        piece = master  # the fp32 master piece (the distributed optimizer's), not its bf16 copy
    amax_ = kernels.amax(piece)
    if group_size > 1:
        dist.all_reduce(amax_, op=dist.ReduceOp.MAX, group=group)
    margin = getattr(param, "fp8_param_margin", 0)
    if bucket.fp8_param_data is None:
        bucket.fp8_param_data = torch.zeros(bucket.param_data.numel(), dtype=torch.uint8,
                                            device=bucket.param_data.device)
    if end > start:
        q, _ = quantize_shard(piece, amax_, margin)
        bucket.fp8_param_data[start:end].copy_(q.view(torch.uint8))
    scale = kernels.scale_from_amax(amax_, kernels.E4M3, margin)
    scale_inv = torch.ones_like(scale).div(scale)
    local = bucket.fp8_param_data[shard_lo:shard_lo + shard_size]
    handle = all_gather(bucket.fp8_param_data, local, group, async_op)

    def finish():
        # [numel] uint8 -> [*param.shape] E4M3
        copy = getattr(param, "fp8_weight_copy", None)
        if copy is None:
            data = bucket.fp8_param_data[lo:hi].view(kernels.E4M3).view(param.shape)
            copy = Fp8WeightCopy(data, scale_inv)
        else:  # the same tensors, updated in place
            copy.update(scale_inv)
        bucket.param_data[lo:hi].copy_(copy.dequantized(bucket.param_data.dtype).reshape(-1))
        param.fp8_weight_copy = copy

    pending = _PendingFp8Gather(handle if async_op else None, finish)
    if async_op:
        return pending
    pending.wait()
    return None


__all__ = ["is_fp8_param_bucket", "start_fp8_param_gather"]
