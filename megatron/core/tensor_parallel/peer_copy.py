"""The copy-engine transport of the `--tp-comm-overlap` pipelines (`tensor_parallel.overlap`).

The pipelines move sequence chunks between the tensor-parallel ranks. `mappings.ring_exchange_async` moves
them with point-to-point sends over the TP group's backend (NCCL or gloo); this module moves them with
copy-engine peer copies out of torch's symmetric memory, which take no SMs from the GEMMs beside them.
Which of the two a layer uses is a decision of the optimisation plan (`--tp-comm-overlap-transport`,
`megatron.core.optimization_plan`); `peer_copy_transport` only says where a copy-engine transport cannot
exist (CPU tensors, gloo, one rank, inside a compile trace).

Communication module: besides `mappings.py`, the only tensor-parallel module that synchronises ranks
(symmetric-memory rendezvous and barriers).
"""
import weakref
from typing import Optional

import torch

from megatron.core.tensor_parallel.mappings import PendingCollective, _is_gloo, _rank, _resolve, _world_size


class _PeerExchange:
    """One operation of a `PeerCopyTransport` (see there): write `region`, `publish()`, `fetch` from peers,
    `finish()`."""

    def __init__(self, transport, slot: int, shape, dtype):
        self._transport, self._slot, self._shape, self._dtype = transport, slot, tuple(shape), dtype
        self.region = transport._view(transport.rank, slot, self._shape, dtype)
        self._last_event = None

    def publish(self) -> None:
        """Barrier over the group: after it every rank's region of this operation is written."""
        self._transport._handle.barrier(channel=0, timeout_ms=self._transport.barrier_timeout_ms)

    def fetch(self, peer: int, out: torch.Tensor, index: Optional[int] = None) -> torch.cuda.Event:
        """Copy `peer`'s region (or its row `index`) into `out` on the transport's stream (a copy-engine
        peer copy, no SMs); the returned event marks its completion."""
        source = self._transport._view(peer, self._slot, self._shape, self._dtype)
        stream = self._transport.stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out.copy_(source if index is None else source[index])
            self._last_event = torch.cuda.Event()
            self._last_event.record(stream)
        return self._last_event

    def wait_for(self, fetched: torch.cuda.Event) -> None:
        """The current stream waits for one `fetch`."""
        torch.cuda.current_stream().wait_event(fetched)

    def finish(self) -> None:
        """The current stream waits for this operation's fetches, then a barrier: past it no rank reads
        this operation's slot any more."""
        if self not in self._transport._open:
            return
        if self._last_event is not None:
            torch.cuda.current_stream().wait_event(self._last_event)
            self._last_event = None
        self.publish()
        self._transport._open.remove(self)


