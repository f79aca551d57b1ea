"""Sequence-parallel GEMMs pipelined with their communication (`--tp-comm-overlap`), without Transformer Engine.

With sequence parallelism a column-parallel linear all-gathers its input along the sequence before the
GEMM, and a row-parallel linear reduce-scatters its output after it; done as one collective and one GEMM,
neither overlaps the other. Here both are split into one GEMM per sequence chunk (one chunk per TP rank)
and the chunks travel around the TP ring while the GEMMs run:

- all-gather + GEMM: each step multiplies the chunk at hand (first this rank's own) into its rows of the
  output while the next chunk arrives from the previous rank;
- GEMM + reduce-scatter: at step k, rank r computes its partial product for chunk (r - k - 1) mod tp, adds
  the running sum received from the previous rank and passes it on; after tp steps it holds the full sum
  of its own chunk.

The results equal the plain collectives' (the two-rank sums are the same additions; with more ranks the
partial sums are added in ring order). Backward (`tensor_parallel.layers`): the row-parallel linear's
output-gradient all-gather runs as the all-gather + GEMM pipeline of its input-gradient GEMM, keeping the
gathered gradient for the weight gradient. Used when `config.tp_comm_overlap` is set with sequence
parallelism (`tp_comm_overlap_ag` / `tp_comm_overlap_rs` pick the column-parallel forward and backward /
the row-parallel forward and backward).

Transport. With `peer_copy=True` (the plan's `--tp-comm-overlap-transport copy-engine`) and where
`peer_copy.peer_copy_transport` gives one (CUDA tensors on an NCCL group; the TP ranks of a host) the chunks
move by copy-engine peer copies out of symmetric memory, which take no SMs from the GEMMs beside them:
all-gather + GEMM publishes this rank's chunk and runs its GEMM while the peers' chunks are copied here;
GEMM + reduce-scatter computes the partial products for the other ranks first, publishes them and runs its
own chunk's GEMM while the peers' partial sums for it are copied here
(`matmul_reduce_scatter_async` lets a weight-gradient GEMM overlap them too). Elsewhere the chunks travel
the point-to-point ring of `mappings.ring_exchange_async`. This module only schedules GEMMs around the
transfers.
"""
from typing import Optional

import torch

from megatron.core.tensor_parallel.mappings import PendingCollective, _rank, _world_size, ring_exchange_async
from megatron.core.tensor_parallel.peer_copy import peer_copy_transport


def _matmul_into(out_rows: torch.Tensor, chunk: torch.Tensor, weight: torch.Tensor,
                 bias: Optional[torch.Tensor]) -> None:
    """out_rows [c, b, o] = chunk [c, b, i] @ weight[o, i]^T (+ bias [o]), written in place."""
    # [c, b, i] -> [c*b, i]; [c, b, o] -> [c*b, o]
    chunk_2d, out_2d = chunk.reshape(-1, chunk.shape[-1]), out_rows.view(-1, out_rows.shape[-1])
    if bias is None:
        torch.mm(chunk_2d, weight.t(), out=out_2d)
    else:
        torch.addmm(bias, chunk_2d, weight.t(), out=out_2d)


def all_gather_matmul(input_: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group,
                      return_gathered: bool = False, peer_copy: bool = False):
    """[s/tp, b, i] (this rank's sequence chunk) -> [s, b, o]: the all-gathered input times weight^T (+ bias).

    With `return_gathered` the chunks are received straight into one [s, b, i] buffer, returned second (for
    a weight gradient that needs the all-gathered input). `peer_copy`: move the chunks by copy engine where
    the group allows it (see the module docstring), else over the point-to-point ring."""
    transport = peer_copy_transport(group, input_.device) if peer_copy else None
    if transport is not None:
        return _all_gather_matmul_peer_copy(input_.contiguous(), weight, bias, transport, return_gathered)
    world_size, rank = _world_size(group), _rank(group)
    current = input_.contiguous()
    chunk = current.shape[0]
    output = torch.empty((chunk * world_size,) + tuple(current.shape[1:-1]) + (weight.shape[0],),
                         dtype=current.dtype, device=current.device)
    gathered_out = None
    if return_gathered:
        # [s/tp, b, i] -> [s, b, i], this rank's chunk in place
        gathered_out = current.new_empty((chunk * world_size,) + tuple(current.shape[1:]))
        gathered_out[rank * chunk:(rank + 1) * chunk].copy_(current)
    for step in range(world_size):
        pending = None
        if step < world_size - 1:
            arriving = (rank - step - 1) % world_size
            receive = (torch.empty_like(current) if gathered_out is None
                       else gathered_out[arriving * chunk:(arriving + 1) * chunk])
            pending = ring_exchange_async(current, receive, group)
        owner = (rank - step) % world_size
        _matmul_into(output[owner * chunk:(owner + 1) * chunk], current, weight, bias)
        if pending is not None:
            current = pending.wait()
    return (output, gathered_out) if return_gathered else output


