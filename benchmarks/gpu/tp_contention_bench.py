"""How much do the sequence-parallel transfers slow the GEMMs they overlap? (TP=2, not part of the product.)

  torchrun --nproc-per-node 2 benchmarks/gpu/tp_contention_bench.py

GPT-1.3B shapes (tokens 16384 = seq 2048 x micro-batch 8, hidden 2048, ffn 8192) split over TP=2. Per
linear, rank 0 prints one JSON line of medians (ms):
- `mm_full`: the unsplit GEMM; `mm_chunks`: the same as two half-sequence GEMMs;
- `mm_chunks_nccl_busy` / `mm_chunks_ce_busy`: the two GEMMs while the 32 MB chunk crosses to the peer on a
  side stream, through NCCL send/recv (SM kernels) / a copy-engine peer copy out of symmetric memory;
- `serial`: the plain collective then the GEMM; `ours`: `tensor_parallel.overlap` as the product runs it
  (the copy-engine transport, the plan's `auto` on GPUs since the sixth session; `ours_p2p`: the NCCL ring
  exchange, `--tp-comm-overlap-transport p2p`, which is what the 2026-11-30 15:22 measurement in
  docs/performance.md ran as `ours`);
- `ce`: the standalone prototype of the copy-engine pipeline (symmetric memory + barriers) that the
  transport grew from;
- `nccl_xfer` / `ce_xfer`: the transfer alone.
"""
import json
import os

import torch
import torch.distributed as dist
from collective_bench import timed  # same folder (the script's directory is on sys.path)

from megatron.core.tensor_parallel import overlap
from megatron.core.tensor_parallel.mappings import ring_exchange_async


class PeerCopy:
    """One symmetric buffer per rank; `fetch` copies the peer's buffer here with the copy engine."""

    def __init__(self, numel, group):
        import torch.distributed._symmetric_memory as symm_mem
        self.buffer = symm_mem.empty(numel, dtype=torch.bfloat16, device="cuda")
        self.handle = symm_mem.rendezvous(self.buffer, group)
        self.peer = 1 - dist.get_rank(group)
        self.stream = torch.cuda.Stream()

    def peer_view(self, shape):
        return self.handle.get_buffer(self.peer, shape, torch.bfloat16)

    def local_view(self, shape):
        return self.buffer[:shape.numel()].view(shape)

    def barrier(self):
        self.handle.barrier(channel=0)


def ce_all_gather_matmul(x, weight, peer: PeerCopy):
    """[s/2, b, i] -> [s, b, o] at TP=2: the peer's chunk arrives by copy engine while our chunk's GEMM runs."""
    rank = dist.get_rank()
    chunk = x.shape[0]
    out = torch.empty((2 * chunk,) + tuple(x.shape[1:-1]) + (weight.shape[0],), dtype=x.dtype, device=x.device)
    peer.local_view(x.shape).copy_(x)
    peer.barrier()  # the peer's chunk is in its buffer
    arrived = torch.empty_like(x)
    peer.stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(peer.stream):
        arrived.copy_(peer.peer_view(x.shape))
    own, other = out[rank * chunk:(rank + 1) * chunk], out[(1 - rank) * chunk:(2 - rank) * chunk]
    torch.mm(x.view(-1, x.shape[-1]), weight.t(), out=own.view(-1, own.shape[-1]))
    torch.cuda.current_stream().wait_stream(peer.stream)
    torch.mm(arrived.view(-1, x.shape[-1]), weight.t(), out=other.view(-1, other.shape[-1]))
    peer.barrier()  # the peer has read our buffer
    return out


