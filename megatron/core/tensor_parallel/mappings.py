"""Every tensor/sequence-parallel collective, as small autograd functions and plain helpers.

This is the only module that calls `torch.distributed` for TP/SP. Each public wrapper's docstring
states its forward and backward collective. Every wrapper takes an optional `group=`; None means the
TP group of `parallel_state` (and a missing group means TP size 1, i.e. no communication).

Gloo note: gloo lacks `reduce_scatter_tensor` (and on some builds `all_gather_into_tensor`), so for gloo
groups all-gather uses the list form and reduce-scatter is an all-reduce followed by taking this
rank's slice. That is correct but not fast; CPU runs are for correctness.
"""
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from megatron.core import parallel_state

ReduceOp = dist.ReduceOp
# torch >= 2.13 renames the single-tensor collectives (the old names warn); same signatures.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _resolve(group):
    if group is None:
        group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
    return group


def _world_size(group) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group=group)


def _rank(group) -> int:
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group=group)


def get_pg_backend(group) -> str:
    """Backend name of `group` ('gloo', 'nccl', ...)."""
    return dist.get_backend(group)


def _is_gloo(group) -> bool:
    return get_pg_backend(group) == "gloo"


def _reduce(input_: torch.Tensor, group) -> torch.Tensor:
    """Sum `input_` across the group (in place when `input_` is contiguous, as in Megatron)."""
    if _world_size(group) == 1:
        return input_
    input_ = input_.contiguous()
    dist.all_reduce(input_, group=group)
    return input_