def matmul_reduce_scatter(input_: torch.Tensor, weight: torch.Tensor, group,
                          peer_copy: bool = False) -> torch.Tensor:
    """[s, b, i/tp] -> [s/tp, b, o]: input times weight^T, summed over the TP ranks, this rank's sequence chunk
    (`peer_copy` as in `all_gather_matmul`)."""
    return matmul_reduce_scatter_async(input_, weight, group, peer_copy).wait()


def _matmul_reduce_scatter_ring(input_, weight, group, chunk):
    """`matmul_reduce_scatter` over the point-to-point ring (see the module docstring)."""
    world_size, rank = _world_size(group), _rank(group)
    pending = sent = None
    for step in range(world_size):
        target = (rank - step - 1) % world_size
        partial = torch.empty((chunk,) + tuple(input_.shape[1:-1]) + (weight.shape[0],), dtype=input_.dtype,
                              device=input_.device)
        _matmul_into(partial, input_[target * chunk:(target + 1) * chunk], weight, None)
        if pending is not None:
            partial.add_(pending.wait())
            del sent  # the previous send is complete once its exchange has been waited for
        if step < world_size - 1:
            sent = partial
            pending = ring_exchange_async(sent, torch.empty_like(partial), group)
    return partial


def _all_gather_matmul_peer_copy(input_, weight, bias, transport, return_gathered):
    """`all_gather_matmul` through a `PeerCopyTransport`: every peer's chunk is copied here by the copy
    engine while this rank's own chunk goes through the GEMM; each arrived chunk's GEMM follows."""
    world_size, rank, chunk = transport.world_size, transport.rank, input_.shape[0]
    output = torch.empty((chunk * world_size,) + tuple(input_.shape[1:-1]) + (weight.shape[0],),
                         dtype=input_.dtype, device=input_.device)
    # [s/tp, b, i] -> [s, b, i]
    gathered = input_.new_empty((chunk * world_size,) + tuple(input_.shape[1:])) if return_gathered else None
    exchange = transport.begin(input_.shape, input_.dtype)
    exchange.region.copy_(input_)
    exchange.publish()
    arrivals = []
    for step in range(1, world_size):
        peer = (rank + step) % world_size
        target = torch.empty_like(input_) if gathered is None else gathered[peer * chunk:(peer + 1) * chunk]
        arrivals.append((peer, target, exchange.fetch(peer, target)))
    _matmul_into(output[rank * chunk:(rank + 1) * chunk], input_, weight, bias)
    if gathered is not None:
        gathered[rank * chunk:(rank + 1) * chunk].copy_(input_)
    for peer, target, arrived in arrivals:
        exchange.wait_for(arrived)
        _matmul_into(output[peer * chunk:(peer + 1) * chunk], target, weight, bias)
    exchange.finish()
    return (output, gathered) if return_gathered else output


def matmul_reduce_scatter_async(input_: torch.Tensor, weight: torch.Tensor, group,
                                peer_copy: bool = False) -> PendingCollective:
    """Start `matmul_reduce_scatter`; `.wait()` gives this rank's summed chunk [s/tp, b, o].

    Through a `PeerCopyTransport` the partial products for the other ranks' chunks are computed first,
    straight into this rank's symmetric region, and published; this rank's own partial product follows
    while the peers' partial products for its chunk are copied here; GEMMs queued before `.wait()` (a
    weight gradient) also overlap those copies. Without one it is the point-to-point ring, run to
    completion."""
    world_size = _world_size(group)
    if input_.shape[0] % world_size != 0:
        raise ValueError(f"GEMM + reduce-scatter: sequence length {input_.shape[0]} is not divisible by the TP "
                         f"size {world_size}")
    chunk = input_.shape[0] // world_size
    transport = peer_copy_transport(group, input_.device) if peer_copy else None
    if transport is None:
        result = _matmul_reduce_scatter_ring(input_, weight, group, chunk)
        return PendingCollective(None, lambda: result)
    rank = transport.rank
    shape = (chunk,) + tuple(input_.shape[1:-1]) + (weight.shape[0],)
    # row (target - rank - 1) % tp of this rank's region: its partial product for rank `target`'s chunk
    exchange = transport.begin((world_size - 1,) + shape, input_.dtype)
    for step in range(1, world_size):
        target = (rank + step) % world_size
        _matmul_into(exchange.region[step - 1], input_[target * chunk:(target + 1) * chunk], weight, None)
    exchange.publish()
    received = input_.new_empty((world_size - 1,) + shape)
    for step in range(1, world_size):
        peer = (rank + step) % world_size
        exchange.fetch(peer, received[step - 1], index=(rank - peer - 1) % world_size)
    own = input_.new_empty(shape)
    _matmul_into(own, input_[rank * chunk:(rank + 1) * chunk], weight, None)

    def finish():
        exchange.finish()
        for row in received:
            own.add_(row)
        return own
    return PendingCollective(None, finish)


__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_reduce_scatter_async"]
