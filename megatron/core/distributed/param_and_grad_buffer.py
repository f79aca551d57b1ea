"""Contiguous parameter/gradient buffers, their buckets, and every data-parallel collective on them.

A `_ParamAndGradBuffer` holds the gradients (and, with the distributed optimizer, the parameters) of all
parameters of one (param dtype, grad dtype) pair in one flat tensor. Parameters are laid out in reverse
order of registration, which approximates the order in which backward produces their gradients, and are
grouped into buckets of about `bucket_size` elements. A `_ParamAndGradBucketGroup` is the unit of
communication: one all-reduce (or reduce-scatter for the distributed optimizer) per bucket for
gradients, one all-gather per bucket for parameters.

With `--fp8-param-gather` an FP8 parameter's bucket stores it as uint8 FP8 bytes, one tensor per bucket then
(`_allocate_param_data`), and no bf16/fp32 copy is allocated for it (`fp8_param_gather`).

Padding rules (Megatron's, so that `distrib_optim.pt` files line up): with the distributed optimizer,
every parameter starts at a multiple of 64 elements and every bucket ends at a multiple of
lcm(DP, 128) (and 2**16 with `pad_buckets_for_high_nccl_busbw`), so each DP rank owns an equal
contiguous shard of every bucket.
"""
import math
from enum import Enum
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.deferred_checks import get_deferred_checks, not_finite

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.fp8_param_gather import is_fp8_param_bucket, make_fp8_primary, start_fp8_param_gather
from megatron.core.fp8.params import install_fp8_primary_hooks

# Buckets whose local gradient norm exceeds this multiple of the largest norm seen during the first
# `_LARGE_GRAD_WINDOW` checks are reported by `check_for_large_grads`.
_LARGE_GRAD_FACTOR = 10.0
_LARGE_GRAD_WINDOW = 100

_PARAM_START_ALIGNMENT = 64
_BUCKET_END_ALIGNMENT = 128
_HIGH_BUSBW_ALIGNMENT = 2**16


class BufferType(Enum):
    """Which half of a `_ParamAndGradBuffer` a tensor lives in."""

    PARAM = 1
    GRAD = 2


def shard_buffer(buffer: torch.Tensor, data_parallel_world_size: int) -> List[torch.Tensor]:
    """Split a flat buffer into `data_parallel_world_size` equal contiguous views (one per DP rank)."""
    if buffer.numel() % data_parallel_world_size != 0:
        raise ValueError(
            f"buffer of {buffer.numel()} elements cannot be split evenly over {data_parallel_world_size} ranks"
        )
    shard_size = buffer.numel() // data_parallel_world_size
    return [buffer[r * shard_size : (r + 1) * shard_size] for r in range(data_parallel_world_size)]


def _reduce_scatter(output, inp, op, group, async_op):
    func = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return func(output, inp, op=op, group=group, async_op=async_op)


def _all_gather(output, inp, group, async_op):
    func = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return func(output, inp, group=group, async_op=async_op)


def _native_avg(group) -> bool:
    """ReduceOp.AVG is only relied on for NCCL; elsewhere AVG is a SUM followed by a division."""
    return dist.get_backend(group) == "nccl"