class PeerCopyTransport:
    """Transfers between the TP ranks of one host by copy-engine peer copies out of symmetric memory.

    NCCL moves data with kernels that occupy SMs, and a GEMM running beside them loses those SMs: on H200
    at TP=2, two half-sequence GEMMs took 0.30 ms alone, 0.54 ms beside a 32 MB NCCL send/recv and 0.36 ms
    beside a copy-engine peer copy of the same 32 MB (`benchmarks/gpu/tp_contention_bench.py`). The
    `--tp-comm-overlap` pipelines (`tensor_parallel.overlap`) therefore move their chunks this way when
    the group's GPUs can map each other's memory.

    Each rank owns two symmetric slots. An operation (`begin`) takes a free slot, writes this rank's
    region of it, `publish`es (a barrier: every rank's region is written), `fetch`es peers' regions on a
    side stream and `finish`es: the current stream waits for the fetches, then a second barrier, after
    which no rank reads the slot any more. So a slot is free again as soon as its operation is finished,
    in whatever order captured CUDA graphs replay the operations; at most two operations are open at once
    (`begin` finishes the older one otherwise). Every rank must run the same operations, with the same
    shapes, in the same order (true of the TP ranks of one model). Not used inside a `torch.compile`
    trace, nor for gloo groups.
    """

    slots = 2
    barrier_timeout_ms = 600_000

    def __init__(self, group, device):
        self.group, self.device = group, device
        self.world_size, self.rank = _world_size(group), _rank(group)
        self.stream = torch.cuda.Stream(device=device)
        self._buffer = self._handle = None
        self._slot_bytes, self._open, self._views = 0, [], {}

    def _allocate(self, slot_bytes: int) -> None:
        # imported here: torch builds without symmetric memory still import this module (CPU CI)
        import torch.distributed._symmetric_memory as symm_mem

        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"--tp-comm-overlap: a transfer of {slot_bytes} bytes needs a larger symmetric buffer (now "
                f"{self._slot_bytes}) while a CUDA graph is being captured. Run one step without graphs "
                f"first (the default warm-up does) or use --tp-comm-overlap-transport p2p.")
        torch.cuda.synchronize(self.device)  # no peer reads the old buffer any more after the rendezvous
        self._slot_bytes = -(-slot_bytes // (1 << 21)) * (1 << 21)  # whole 2 MiB
        self._buffer = symm_mem.empty(self.slots * self._slot_bytes, dtype=torch.uint8, device=self.device)
        self._handle = symm_mem.rendezvous(self._buffer, self.group)
        self._views = {}

    def _view(self, rank: int, slot: int, shape, dtype) -> torch.Tensor:
        key = (rank, slot, shape, dtype)
        if key not in self._views:
            offset = slot * self._slot_bytes // dtype.itemsize
            self._views[key] = self._handle.get_buffer(rank, shape, dtype, offset)
        return self._views[key]

    def begin(self, shape, dtype) -> _PeerExchange:
        """Start an operation whose region on every rank has `shape` and `dtype`."""
        while len(self._open) >= self.slots:
            self._open[0].finish()
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if nbytes > self._slot_bytes:
            for exchange in list(self._open):
                exchange.finish()
            self._allocate(nbytes)
        busy = {exchange._slot for exchange in self._open}
        exchange = _PeerExchange(self, next(slot for slot in range(self.slots) if slot not in busy), shape, dtype)
        self._open.append(exchange)
        return exchange

    def all_gather_async(self, input_: torch.Tensor) -> PendingCollective:
        """[c, ...] -> [c * world, ...] along dim 0 (no autograd); `.wait()` gives the gathered tensor."""
        input_ = input_.contiguous()
        chunk = input_.shape[0]
        exchange = self.begin(input_.shape, input_.dtype)
        exchange.region.copy_(input_)
        exchange.publish()
        # [c, ...] -> [c * world, ...]
        output = input_.new_empty((chunk * self.world_size,) + tuple(input_.shape[1:]))
        for step in range(1, self.world_size):
            peer = (self.rank + step) % self.world_size
            exchange.fetch(peer, output[peer * chunk:(peer + 1) * chunk])
        output[self.rank * chunk:(self.rank + 1) * chunk].copy_(input_)

        def finish():
            exchange.finish()
            return output
        return PendingCollective(None, finish)


_PEER_TRANSPORTS = weakref.WeakKeyDictionary()


def peer_copy_transport(group, device: torch.device) -> Optional[PeerCopyTransport]:
    """The copy-engine transport of `group` (default: the TP group; created on first use, a collective call),
    or None where one cannot work: CPU tensors, gloo groups, one rank, inside a compile trace (the caller then
    moves the chunks over `mappings.ring_exchange_async`). It needs every rank of the group on one host (GPUs
    that map each other's memory), which the default rank order gives TP groups of up to one node's GPUs; a
    TP group across hosts needs `--tp-comm-overlap-transport p2p` (not detected)."""
    if torch.compiler.is_compiling():
        return None
    group = _resolve(group)
    if group in _PEER_TRANSPORTS:
        return _PEER_TRANSPORTS[group]
    if device.type != "cuda" or _world_size(group) == 1 or _is_gloo(group):
        return None
    _PEER_TRANSPORTS[group] = PeerCopyTransport(group, device)
    return _PEER_TRANSPORTS[group]


__all__ = ["PeerCopyTransport", "peer_copy_transport"]
