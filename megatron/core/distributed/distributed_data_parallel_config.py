"""`DistributedDataParallelConfig`: every knob of data-parallel gradient and parameter communication.

Field names and defaults are Megatron Core 0.13.1's, so `megatron/training` can fill the dataclass from
same-named command-line arguments. Fields that drive features this framework does not implement
(Megatron's custom FSDP, FP8 parameter gathers, NCCL user buffers) are kept so that configs built for
Megatron still construct; the CLI rejects the flags that would turn them on.
"""
from dataclasses import dataclass
from typing import Optional

_SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass
class DistributedDataParallelConfig:
    """Configuration of `DistributedDataParallel` (and the data-parallel side of the distributed optimizer)."""

    grad_reduce_in_fp32: bool = False
    """Keep the contiguous gradient buffers (and so the data-parallel reduction) in fp32 even when the
    parameters are bf16/fp16."""

    overlap_grad_reduce: bool = False
    """Launch each bucket's all-reduce (or reduce-scatter) during backward as soon as all of the bucket's
    gradients are ready, instead of all at once after backward."""

    overlap_param_gather: bool = False
    """With the distributed optimizer: launch the parameter all-gathers asynchronously after the optimizer
    step and wait for each bucket in a forward pre-hook of the first module that uses it."""

    align_param_gather: bool = False
    """If true, all pipeline stages launch their parameter all-gathers at the same time (driven by the
    schedule through `config.param_sync_func`); otherwise each stage launches them as it needs them."""

    use_distributed_optimizer: bool = False
    """Shard the optimizer state over data-parallel ranks (ZeRO-1): gradients are reduce-scattered and the
    updated parameters are all-gathered."""

    num_distributed_optimizer_instances: int = 1
    """Number of distributed-optimizer replicas the data-parallel group is split into; the optimizer state
    is sharded within an instance and gradients are all-reduced across instances."""

    check_for_nan_in_grad: bool = False
    """Check every bucket's local gradients for NaN/Inf before communication and raise naming the rank."""

    check_for_large_grads: bool = False
    """Check every bucket's local gradient norm for an unexpectedly large value (more than 10x the largest
    norm seen so far) before communication and raise naming the rank."""

    bucket_size: Optional[int] = None
    """Maximum number of elements per communication bucket; None means one bucket per gradient buffer."""

    pad_buckets_for_high_nccl_busbw: bool = False
    """Pad every bucket (distributed optimizer only) to a multiple of 2**16 elements as well, which NCCL
    ring collectives need for full bus bandwidth at large data-parallel sizes."""

    average_in_collective: bool = False
    """Average inside the collective (ReduceOp.AVG) instead of pre-scaling by 1/(DP*CP) and summing."""

    fp8_param_gather: bool = False
    """Keep compute parameters in FP8 and all-gather them in FP8 (needs Transformer Engine; not
    implemented here, rejected by the CLI)."""

    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    """Reuse the gradient buffer for the MXFP8 parameter all-gather (needs `fp8_param_gather`)."""

    use_custom_fsdp: bool = False
    """Use Megatron's custom FSDP code path (not implemented here; `--use-custom-fsdp` is rejected)."""

    data_parallel_sharding_strategy: str = "no_shard"
    """Custom-FSDP sharding strategy: 'no_shard', 'optim', 'optim_grads' or 'optim_grads_params'."""

    gradient_reduce_div_fusion: bool = True
    """Custom FSDP: fuse the 1/DP division into the gradient reduce."""

    suggested_communication_unit_size: Optional[int] = None
    """Custom FSDP: number of elements communicated at once (also controls all-gather prefetching)."""

    preserve_fp32_weights: bool = True
    """Custom FSDP: keep fp32 weights in the parameter buffer."""

    keep_fp8_transpose_cache_when_using_custom_fsdp: bool = False
    """Custom FSDP: keep the FP8 transpose cache of parameters."""

    nccl_ub: bool = False
    """Allocate and register NCCL user buffers for the parameter and gradient buffers (custom FSDP)."""

    fsdp_double_buffer: bool = False
    """Custom FSDP: use persistently allocated double buffers for communication (forced on by nccl_ub)."""

    def __post_init__(self):
        problems = []
        if self.num_distributed_optimizer_instances < 1:
            problems.append(
                f"num_distributed_optimizer_instances ({self.num_distributed_optimizer_instances}) must be >= 1: "
                "use 1 to shard the optimizer over the whole data-parallel group."
            )
        if self.num_distributed_optimizer_instances > 1 and not self.use_distributed_optimizer:
            problems.append(
                f"num_distributed_optimizer_instances ({self.num_distributed_optimizer_instances}) > 1 needs "
                "use_distributed_optimizer=True: enable the distributed optimizer or set the instances to 1."
            )
        if self.bucket_size is not None and self.bucket_size <= 0:
            problems.append(
                f"bucket_size ({self.bucket_size}) must be a positive number of elements or None (one bucket)."
            )
        if self.data_parallel_sharding_strategy not in _SHARDING_STRATEGIES:
            problems.append(
                f"data_parallel_sharding_strategy ({self.data_parallel_sharding_strategy!r}) must be one of "
                f"{', '.join(_SHARDING_STRATEGIES)}."
            )
        if self.reuse_grad_buf_for_mxfp8_param_ag and not self.fp8_param_gather:
            problems.append(
                "reuse_grad_buf_for_mxfp8_param_ag=True needs fp8_param_gather=True: turn off the buffer reuse."
            )
        if self.nccl_ub:
            self.fsdp_double_buffer = True
        if problems:
            raise ValueError("Invalid DistributedDataParallelConfig:\n  " + "\n  ".join(problems))