class _ParamAndGradBucket:
    """A contiguous slice of a buffer: the unit of one collective call.

    `offset` is the bucket's start inside its buffer; `numel_unpadded` counts the elements up to the end
    of its last parameter (the bucket's trailing padding excluded). `param_to_index` gives each param's
    (start, end) as if the bucket's params were packed back to back with no alignment (Megatron's map for
    copying all-gathered params out of a reused buffer); the real positions are the buffer's
    `param_index_map`.
    """

    def __init__(
        self,
        params: List[torch.nn.Parameter],
        param_data: Optional[torch.Tensor],
        grad_data: torch.Tensor,
        offset: int,
        numel_unpadded: int,
        gradient_scaling_factor: float,
        bucket_id: int,
    ):
        self.params_list = params
        self.params = set(params)
        if len(self.params_list) != len(self.params):
            raise ValueError("a bucket must not hold the same parameter twice")
        self.param_data = param_data
        self.grad_data = grad_data
        self.offset = offset
        self.numel_unpadded = numel_unpadded
        self.gradient_scaling_factor = gradient_scaling_factor
        self.bucket_id = bucket_id
        self.param_to_index: Dict[torch.nn.Parameter, Tuple[int, int]] = {}
        # `--fp8-param-gather`: [start, end) of the bucket's one FP8 parameter in it, and its uint8 storage (the
        # bucket's `param_data`, all-gathered as it is)
        self.fp8_param_range: Optional[Tuple[int, int]] = None
        self.fp8_param_data: Optional[torch.Tensor] = None
        packed = 0
        for param in params:
            self.param_to_index[param] = (packed, packed + param.numel())
            packed += param.numel()


