"""GPU checks of the FlashAttention varlen path of context parallelism and document masking (CUDA only).

- the one-time probe accepts the varlen kernels on this GPU (bf16 and fp16, head dims 64 and 128, GQA), so
  the fast path is really taken;
- every block pair the CP algorithms use (p2p ring steps, all_gather, a2a, a2a+p2p; plain rows, documents,
  packed THD rows): output, log-sum-exp and the exact backward of the varlen path against the fp32 math
  path on the same bf16 inputs;
- document-masked attention of a whole sequence (the single-GPU `--reset-attention-mask` path) against
  SDPA with the explicit dense mask, forward and backward, and dropout runs;
- ring attention over NCCL on 2 GPUs (CP=2, all four comm types) against one GPU.

Tolerances are bf16's: errors relative to each tensor's largest entry below 2e-2 (seen on an H200 is
printed); the math path accumulates in fp32 from the same bf16 values.
"""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.core.context_parallel import kernels
from megatron.core.context_parallel.layout import SequenceLayout, document_keys_from_cu_seqlens

pytestmark = pytest.mark.gpu
TOL = 2e-2


def _rel(got, want):
    finite = torch.isfinite(want)
    return ((got.float() - want.float())[finite].abs().max() / want.float()[finite].abs().max().clamp_min(1e-6)).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,heads,groups", [(64, 8, 8), (128, 16, 4)])
def test_probe_accepts_the_varlen_kernels(dtype, head_dim, heads, groups):
    q = torch.zeros(4, heads, head_dim, device="cuda", dtype=dtype)
    k = torch.zeros(4, groups, head_dim, device="cuda", dtype=dtype)
    assert kernels.select_kernel(q, k).name == "flash_varlen"


def _layouts(device):
    seq, b = 1024, 2
    cu = torch.tensor([0, 100, 101, 612, 1024, 1500, 2048])  # documents over the flattened b * s tokens
    thd = torch.tensor([0, 256, 768, 1024])
    for cp in (2, 4):
        yield f"plain-cp{cp}", SequenceLayout(seq, b, cp, device)
        yield f"docs-cp{cp}", SequenceLayout(seq, b, cp, device, doc_keys=document_keys_from_cu_seqlens(
            cu, b, seq, device))
        yield f"thd-cp{cp}", SequenceLayout(seq, 1, cp, device, doc_keys=document_keys_from_cu_seqlens(
            thd, 1, seq, device), cu_seqlens_padded=thd.to(device))


def _pairs(cp):
    pairs = [([0], [s]) for s in range(cp)] + [([cp - 1], [s]) for s in range(cp)]
    pairs += [([1], list(range(cp))), (list(range(cp)), list(range(cp)))]
    if cp == 4:
        pairs += [([0, 1], [2, 3]), ([2, 3], [0, 1]), ([2, 3], [2, 3])]
    return pairs


def test_varlen_block_pairs_match_the_math_path():
    torch.manual_seed(0)
    heads, groups, hn, worst = 8, 2, 128, 0.0
    for name, layout in _layouts("cuda"):
        b = layout.batch
        for q_ranks, k_ranks in _pairs(layout.cp_size):
            q_group, k_group = layout.group(q_ranks), layout.group(k_ranks)
            q = torch.randn(q_group.index.numel() * b, heads, hn, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(k_group.index.numel() * b, groups, hn, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))
            dout = torch.randn_like(q)
            results = []
            for backend in ("math", "flash_varlen"):
                kernel = kernels.BlockKernel(backend)
                plan = kernel.plan(q_group, k_group, b)
                out, lse, state = kernel.forward(q, k, v, plan, hn ** -0.5, 0.0)
                grads = kernel.backward(dout, q, k, v, out.to(q.dtype), lse, plan, hn ** -0.5, 0.0, state)
                results.append((out, lse, *grads))
            for label, want, got in zip(("out", "lse", "dq", "dk", "dv"), *results):
                assert torch.equal(torch.isfinite(want), torch.isfinite(got)), (name, q_ranks, k_ranks, label)
                if torch.isfinite(want).any():
                    err = _rel(got, want)
                    worst = max(worst, err)
                    assert err < TOL, f"{name} {q_ranks}->{k_ranks} {label}: {err:.3e}"
    print(f"worst relative error of the varlen path: {worst:.2e}")