def _all_gather_dim0(input_: torch.Tensor, group, output_split_sizes: Optional[List[int]] = None) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 (sizes may differ when output_split_sizes is given)."""
    world_size = _world_size(group)
    if world_size == 1:
        return input_
    input_ = input_.contiguous()
    if output_split_sizes is None:
        sizes = [input_.shape[0]] * world_size
    else:
        sizes = list(output_split_sizes)
    if output_split_sizes is None and not _is_gloo(group):
        if torch.compiler.is_compiling():  # the traceable functional form (not the in-place call)
            return funcol.all_gather_tensor(input_, 0, group)
        output = torch.empty((sizes[0] * world_size,) + tuple(input_.shape[1:]), dtype=input_.dtype, device=input_.device)
        _all_gather_single(output, input_, group=group)
        return output
    max_size = max(sizes)
    padded = input_
    if input_.shape[0] < max_size:
        pad = torch.zeros((max_size - input_.shape[0],) + tuple(input_.shape[1:]), dtype=input_.dtype, device=input_.device)
        padded = torch.cat([input_, pad], dim=0)
    chunks = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(chunks, padded, group=group)
    return torch.cat([chunk[:size] for chunk, size in zip(chunks, sizes)], dim=0)


def _reduce_scatter_dim0(input_: torch.Tensor, group, input_split_sizes: Optional[List[int]] = None) -> torch.Tensor:
    """Sum across the group and keep this rank's slice of dim 0 (even, or by input_split_sizes)."""
    world_size = _world_size(group)
    if world_size == 1:
        return input_
    rank = _rank(group)
    input_ = input_.contiguous()
    if input_split_sizes is None:
        if input_.shape[0] % world_size != 0:
            raise ValueError(
                f"reduce-scatter along dim 0: size {input_.shape[0]} is not divisible by the group size {world_size}"
            )
        sizes = [input_.shape[0] // world_size] * world_size
    else:
        sizes = list(input_split_sizes)
    if input_split_sizes is None and not _is_gloo(group):
        if torch.compiler.is_compiling():
            return funcol.reduce_scatter_tensor(input_, "sum", 0, group)
        output = torch.empty((sizes[0],) + tuple(input_.shape[1:]), dtype=input_.dtype, device=input_.device)
        _reduce_scatter_single(output, input_, group=group)
        return output
    summed = input_.clone()
    dist.all_reduce(summed, group=group)
    start = sum(sizes[:rank])
    return summed[start:start + sizes[rank]].contiguous()


def _split_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    world_size = _world_size(group)
    if world_size == 1:
        return input_
    last = input_.shape[-1]
    if last % world_size != 0:
        raise ValueError(f"last dimension {last} is not divisible by the tensor parallel size {world_size}")
    return torch.split(input_, last // world_size, dim=-1)[_rank(group)].contiguous()


def _split_first_dim(input_: torch.Tensor, group) -> torch.Tensor:
    world_size = _world_size(group)
    if world_size == 1:
        return input_
    first = input_.shape[0]
    if first % world_size != 0:
        raise ValueError(
            f"first dimension {first} is not divisible by the tensor parallel size {world_size} "
            "(with sequence parallelism the sequence length must be divisible by the TP size)"
        )
    size = first // world_size
    rank = _rank(group)
    return input_[rank * size:(rank + 1) * size].contiguous()


def _gather_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    world_size = _world_size(group)
    if world_size == 1:
        return input_
    # [s, b, h/tp] -> [h/tp, s, b] -> (all-gather, rank-major) [h, s, b] -> [s, b, h]
    gathered = _all_gather_dim0(input_.movedim(-1, 0).contiguous(), group)
    # [h, s, b] -> [s, b, h]
    return gathered.movedim(0, -1).contiguous() if input_.dim() > 1 else gathered


def _reduce_scatter_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    world_size = _world_size(group)
    if world_size == 1:
        return input_
    # [s, b, h] -> [h, s, b] (reduce-scatter along the leading dim) -> [h/tp, s, b] -> [s, b, h/tp]
    scattered = _reduce_scatter_dim0(input_.movedim(-1, 0).contiguous(), group)
    # [h/tp, s, b] -> [s, b, h/tp]
    return scattered.movedim(0, -1).contiguous()


def _all_to_all(input_: torch.Tensor, group, output_split_sizes=None, input_split_sizes=None) -> torch.Tensor:
    if _world_size(group) == 1:
        return input_
    input_ = input_.contiguous()
    if output_split_sizes is None:
        output = torch.empty_like(input_)
    else:
        output = input_.new_empty((sum(output_split_sizes),) + tuple(input_.shape[1:]))
    dist.all_to_all_single(
        output, input_, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes, group=group
    )
    return output


def broadcast_tensor(tensor: torch.Tensor, src: int, group) -> torch.Tensor:
    """Broadcast `tensor` in place from global rank `src` over `group` (no autograd)."""
    if _world_size(group) > 1:
        dist.broadcast(tensor, src, group=group)
    return tensor


def all_reduce_tensor(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
    """All-reduce `tensor` in place over `group` (no autograd); returns the work handle when async."""
    if _world_size(group) == 1:
        return None
    if async_op and torch.compiler.is_compiling():
        dist.all_reduce(tensor, op=op, group=group)  # traced: see PendingCollective
        return PendingCollective(None, lambda: tensor)
    handle = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return handle if async_op else None


def all_gather_along_first_dim(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Plain (no autograd) all-gather along dim 0 over `group` (default: TP group)."""
    return _all_gather_dim0(input_, _resolve(group))


def reduce_scatter_along_first_dim(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Plain (no autograd) reduce-scatter along dim 0 over `group` (default: TP group)."""
    return _reduce_scatter_dim0(input_, _resolve(group))


class PendingCollective:
    """A collective launched with `async_op=True`; `wait()` returns its result.

    On NCCL the wait only orders the current stream after the collective (no host block), so GEMMs
    queued between the launch and the wait run while the data moves. Inside a `torch.compile` trace the
    collectives are issued without `async_op` (the compiler cannot trace work handles and would split the
    layer's graph at each one) through torch's functional collectives; the compiler then waits for each
    one where it was issued (no overlap).
    """

    def __init__(self, handle, finish):
        self._handle, self._finish = handle, finish

    def wait(self) -> torch.Tensor:
        """Wait for the collective and return its result."""
        if self._handle is not None:
            self._handle.wait()
        return self._finish()


def all_gather_along_first_dim_async(input_: torch.Tensor, group=None) -> PendingCollective:
    """Start `all_gather_along_first_dim` (no autograd, equal sizes); `.wait()` gives the gathered tensor."""
    group = _resolve(group)
    world_size = _world_size(group)
    if world_size == 1:
        return PendingCollective(None, lambda: input_)
    input_ = input_.contiguous()
    if torch.compiler.is_compiling():
        output = _all_gather_dim0(input_, group)
        return PendingCollective(None, lambda: output)
    if not _is_gloo(group):
        # [s/tp, b, h] -> [s, b, h]
        output = torch.empty((input_.shape[0] * world_size,) + tuple(input_.shape[1:]), dtype=input_.dtype,
                             device=input_.device)
        handle = _all_gather_single(output, input_, group=group, async_op=True)
        return PendingCollective(handle, lambda: output)
    chunks = [torch.empty_like(input_) for _ in range(world_size)]
    handle = dist.all_gather(chunks, input_, group=group, async_op=True)
    return PendingCollective(handle, lambda: torch.cat(chunks, dim=0))


def reduce_scatter_along_first_dim_async(input_: torch.Tensor, group=None) -> PendingCollective:
    """Start `reduce_scatter_along_first_dim` (no autograd, equal sizes); `.wait()` gives this rank's sum."""
    group = _resolve(group)
    world_size = _world_size(group)
    if world_size == 1:
        return PendingCollective(None, lambda: input_)
    if input_.shape[0] % world_size != 0:
        raise ValueError(
            f"reduce-scatter along dim 0: size {input_.shape[0]} is not divisible by the group size {world_size}"
        )
    input_ = input_.contiguous()
    size = input_.shape[0] // world_size
    if torch.compiler.is_compiling():
        output = _reduce_scatter_dim0(input_, group)
        return PendingCollective(None, lambda: output)
    if not _is_gloo(group):
        # [s, b, h] -> [s/tp, b, h]
        output = torch.empty((size,) + tuple(input_.shape[1:]), dtype=input_.dtype, device=input_.device)
        handle = _reduce_scatter_single(output, input_, group=group, async_op=True)
        return PendingCollective(handle, lambda: output)
    summed = input_.clone()
    handle = dist.all_reduce(summed, group=group, async_op=True)
    rank = _rank(group)
    return PendingCollective(handle, lambda: summed[rank * size:(rank + 1) * size].contiguous())


class _Requests:
    """Several point-to-point requests waited for as one."""

    def __init__(self, requests):
        self._requests = requests

    def wait(self) -> None:
        for request in self._requests:
            request.wait()


def ring_exchange_async(send: torch.Tensor, recv: torch.Tensor, group=None) -> PendingCollective:
    """Send `send` to the next rank of `group` (default: TP group) and receive the previous rank's tensor into
    `recv` (same shape); `.wait()` gives `recv`. The building block of the GEMM/communication pipelines of
    `tensor_parallel.overlap` (no autograd)."""
    group = _resolve(group)
    world_size, rank = _world_size(group), _rank(group)
    ranks = dist.get_process_group_ranks(group)
    ops = [
        dist.P2POp(dist.isend, send, ranks[(rank + 1) % world_size], group),
        dist.P2POp(dist.irecv, recv, ranks[(rank - 1) % world_size], group),
    ]
    return PendingCollective(_Requests(dist.batch_isend_irecv(ops)), lambda: recv)


def gather_split_1d_tensor(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every TP rank's 1-D chunk (inverse of `split_tensor_into_1d_equal_chunks`)."""
    # [numel/tp] -> (all-gather) [numel]
    return _all_gather_dim0(tensor.reshape(-1), _resolve(group))


def _gather_along_first_dim(input_, group=None, output_split_sizes=None, use_global_buffer=False):
    """Megatron's private name: plain all-gather along dim 0 (optionally uneven)."""
    return _all_gather_dim0(input_, _resolve(group), output_split_sizes)


def _reduce_scatter_along_first_dim(input_, group=None, input_split_sizes=None, use_global_buffer=False):
    """Megatron's private name: plain reduce-scatter along dim 0 (optionally uneven)."""
    return _reduce_scatter_dim0(input_, _resolve(group), input_split_sizes)


def _gather_along_last_dim(input_, group=None):
    """Megatron's private name: plain all-gather along the last dim."""
    return _gather_last_dim(input_, _resolve(group))


def _split_along_last_dim(input_, group=None):
    """Megatron's private name: this rank's slice of the last dim."""
    return _split_last_dim(input_, _resolve(group))


def _split_along_first_dim(input_, group=None):
    """Megatron's private name: this rank's slice of dim 0."""
    return _split_first_dim(input_, _resolve(group))


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output.clone(), ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        return _reduce(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_last_dim(grad_output, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_last_dim(grad_output, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _all_gather_dim0(grad_output, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, tensor_parallel_output_grad, group, output_split_sizes):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        ctx.output_split_sizes = output_split_sizes
        return _all_gather_dim0(input_, group, output_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.tensor_parallel_output_grad:
            grad = _reduce_scatter_dim0(grad_output, ctx.group, ctx.output_split_sizes)
        elif ctx.output_split_sizes is not None:
            rank = _rank(ctx.group)
            start = sum(ctx.output_split_sizes[:rank])
            grad = grad_output[start:start + ctx.output_split_sizes[rank]].contiguous()
        else:
            grad = _split_first_dim(grad_output, ctx.group)
        return grad, None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group, input_split_sizes):
        ctx.group = group
        ctx.input_split_sizes = input_split_sizes
        return _reduce_scatter_dim0(input_, group, input_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        return _all_gather_dim0(grad_output, ctx.group, ctx.input_split_sizes), None, None


class _AllGatherFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce_scatter_last_dim(grad_output, ctx.group), None


class _ReduceScatterToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _reduce_scatter_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_last_dim(grad_output, ctx.group), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, input_, output_split_sizes, input_split_sizes):
        ctx.group = group
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        return _all_to_all(input_, group, output_split_sizes, input_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        grad = _all_to_all(grad_output, ctx.group, ctx.input_split_sizes, ctx.output_split_sizes)
        return None, grad, None, None


def copy_to_tensor_model_parallel_region(input_, group=None):
    """Forward: identity; backward: all-reduce (sum) the gradient over the TP group."""
    return _CopyToModelParallelRegion.apply(input_, _resolve(group))


def reduce_from_tensor_model_parallel_region(input_, group=None):
    """Forward: all-reduce (sum) over the TP group; backward: identity."""
    return _ReduceFromModelParallelRegion.apply(input_, _resolve(group))


def scatter_to_tensor_model_parallel_region(input_, group=None):
    """Forward: keep this rank's slice of the last dim; backward: all-gather along the last dim."""
    return _ScatterToModelParallelRegion.apply(input_, _resolve(group))


def gather_from_tensor_model_parallel_region(input_, group=None):
    """Forward: all-gather along the last dim; backward: keep this rank's slice of the last dim."""
    return _GatherFromModelParallelRegion.apply(input_, _resolve(group))


def scatter_to_sequence_parallel_region(input_, group=None):
    """Forward: keep this rank's slice of the first (sequence) dim; backward: all-gather along it."""
    return _ScatterToSequenceParallelRegion.apply(input_, _resolve(group))


def gather_from_sequence_parallel_region(
    input_, tensor_parallel_output_grad=True, group=None, output_split_sizes=None, use_global_buffer=False
):
    """Forward: all-gather along the first (sequence) dim; backward: reduce-scatter along it when
    `tensor_parallel_output_grad` (the consumer is TP-parallel), else keep this rank's slice."""
    return _GatherFromSequenceParallelRegion.apply(
        input_, tensor_parallel_output_grad, _resolve(group), output_split_sizes
    )


def reduce_scatter_to_sequence_parallel_region(input_, group=None, input_split_sizes=None, use_global_buffer=False):
    """Forward: reduce-scatter (sum) along the first (sequence) dim; backward: all-gather along it."""
    return _ReduceScatterToSequenceParallelRegion.apply(input_, _resolve(group), input_split_sizes)


def all_gather_last_dim_from_tensor_parallel_region(input_, group=None):
    """Forward: all-gather along the last dim; backward: reduce-scatter (sum) along the last dim."""
    return _AllGatherFromTensorParallelRegion.apply(input_, _resolve(group))


def reduce_scatter_last_dim_to_tensor_parallel_region(input_, group=None):
    """Forward: reduce-scatter (sum) along the last dim; backward: all-gather along the last dim."""
    return _ReduceScatterToTensorParallelRegion.apply(input_, _resolve(group))


def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None):
    """Forward: all-to-all along dim 0 (optional uneven splits); backward: all-to-all with the splits swapped."""
    return _AllToAll.apply(_resolve(group), input_, output_split_sizes_, input_split_sizes)


def all_to_all_sp2hp(input_, group=None):
    """[num_tokens/TP, H] -> [num_tokens, H/TP] via all-to-all (backward: the inverse all-to-all)."""
    group = _resolve(group)
    world_size = _world_size(group)
    # [..., H] -> [num_tokens/TP, H]
    input_ = input_.reshape(-1, input_.shape[-1])
    # TP x [num_tokens/TP, H/TP] -> [num_tokens, H/TP] (chunk i goes to rank i)
    stacked = torch.cat(torch.split(input_, input_.shape[-1] // world_size, dim=1), dim=0)
    return all_to_all(group, stacked)


def all_to_all_hp2sp(input_, group=None):
    """[num_tokens, H/TP] -> [num_tokens/TP, H] via all-to-all (backward: the inverse all-to-all)."""
    group = _resolve(group)
    world_size = _world_size(group)
    # [..., H/TP] -> [num_tokens, H/TP]
    input_ = input_.reshape(-1, input_.shape[-1])
    exchanged = all_to_all(group, input_)
    # [num_tokens, H/TP] -> TP x [num_tokens/TP, H/TP] -> [num_tokens/TP, H]
    return torch.cat(torch.split(exchanged, exchanged.shape[0] // world_size, dim=0), dim=-1)