def ce_matmul_reduce_scatter(x, weight, peer: PeerCopy):
    """[s, b, i/2] -> [s/2, b, o] at TP=2: the partial sum for the peer's chunk first, fetched by it while
    our own chunk's GEMM runs."""
    rank = dist.get_rank()
    chunk = x.shape[0] // 2
    shape = torch.Size((chunk,) + tuple(x.shape[1:-1]) + (weight.shape[0],))
    theirs = peer.local_view(shape)
    torch.mm(x[(1 - rank) * chunk:(2 - rank) * chunk].reshape(-1, x.shape[-1]), weight.t(),
             out=theirs.view(-1, shape[-1]))
    peer.barrier()  # both partial sums for the other rank are written
    arrived = torch.empty(shape, dtype=x.dtype, device=x.device)
    peer.stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(peer.stream):
        arrived.copy_(peer.peer_view(shape))
    mine = torch.mm(x[rank * chunk:(rank + 1) * chunk].reshape(-1, x.shape[-1]), weight.t()).view(shape)
    torch.cuda.current_stream().wait_stream(peer.stream)
    mine.add_(arrived)
    peer.barrier()
    return mine


def busy(gemms, transfer):
    """Run `transfer` on a side stream while `gemms` run on the current one."""
    side = torch.cuda.Stream()

    def run():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            transfer()
        gemms()
        torch.cuda.current_stream().wait_stream(side)
    return run


def main():
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank, group = dist.get_rank(), dist.group.WORLD
    seq, batch, hidden = 2048, 8, 2048
    peer = PeerCopy(seq // 2 * batch * 4 * hidden, group)
    torch.manual_seed(rank)
    chunk_x = torch.randn(seq // 2, batch, hidden, device="cuda", dtype=torch.bfloat16)
    recv = torch.empty_like(chunk_x)
    dst = torch.empty_like(chunk_x)

    def nccl_xfer():
        ring_exchange_async(chunk_x, recv, group).wait()

    def ce_xfer():
        dst.copy_(peer.peer_view(chunk_x.shape))

    rows = [dict(case="transfer 32 MB", nccl_xfer=timed(nccl_xfer), ce_xfer=timed(ce_xfer))]
    for name, (in_f, out_f, kind) in {"qkv": (hidden, 3 * hidden // 2, "ag"), "fc1": (hidden, 2 * hidden, "ag"),
                                      "proj": (hidden // 2, hidden, "rs"), "fc2": (2 * hidden, hidden, "rs")}.items():
        weight = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02
        full = torch.randn(seq * batch, in_f, device="cuda", dtype=torch.bfloat16)
        halves = full.view(2, -1, in_f)

        def chunks():
            for half in halves:
                torch.mm(half, weight.t())

        row = dict(case=name, mm_full=timed(lambda: torch.mm(full, weight.t())), mm_chunks=timed(chunks),
                   mm_chunks_nccl_busy=timed(busy(chunks, nccl_xfer)), mm_chunks_ce_busy=timed(busy(chunks, ce_xfer)))
        if kind == "ag":
            x = torch.randn(seq // 2, batch, in_f, device="cuda", dtype=torch.bfloat16)
            gathered = torch.empty(seq, batch, in_f, device="cuda", dtype=torch.bfloat16)

            def serial():
                dist.all_gather_into_tensor(gathered, x, group=group)
                return torch.matmul(gathered, weight.t())
            ours = lambda: overlap.all_gather_matmul(x, weight, None, group, peer_copy=True)  # noqa: E731
            ours_p2p = lambda: overlap.all_gather_matmul(x, weight, None, group)  # noqa: E731
            ce = lambda: ce_all_gather_matmul(x, weight, peer)  # noqa: E731
        else:
            x = torch.randn(seq, batch, in_f, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(seq // 2, batch, hidden, device="cuda", dtype=torch.bfloat16)

            def serial():
                dist.reduce_scatter_tensor(out, torch.matmul(x, weight.t()), group=group)
                return out
            ours = lambda: overlap.matmul_reduce_scatter(x, weight, group, peer_copy=True)  # noqa: E731
            ours_p2p = lambda: overlap.matmul_reduce_scatter(x, weight, group)  # noqa: E731
            ce = lambda: ce_matmul_reduce_scatter(x, weight, peer)  # noqa: E731
        reference = serial().clone()
        row.update(serial=timed(serial), ours=timed(ours), ours_p2p=timed(ours_p2p), ce=timed(ce),
                   ce_max_diff=(ce() - reference).abs().max().item(),
                   ours_max_diff=(ours() - reference).abs().max().item())
        rows.append(row)
    if rank == 0:
        for row in rows:
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
