"""The FP8 parameter all-gather of the distributed optimizer (`--fp8-param-gather`).

An FP8 parameter (`param.fp8_param`, set by the FP8 linears under the recipe's `fp8_param`) has a bucket of
its own, whose parameter storage is a uint8 buffer (`bucket.fp8_param_data`, one byte per value; no bf16/fp32
parameter storage is allocated for it). After the optimizer step this rank's updated piece of the weight (its
fp32 master shard) is quantized to E4M3 with the scale of the whole weight (its amax: a MAX all-reduce of the
pieces' amaxes over the group the optimizer is sharded over) into the uint8 buffer, and the uint8 buffer is
all-gathered: one byte per value instead of two (bf16).
The gathered bytes and their scale are the weight's FP8 copy (`fp8.params.Fp8WeightCopy`, used by the FP8 GEMMs
as they are). Once the distributed optimizer holds the fp32 masters it makes that copy the parameter's only
one (`make_fp8_primary`, `fp8.params`, "FP8-primary parameters"); before that (or without a distributed
optimizer) the parameter keeps its own storage, which a gather fills with the dequantized values.

The piece is quantized from the fp32 master shard where the optimizer registered it (`param.fp8_main_shard`),
else from the parameter itself. The scale is the weight's own amax (current scaling) over the data-parallel
shards; a tensor-parallel weight is scaled per TP shard (the amax is not reduced over TP).
"""
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.fp8 import kernels
from megatron.core.fp8.params import (
    Fp8WeightCopy,
    drop_high_precision_storage,
    is_fp8_primary,
    quantize_into,
    quantize_shard,
)


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


def _fp8_copy(bucket, param) -> Fp8WeightCopy:
    """The parameter's FP8 copy: a view of the bucket's uint8 buffer (made on first use)."""
    copy = getattr(param, "fp8_weight_copy", None) or getattr(param, "fp8_primary_copy", None)
    if copy is None:
        lo, hi = bucket.fp8_param_range
        # [numel] uint8 -> [*param.shape] E4M3
        data = bucket.fp8_param_data[lo:hi].view(kernels.E4M3).view(param.shape)
        copy = Fp8WeightCopy(data, torch.ones(1, dtype=torch.float32, device=data.device))
    return copy


def start_fp8_param_gather(bucket, group, group_size: int, group_rank: int, all_gather, async_op: bool
                           ) -> Optional[_PendingFp8Gather]:
    """Quantize this rank's piece of the bucket's FP8 parameter and all-gather the FP8 bytes over `group`
    (`all_gather(output, input, group, async_op)`); returns the pending gather (None once done, without
    `async_op`)."""
    param = bucket.params_list[0]
    lo, hi = bucket.fp8_param_range
    shard_size = bucket.fp8_param_data.numel() // group_size
    shard_lo = group_rank * shard_size
    start, end = max(lo, shard_lo), min(hi, shard_lo + shard_size)
    master = getattr(param, "fp8_main_shard", None)
    if end <= start:  # this rank's shard holds none of the parameter
        piece = torch.zeros(0, dtype=torch.float32, device=bucket.fp8_param_data.device)
    elif master is not None and master.numel() == end - start:
        piece = master  # the fp32 master piece (the distributed optimizer's)
    elif is_fp8_primary(param):
        raise RuntimeError("an FP8-primary parameter can only be gathered from the distributed optimizer's master")
    else:
        piece = param.detach().reshape(-1)[start - lo:end - lo]  # [*shape] -> [numel], this piece
    amax_ = kernels.amax(piece)
    if group_size > 1:
        dist.all_reduce(amax_, op=dist.ReduceOp.MAX, group=group)
    margin = getattr(param, "fp8_param_margin", 0)
    if end > start:
        q, _ = quantize_shard(piece, amax_, margin)
        bucket.fp8_param_data[start:end].copy_(q.view(torch.uint8))
    scale = kernels.scale_from_amax(amax_, kernels.E4M3, margin)
    scale_inv = torch.ones_like(scale).div(scale)
    local = bucket.fp8_param_data[shard_lo:shard_lo + shard_size]
    handle = all_gather(bucket.fp8_param_data, local, group, async_op)

    def finish():
        copy = _fp8_copy(bucket, param)
        copy.update(scale_inv)
        if not is_fp8_primary(param):  # a parameter with storage of its own holds the FP8 values
            param.data.copy_(copy.dequantized(param.dtype))
        param.fp8_weight_copy = copy

    pending = _PendingFp8Gather(handle if async_op else None, finish)
    if async_op:
        return pending
    pending.wait()
    return None


def make_fp8_primary(bucket) -> None:
    """Quantize the bucket's FP8 parameter (whole, with its own amax: every data-parallel rank holds the same
    values, so no communication) into the bucket's uint8 buffer and make that FP8 copy its only copy (its
    bf16/fp32 storage is dropped). Called once the optimizer has copied the values into its fp32 masters;
    the FP8 bytes are those the next gather from the masters would produce."""
    param = bucket.params_list[0]
    if is_fp8_primary(param):
        return
    copy = _fp8_copy(bucket, param)
    quantize_into(copy, param.detach(), getattr(param, "fp8_param_margin", 0))
    drop_high_precision_storage(param, copy)


__all__ = ["is_fp8_param_bucket", "start_fp8_param_gather", "make_fp8_primary"]