@pytest.mark.parametrize("b", [1, 2])  # b = 1: one in-order kernel call (no gather/scatter); b = 2: gathered rows
def test_document_attention_matches_sdpa_with_the_dense_mask(b):
    from megatron.core.context_parallel.attention import document_attention

    torch.manual_seed(1)
    s, heads, groups, hn = 2048, 16, 4, 128
    cu = torch.tensor([0, 300, 301, 1024, 2048, 2600, 4096])[: 2 + 3 * b]  # documents of the b rows
    keys = document_keys_from_cu_seqlens(cu, b, s, "cuda")
    layout = SequenceLayout(s, b, 1, "cuda", doc_keys=keys)
    make = lambda n: torch.randn(s, b, n, hn, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = make(heads), make(groups), make(groups)
    out = document_attention(q, k, v, layout, [0], hn ** -0.5, 0.0)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    allowed = torch.tril(torch.ones(s, s, dtype=torch.bool, device="cuda"))[None] & (keys[:, :, None] == keys[:, None, :])
    qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [s, b, n, hn] -> [b, n, s, hn]
    ref = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=allowed[:, None], scale=hn ** -0.5,
                                                           enable_gqa=True).permute(2, 0, 1, 3)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    assert _rel(out, ref) < TOL
    for got, want in zip(grads, ref_grads):
        assert _rel(got, want) < TOL
    dropped = document_attention(q, k, v, layout, [0], hn ** -0.5, 0.1)
    torch.autograd.grad(dropped, (q, k, v), dout)
    assert torch.isfinite(dropped).all() and not torch.equal(dropped, out)


def _nccl_worker(rank, world_size, init_file, out_dir):
    from megatron.core import parallel_state as ps
    from megatron.core.context_parallel.attention import context_parallel_attention
    from megatron.core.context_parallel.layout import sequence_layout

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        ps.initialize_model_parallel(context_parallel_size=2, hierarchical_context_parallel_sizes=[2, 1])
        g = torch.Generator().manual_seed(3)
        s, b, heads, groups, hn = 4096, 1, 16, 4, 128
        full = [torch.randn(s, b, n, hn, generator=g).to("cuda", torch.bfloat16) for n in (heads, groups, groups)]
        dout_full = torch.randn(s, b, heads, hn, generator=g).to("cuda", torch.bfloat16)
        layout = sequence_layout(None, s // 2, b, 2, "cuda")
        index = layout.held(rank)
        results = {}
        for comm in ("p2p", "all_gather", "a2a", "a2a+p2p"):
            q, k, v = (t[index].clone().requires_grad_() for t in full)
            out = context_parallel_attention(q, k, v, layout, comm, ps.get_context_parallel_group(),
                                             ps.get_hierarchical_context_parallel_groups(), hn ** -0.5)
            grads = torch.autograd.grad(out, (q, k, v), dout_full[index])
            results[comm] = [t.float().cpu() for t in (out, *grads)]
        torch.save((index.cpu(), results), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_context_parallel_attention_on_nccl_matches_one_gpu():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_nccl_worker, args=(2, os.path.join(tmp, "rendezvous"), tmp), nprocs=2, join=True)
        per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    g = torch.Generator().manual_seed(3)
    s, b, heads, groups, hn = 4096, 1, 16, 4, 128
    full = [torch.randn(s, b, n, hn, generator=g).to("cuda", torch.bfloat16).requires_grad_() for n in
            (heads, groups, groups)]
    dout = torch.randn(s, b, heads, hn, generator=g).to("cuda", torch.bfloat16)
    q, k, v = (t.permute(1, 2, 0, 3) for t in full)  # [s, b, n, hn] -> [b, n, s, hn]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hn ** -0.5,
                                                           enable_gqa=True).permute(2, 0, 1, 3)
    ref_all = [ref, *torch.autograd.grad(ref, full, dout)]
    for comm in ("p2p", "all_gather", "a2a", "a2a+p2p"):
        for label, want in zip(("out", "dq", "dk", "dv"), ref_all):
            got = torch.zeros_like(want, dtype=torch.float32)
            for index, results in per_rank:
                got[index.cuda()] = results[comm][("out", "dq", "dk", "dv").index(label)].cuda()
            assert _rel(got, want) < TOL, (comm, label)
