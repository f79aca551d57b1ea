"""Every context-parallel collective: the ring exchange of K/V (and of their gradients), the all-gather of
K/V along the sequence, and the all-to-all that trades sequence shards for head shards.

This is the only module that calls `torch.distributed` for context parallelism (a grep test holds that
line). Each autograd wrapper's docstring states its forward and its backward collective. Every function
takes the CP process group explicitly (the attention resolves it once, from `model_comm_pgs.cp` or
`parallel_state`).

Gloo note: gloo lacks `reduce_scatter_tensor` and, on some builds, `all_gather_into_tensor`; for gloo groups
the all-gather uses the list form and the reduce-scatter is an all-reduce followed by taking this rank's
slice. Correct, not fast: CPU runs are for correctness.
"""
from typing import List, Sequence

import torch
import torch.distributed as dist

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group) -> int:
    """Size of `group` (1 when there is no group or torch.distributed is not running)."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group=group)


def group_rank(group) -> int:
    """This process's rank in `group` (0 without a group)."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group=group)


def group_ranks(group) -> List[int]:
    """Global ranks of `group`'s members in group-rank order."""
    return list(dist.get_process_group_ranks(group))


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


class RingTransfer:
    """Tensors in flight to the next rank of a ring; `wait()` returns those received from the previous rank.

    Launched with `ring_send_recv`. On NCCL the transfer runs on the communicator's own stream, so attention
    kernels queued before `wait()` overlap it; `wait()` makes the current stream wait for the arrival.
    """

    def __init__(self, requests, sent: List[torch.Tensor], received: List[torch.Tensor]):
        self._requests = requests
        self._sent = sent  # kept alive until the transfer completes
        self._received = received

    def wait(self) -> List[torch.Tensor]:
        """Block (the current stream, on GPUs) until every tensor has arrived; returns them."""
        for request in self._requests:
            request.wait()
        self._requests, self._sent = [], []
        return self._received


def ring_send_recv(tensors: Sequence[torch.Tensor], group) -> RingTransfer:
    """Send each tensor to the next rank of `group` and receive the same shapes from the previous rank,
    asynchronously (no autograd: the ring attention's forward and backward call it explicitly)."""
    size, rank = group_size(group), group_rank(group)
    ranks = dist.get_process_group_ranks(group)
    next_rank, prev_rank = ranks[(rank + 1) % size], ranks[(rank - 1) % size]
    sent = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in sent]
    ops = []
    # Even ranks send first and odd ranks receive first, so a backend that executes the batch in order
    # never has every rank blocked in a send.
    for send, recv in zip(sent, received):
        pair = [dist.P2POp(dist.isend, send, next_rank, group),
                dist.P2POp(dist.irecv, recv, prev_rank, group)]
        ops.extend(pair if rank % 2 == 0 else pair[::-1])
    return RingTransfer(dist.batch_isend_irecv(ops), sent, received)


def _all_gather_dim0(input_: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return input_
    input_ = input_.contiguous()
    if not _is_gloo(group):
        output = input_.new_empty((size * input_.shape[0],) + tuple(input_.shape[1:]))
        _all_gather_single(output, input_, group=group)
        return output
    pieces = [torch.empty_like(input_) for _ in range(size)]
    dist.all_gather(pieces, input_, group=group)
    return torch.cat(pieces, dim=0)


def _reduce_scatter_dim0(input_: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return input_
    input_ = input_.contiguous()
    if not _is_gloo(group):
        output = input_.new_empty((input_.shape[0] // size,) + tuple(input_.shape[1:]))
        _reduce_scatter_single(output, input_, group=group)
        return output
    summed = input_.clone()
    dist.all_reduce(summed, group=group)
    return summed.chunk(size, dim=0)[group_rank(group)].contiguous()


class _AllGatherAlongDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, dim, group):
        ctx.dim, ctx.group = dim, group
        moved = input_.movedim(dim, 0)  # [.., n, ..] -> [n, ..]
        return _all_gather_dim0(moved, group).movedim(0, dim)  # [cp*n, ..] -> [.., cp*n, ..]

    @staticmethod
    def backward(ctx, grad):
        moved = grad.movedim(ctx.dim, 0)  # [.., cp*n, ..] -> [cp*n, ..]
        return _reduce_scatter_dim0(moved, ctx.group).movedim(0, ctx.dim), None, None


def all_gather_along_dim(input_: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every CP rank's `input_` along `dim` in rank order.

    Forward: all-gather along `dim`; backward: reduce-scatter along `dim` (each rank keeps the gradient sum
    of its own slice)."""
    if group_size(group) == 1:
        return input_
    return _AllGatherAlongDim.apply(input_, dim, group)


def _all_to_all_dim0(input_: torch.Tensor, group) -> torch.Tensor:
    output = torch.empty_like(input_)
    dist.all_to_all_single(output, input_.contiguous(), group=group)
    return output


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    s, b, n, d = x.shape
    x = x.view(s, b, size, n // size, d).permute(2, 0, 1, 3, 4)  # [s, b, n, d] -> [cp, s, b, n/cp, d]
    x = _all_to_all_dim0(x.contiguous(), group)
    return x.reshape(size * s, b, n // size, d)  # [cp, s, b, n/cp, d] -> [cp*s, b, n/cp, d]


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    s_all, b, n, d = x.shape
    x = x.view(size, s_all // size, b, n, d)  # [cp*s, b, n/cp, d] -> [cp, s, b, n/cp, d]
    x = _all_to_all_dim0(x.contiguous(), group)
    return x.permute(1, 2, 0, 3, 4).reshape(s_all // size, b, size * n, d)  # [cp, s, b, n/cp, d] -> [s, b, n, d]


class _AllToAllSeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _seq_to_heads(input_, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


class _AllToAllHeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _heads_to_seq(input_, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


def all_to_all_seq_to_heads(input_: torch.Tensor, group) -> torch.Tensor:
    """[s, b, n, d] sequence shards -> [cp*s, b, n/cp, d]: every rank's tokens (in rank order) for this
    rank's contiguous slice of the heads (Ulysses).

    Forward: all-to-all (heads scattered, sequence gathered); backward: the inverse all-to-all."""
    if group_size(group) == 1:
        return input_
    return _AllToAllSeqToHeads.apply(input_, group)


def all_to_all_heads_to_seq(input_: torch.Tensor, group) -> torch.Tensor:
    """[cp*s, b, n/cp, d] -> [s, b, n, d]: the inverse of `all_to_all_seq_to_heads`.

    Forward: all-to-all (sequence scattered, heads gathered); backward: the inverse all-to-all."""
    if group_size(group) == 1:
        return input_
    return _AllToAllHeadsToSeq.apply(input_, group)


__all__ = [
    "RingTransfer",
    "all_gather_along_dim",
    "all_to_all_heads_to_seq",
    "all_to_all_seq_to_heads",
    "group_rank",
    "group_ranks",
    "group_size",
    "ring_send_recv",
]