class _ParamAndGradBucketGroup:
    """Buckets that communicate together; tracks readiness of gradients and outstanding collectives.

    `collective_group` is the group gradients are reduced over: with the distributed optimizer the group
    its state is sharded over (Megatron's attributes `intra_distributed_optimizer_instance_group/_size/
    _rank`), otherwise the data-parallel group (attribute `data_parallel_group`). With several
    distributed-optimizer instances, gradients are then all-reduced over
    `inter_distributed_optimizer_instance_group` as well.
    """

    def __init__(
        self,
        buckets: List[_ParamAndGradBucket],
        ddp_config: DistributedDataParallelConfig,
        collective_group,
        collective_group_size: int,
    ):
        self.buckets = buckets
        self.ddp_config = ddp_config
        self._group = collective_group
        self._group_size = collective_group_size
        self._group_rank = collective_group.rank()
        if ddp_config.use_distributed_optimizer:
            self.intra_distributed_optimizer_instance_group = collective_group
            self.intra_distributed_optimizer_instance_size = collective_group_size
            self.intra_distributed_optimizer_instance_rank = self._group_rank
        else:
            self.data_parallel_group = collective_group
        self.inter_distributed_optimizer_instance_group = None
        self.params = set()
        self.param_to_bucket: Dict[torch.nn.Parameter, _ParamAndGradBucket] = {}
        for bucket in buckets:
            for param in bucket.params_list:
                self.params.add(param)
                self.param_to_bucket[param] = bucket
        self.param_to_name: Dict[torch.nn.Parameter, str] = {}
        self.next_param_gather_bucket_group: Optional["_ParamAndGradBucketGroup"] = None
        self.grad_reduce_handles: List = []
        self.param_gather_handles: List = []
        self.param_gather_dispatched = False
        self._pending_average_divisor = 1
        self._checked_grad_norms: List[float] = []
        self.reset()

    @property
    def grad_reduce_handle(self):
        """The outstanding gradient collectives (None when none is in flight)."""
        return self.grad_reduce_handles or None

    @property
    def param_gather_handle(self):
        """The outstanding parameter all-gathers (None when none is in flight)."""
        return self.param_gather_handles or None

    def reset(self):
        """Forget which gradients are ready; called by `zero_grad_buffer` at the start of an iteration."""
        self.params_with_grad = set()
        self.is_last_microbatch = True

    def _sharded_optimizer(self) -> bool:
        return self.ddp_config.use_distributed_optimizer

    def _local_shard(self, tensor: torch.Tensor) -> torch.Tensor:
        return shard_buffer(tensor, self._group_size)[self._group_rank]

    def check_grads(self, check_for_nan_in_grad: bool, check_for_large_grads: bool):
        """Raise if a bucket's local (not yet reduced) gradients hold NaN/Inf or an unexpectedly large norm.

        The NaN/Inf check alone on CUDA is deferred (`megatron.core.deferred_checks`): no host sync here.
        """
        if not self.buckets:
            return
        rank = dist.get_rank()
        if len(self.buckets) == 1:
            norms = torch.linalg.vector_norm(self.buckets[0].grad_data, ord=2, dtype=torch.float32).reshape(1)
        else:
            norms = torch.stack([torch.linalg.vector_norm(b.grad_data, ord=2, dtype=torch.float32)
                                 for b in self.buckets])  # n x [] -> [n]
        deferred = get_deferred_checks()
        if check_for_nan_in_grad and not check_for_large_grads and deferred.should_defer(norms):
            deferred.add(norms, lambda: self._first_nonfinite_message(rank, norms), predicate=not_finite)
            return
        for bucket, norm in zip(self.buckets, norms.tolist()):
            if check_for_nan_in_grad and not math.isfinite(norm):
                raise RuntimeError(self._nonfinite_message(rank, bucket, norm))
            if check_for_large_grads and math.isfinite(norm):
                history = self._checked_grad_norms
                if len(history) >= _LARGE_GRAD_WINDOW and norm > _LARGE_GRAD_FACTOR * max(history):
                    raise RuntimeError(
                        f"Rank {rank}: found unexpectedly large grad norm {norm:.4e} (more than "
                        f"{_LARGE_GRAD_FACTOR:g}x the largest of the first {_LARGE_GRAD_WINDOW} norms, "
                        f"{max(history):.4e}) for bucket #{bucket.bucket_id} before data-parallel communication"
                    )
                if len(history) < _LARGE_GRAD_WINDOW:
                    history.append(norm)

    def _first_nonfinite_message(self, rank: int, norms: torch.Tensor) -> str:
        """The error of a deferred NaN/Inf check: the first bucket whose norm (read now) is not finite."""
        values = norms.tolist()
        index = next(i for i, v in enumerate(values) if not math.isfinite(v))
        return self._nonfinite_message(rank, self.buckets[index], values[index])

    def _nonfinite_message(self, rank: int, bucket, norm: float) -> str:
        return (f"Rank {rank}: found {'NaN' if math.isnan(norm) else 'Inf'} in local grad norm for bucket "
                f"#{bucket.bucket_id} in backward pass before data-parallel communication collective "
                f"(parameters: {self._bucket_param_names(bucket)})")

    def _bucket_param_names(self, bucket) -> str:
        names = [self.param_to_name.get(p, f"<param {tuple(p.shape)}>") for p in bucket.params_list]
        return ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")

    def start_grad_sync(self):
        """Launch the gradient collectives of this group (async when `overlap_grad_reduce`)."""
        if self.grad_reduce_handles:
            raise RuntimeError("Should not have multiple gradient communication calls outstanding at once")
        if self.ddp_config.check_for_nan_in_grad or self.ddp_config.check_for_large_grads:
            self.check_grads(self.ddp_config.check_for_nan_in_grad, self.ddp_config.check_for_large_grads)
        group = self._group
        op = dist.ReduceOp.SUM
        self._pending_average_divisor = 1
        if self._scaling_is_average(group):
            op = dist.ReduceOp.AVG  # NCCL divides inside the collective: no separate pass over the buffer
        else:
            for bucket in self.buckets:
                if bucket.gradient_scaling_factor != 1.0:
                    bucket.grad_data.mul_(bucket.gradient_scaling_factor)
        if self.ddp_config.average_in_collective:
            if _native_avg(group):
                op = dist.ReduceOp.AVG
            else:
                self._pending_average_divisor = self._group_size
        async_op = self.ddp_config.overlap_grad_reduce
        for bucket in self.buckets:
            if self._sharded_optimizer():
                handle = _reduce_scatter(self._local_shard(bucket.grad_data), bucket.grad_data, op, group, async_op)
            else:
                handle = dist.all_reduce(bucket.grad_data, op=op, group=group, async_op=async_op)
            if async_op:
                self.grad_reduce_handles.append(handle)
        if not async_op:
            self._complete_grad_sync()

    def _scaling_is_average(self, group) -> bool:
        """True when every bucket's pre-scaling is exactly 1/group size and NCCL can average natively."""
        if not self.buckets or self.ddp_config.average_in_collective or not _native_avg(group):
            return False
        size = self._group_size
        return size > 1 and all(b.gradient_scaling_factor * size == 1.0 for b in self.buckets)

    def _complete_grad_sync(self):
        """Work that must follow the intra-instance collectives: the cross-instance all-reduce and AVG."""
        for handle in self.grad_reduce_handles:
            handle.wait()
        self.grad_reduce_handles = []
        divisor = self._pending_average_divisor
        inter_group = self.inter_distributed_optimizer_instance_group
        if self.ddp_config.num_distributed_optimizer_instances > 1:
            if not self._sharded_optimizer():
                raise RuntimeError("several distributed-optimizer instances need use_distributed_optimizer=True")
            op = dist.ReduceOp.SUM
            if self.ddp_config.average_in_collective:
                if _native_avg(inter_group):
                    op = dist.ReduceOp.AVG
                else:
                    divisor *= self.ddp_config.num_distributed_optimizer_instances
            for bucket in self.buckets:
                dist.all_reduce(self._local_shard(bucket.grad_data), op=op, group=inter_group)
        if divisor != 1:
            for bucket in self.buckets:
                target = self._local_shard(bucket.grad_data) if self._sharded_optimizer() else bucket.grad_data
                target.div_(divisor)
        self._pending_average_divisor = 1

    def finish_grad_sync(self):
        """Finish the gradient collectives (launching them here, synchronously, without overlap)."""
        self.param_gather_dispatched = False
        if not self.ddp_config.overlap_grad_reduce:
            self.start_grad_sync()
            return
        if not self.grad_reduce_handles:
            missing = [self.param_to_name.get(p, tuple(p.shape)) for p in self.params if p not in self.params_with_grad]
            raise RuntimeError(
                "Communication call has not been issued for this bucket "
                f"({len(self.params_with_grad)}/{len(self.params)} params have grad available); "
                f"parameters without a gradient: {missing[:8]}. With overlap_grad_reduce every parameter must "
                "receive a gradient in the last microbatch (or set requires_grad=False on unused ones)."
            )
        self._complete_grad_sync()

    def register_grad_ready(self, param: torch.nn.Parameter):
        """Record that `param`'s gradient is in its main_grad; launch the collective once all are ready."""
        if not self.ddp_config.overlap_grad_reduce:
            raise RuntimeError("register_grad_ready is only used with overlap_grad_reduce=True")
        if not self.is_last_microbatch:
            return
        if param not in self.param_to_bucket:
            raise RuntimeError("param is not in this bucket group")
        if param in self.params_with_grad:
            raise RuntimeError(
                f"Cannot set grad twice for {self.param_to_name.get(param, tuple(param.shape))}: the parameter's "
                "gradient was accumulated twice in one backward pass"
            )
        self.params_with_grad.add(param)
        if len(self.params_with_grad) == len(self.params):
            self.start_grad_sync()

    def start_param_sync(self, force_sync: bool = False):
        """All-gather the updated parameter shards (async with `overlap_param_gather` unless forced)."""
        if not self._sharded_optimizer():
            raise RuntimeError("parameter all-gather is only used with the distributed optimizer")
        if force_sync:
            if self.param_gather_handles:
                self._wait_param_gather()
                return
        elif self.param_gather_handles:
            raise RuntimeError("Should not have multiple parameter all-gathers outstanding at once")
        async_op = self.ddp_config.overlap_param_gather and not force_sync
        self.param_gather_dispatched = True
        group = self._group
        for bucket in self.buckets:
            if bucket.fp8_param_range is not None:  # an FP8 parameter: its FP8 bytes are gathered
                handle = start_fp8_param_gather(bucket, group, self._group_size, self._group_rank, _all_gather,
                                                async_op)
            else:
                handle = _all_gather(bucket.param_data, self._local_shard(bucket.param_data), group, async_op)
            if async_op:
                self.param_gather_handles.append(handle)

    def _wait_param_gather(self):
        for handle in self.param_gather_handles:
            handle.wait()
        self.param_gather_handles = []

    def finish_param_sync(self, skip_next_bucket_dispatch: bool = False):
        """Wait for this group's parameter all-gather (dispatching it if needed), then prefetch the next."""
        if not self.ddp_config.overlap_param_gather:
            raise RuntimeError("finish_param_sync is only used with overlap_param_gather=True")
        if not self.param_gather_dispatched:
            self.start_param_sync()
        if self.param_gather_handles:
            self._wait_param_gather()
            following = self.next_param_gather_bucket_group
            if following is not None and not skip_next_bucket_dispatch and not following.param_gather_dispatched:
                following.start_param_sync()


def _pad(number: int, divisor: int) -> int:
    return int(math.ceil(number / divisor) * divisor)


class _ParamAndGradBuffer:
    """Flat gradient (and parameter) storage for one (param dtype, grad dtype) pair, cut into buckets.

    After construction every parameter has `.main_grad`, a view into `grad_data`; with the distributed
    optimizer `param.data` is a view into `param_data` as well (an FP8 parameter's storage is its bucket's
    uint8 FP8 bytes instead: `fp8_param_gather`).
    """

    def __init__(
        self,
        ddp_config: DistributedDataParallelConfig,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        params: List[torch.nn.Parameter],
        data_parallel_group,
        bucket_size: Optional[int],
        param_to_name: Dict[torch.nn.Parameter, str],
        gradient_scaling_factor: float,
        param_indices: List[int],
    ):
        self.ddp_config = ddp_config
        self.params = params
        self.param_indices = param_indices
        if len(set(params)) != len(params):
            raise ValueError("a parameter was registered twice in one gradient buffer")
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.data_parallel_group = data_parallel_group
        self.data_parallel_world_size = data_parallel_group.size()
        self.gradient_scaling_factor = gradient_scaling_factor
        self.param_to_name = param_to_name
        self.buckets: List[_ParamAndGradBucket] = []
        self.param_to_bucket: Dict[torch.nn.Parameter, _ParamAndGradBucket] = {}
        self.param_index_map: Dict[torch.nn.Parameter, Tuple[int, int, int]] = {}

        per_bucket_numel_unpadded, bucket_indices = self._layout(bucket_size)
        self.bucket_indices = bucket_indices
        self.numel = bucket_indices[-1][1] if bucket_indices else 0
        self.numel_unpadded = sum(per_bucket_numel_unpadded)
        self.param_data = None
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=params[0].device)
        self._attach_params_and_build_buckets(per_bucket_numel_unpadded)

    def _bucket_end_divisor(self) -> int:
        divisor = math.lcm(self.data_parallel_world_size, _BUCKET_END_ALIGNMENT)
        if self.ddp_config.pad_buckets_for_high_nccl_busbw:
            divisor = math.lcm(divisor, _HIGH_BUSBW_ALIGNMENT)
        return divisor

    def _pad_bucket_end(self, end: int) -> int:
        if self.ddp_config.use_distributed_optimizer:
            return _pad(end, self._bucket_end_divisor())
        return end

    def _pad_param_start(self, start: int) -> int:
        if self.ddp_config.use_distributed_optimizer:
            return _pad(start, _PARAM_START_ALIGNMENT)
        return start

    def _needs_own_bucket(self, param) -> bool:
        """Shared (tied) embeddings (and FP8 parameters under `fp8_param_gather`, whose bytes are gathered as
        FP8) get a bucket to themselves with the distributed optimizer, so that
        their shard boundaries are the same on the first and the last pipeline stage."""
        fp8 = bool(getattr(param, "fp8_param", False)) and self.ddp_config.fp8_param_gather  # gathers FP8 bytes
        return (bool(getattr(param, "shared_embedding", False)) or fp8) and self.ddp_config.use_distributed_optimizer

    def _layout(self, bucket_size: Optional[int]):
        """Assign [start, end) and a bucket id to every param, in reverse order of registration."""
        per_bucket_numel_unpadded: List[int] = []
        bucket_indices: List[Tuple[int, int]] = []
        state = {"bucket_start": 0, "bucket_id": 0, "count": 0}

        def close_bucket(param_end: int) -> int:
            bucket_end = self._pad_bucket_end(param_end)
            per_bucket_numel_unpadded.append(param_end - state["bucket_start"])
            bucket_indices.append((state["bucket_start"], bucket_end))
            state["bucket_start"] = bucket_end
            state["bucket_id"] += 1
            state["count"] = 0
            return bucket_end

        param_start = 0
        param_end = 0
        for param in self.params[::-1]:
            param_start = self._pad_param_start(param_start)
            if self._needs_own_bucket(param) and state["count"] > 0:
                param_start = close_bucket(param_start)
            param_end = param_start + param.data.nelement()
            self.param_index_map[param] = (param_start, param_end, state["bucket_id"])
            state["count"] += 1
            full = bucket_size is not None and (param_end - state["bucket_start"]) >= bucket_size
            if full or self._needs_own_bucket(param):
                param_start = close_bucket(param_end)
            else:
                param_start = param_end
        if state["count"] > 0:
            close_bucket(param_end)
        return per_bucket_numel_unpadded, bucket_indices

    def _bucket_params(self) -> Dict[int, List[torch.nn.Parameter]]:
        bucket_params: Dict[int, List[torch.nn.Parameter]] = {i: [] for i in range(len(self.bucket_indices))}
        for param in self.params[::-1]:
            bucket_params[self.param_index_map[param][2]].append(param)
        return bucket_params

    def _allocate_param_data(self, fp8_bucket_ids) -> List[Optional[torch.Tensor]]:
        """Each bucket's parameter storage with the distributed optimizer (None per bucket without): views of
        one flat `param_data`, or, when some buckets hold FP8 parameters (`--fp8-param-gather`), one tensor per
        bucket, a uint8 one (one byte per value, no bf16/fp32 storage) for each FP8 bucket."""
        if not self.ddp_config.use_distributed_optimizer:
            return [None] * len(self.bucket_indices)
        device = self.grad_data.device
        if not fp8_bucket_ids:
            self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, device=device)
            return [self.param_data[start:end] for start, end in self.bucket_indices]
        return [torch.zeros(end - start, dtype=torch.uint8 if bucket_id in fp8_bucket_ids else self.param_dtype,
                            device=device) for bucket_id, (start, end) in enumerate(self.bucket_indices)]

    def _attach_params_and_build_buckets(self, per_bucket_numel_unpadded: List[int]):
        bucket_params = self._bucket_params()
        fp8_bucket_ids = {bucket_id for bucket_id, params in bucket_params.items()
                          if is_fp8_param_bucket(params, self.ddp_config)}
        bucket_param_data = self._allocate_param_data(fp8_bucket_ids)
        for param in self.params[::-1]:
            start, end, bucket_id = self.param_index_map[param]
            if bucket_param_data[bucket_id] is not None and bucket_id not in fp8_bucket_ids:
                # Move the parameter into the shared buffer so all-gathers write straight into the model (an
                # FP8 parameter keeps its storage until its FP8 copy becomes its only one: `fp8_param_gather`).
                bucket_start = self.bucket_indices[bucket_id][0]
                flat = bucket_param_data[bucket_id][start - bucket_start:end - bucket_start]
                flat.copy_(param.data.reshape(-1))  # [*param.shape] -> [numel]
                param.data = flat.view(param.shape)  # [numel] -> [*param.shape]
            param.main_grad = self.grad_data[start:end].view(param.shape)  # [numel] -> [*param.shape]
        for bucket_id, (start, end) in enumerate(self.bucket_indices):
            bucket = _ParamAndGradBucket(
                params=bucket_params[bucket_id],
                param_data=bucket_param_data[bucket_id],
                grad_data=self.grad_data[start:end],
                offset=start,
                numel_unpadded=per_bucket_numel_unpadded[bucket_id],
                gradient_scaling_factor=self.gradient_scaling_factor,
                bucket_id=bucket_id,
            )
            if bucket_id in fp8_bucket_ids:
                param_start, param_end, _ = self.param_index_map[bucket.params_list[0]]
                bucket.fp8_param_range = (param_start - start, param_end - start)
                bucket.fp8_param_data = bucket.param_data
            self.buckets.append(bucket)
            for param in bucket.params_list:
                self.param_to_bucket[param] = bucket

    def _fp8_buckets(self) -> List[_ParamAndGradBucket]:
        return [bucket for bucket in self.buckets if bucket.fp8_param_range is not None]

    def make_fp8_params_primary(self, modules: List[torch.nn.Module]) -> None:
        """`--fp8-param-gather`, once the distributed optimizer holds the fp32 masters: every FP8 parameter's FP8
        copy becomes its only copy (`fp8_param_gather.make_fp8_primary`; no communication), and the modules
        among `modules` (and their submodules) that own one save it dequantized and quantize what they load."""
        buckets = self._fp8_buckets()
        for bucket in buckets:
            make_fp8_primary(bucket)
        if buckets:
            for module in modules:
                install_fp8_primary_hooks(module)

    def gather_fp8_params(self) -> None:
        """Re-quantize every FP8 parameter from the optimizer's fp32 masters and all-gather the FP8 bytes, now
        (after the masters were loaded from a checkpoint: the FP8 copy is then the one training had)."""
        group = self.data_parallel_group
        for bucket in self._fp8_buckets():
            start_fp8_param_gather(bucket, group, self.data_parallel_world_size, group.rank(), _all_gather, False)

    def scale_gradients(self, scaling_factor):
        """Multiply every gradient in the buffer by `scaling_factor`."""
        self.grad_data.mul_(scaling_factor)

    def reset(self):
        """Zero the gradient buffer (start of an iteration)."""
        self.grad_data.zero_()

    def _get(self, shape: torch.Size, start_index: int, buffer_type: BufferType) -> torch.Tensor:
        end_index = start_index + shape.numel()
        if end_index > self.numel:
            raise ValueError("requested tensor is out of the buffer range")
        if buffer_type == BufferType.GRAD:
            return self.grad_data[start_index:end_index].view(shape)  # [numel] -> [*shape]
        if self.param_data is not None:
            return self.param_data[start_index:end_index].view(shape)  # [numel] -> [*shape]
        for bucket in self.buckets:  # parameter storage per bucket (FP8 parameters)
            inside = bucket.offset <= start_index and end_index <= bucket.offset + bucket.grad_data.numel()
            if inside and bucket.param_data is not None and bucket.fp8_param_range is None:
                # [numel] -> [*shape]
                return bucket.param_data[start_index - bucket.offset:end_index - bucket.offset].view(shape)
        raise ValueError("this buffer holds no high-precision parameter data there (distributed optimizer not in "
                         "use, or an FP8 parameter's bucket)")


def partition_buckets(
    buffers: List[_ParamAndGradBuffer], force_single_bucket_group: bool = False
) -> List[_ParamAndGradBucketGroup]:
    """Group buckets for communication: one group per bucket, or one group for everything.

    Groups are returned in bucket order (bucket 0 holds the parameters used last in forward).
    """
    if not buffers:
        return []
    ddp_config = buffers[0].ddp_config
    group = buffers[0].data_parallel_group
    group_size = buffers[0].data_parallel_world_size
    if force_single_bucket_group:
        all_buckets = [bucket for buffer in buffers for bucket in buffer.buckets]
        groups = [_ParamAndGradBucketGroup(all_buckets, ddp_config, group, group_size)]
    else:
        groups = [
            _ParamAndGradBucketGroup([bucket], ddp_config, buffer.data_parallel_group, buffer.data_parallel_world_size)
            for buffer in buffers
            for bucket in buffer.buckets
        ]
    for buffer in buffers:
        for bucket_group in groups:
            bucket_group.param_to_name.update(
                {p: buffer.param_to_name[p] for p in bucket_group.params if p in buffer.param_to_name}
            )
    return groups
