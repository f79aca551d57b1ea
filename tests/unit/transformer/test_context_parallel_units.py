"""Context parallelism and document masking, one process: the pieces the multi-rank parity test relies on.

- the CP chunk assignment against Megatron's rule (written out here), for plain rows, the attention mask's
  query axis and packed (THD) rows, and the RoPE positions of packed rows under CP;
- document masks (from EOD tokens, through cumulative lengths) against the dataset's dense mask;
- the online-softmax merge against one softmax over all keys (blocks in any order, rows with no key);
- the math backward (the CPU path and oracle) against autograd, with GQA and dropout;
- the FlashAttention varlen plans (the GPU path) cover exactly the allowed (query, key) pairs, once each,
  for every CP layout, and their gather / merge / scatter is exact with an emulated kernel;
- per-layer --cp-comm-type lists and the CP command-line rules.
"""
import math

import pytest
import torch

from megatron.core.context_parallel import kernels
from megatron.core.context_parallel.layout import (
    SequenceLayout,
    allowed_mask,
    document_keys_from_cu_seqlens,
    load_balanced_indices,
    thd_partitioned_indices,
    thd_positions,
)


def _megatron_chunks(seq_len, cp, rank):
    """Megatron's rule: 2*CP chunks, rank r keeps chunks r and 2*CP-1-r in that order."""
    size = seq_len // (2 * cp)
    return [t for c in (rank, 2 * cp - 1 - rank) for t in range(c * size, (c + 1) * size)]


@pytest.mark.parametrize("seq_len,cp", [(8, 2), (16, 2), (32, 4), (24, 3)])
def test_chunk_assignment_follows_megatrons_rule(monkeypatch, seq_len, cp):
    from megatron.core.context_parallel import batch as batch_module
    from megatron.core.utils import get_batch_on_this_cp_rank

    assert [load_balanced_indices(8, 2, r).tolist() for r in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]  # spec §4.1
    for rank in range(cp):
        expected = _megatron_chunks(seq_len, cp, rank)
        assert load_balanced_indices(seq_len, cp, rank).tolist() == expected
        monkeypatch.setattr(batch_module.parallel_state, "get_context_parallel_world_size", lambda: cp)
        monkeypatch.setattr(batch_module.parallel_state, "get_context_parallel_rank", lambda: rank)
        tokens = torch.arange(2 * seq_len).view(2, seq_len)
        mask = torch.arange(seq_len * seq_len).view(1, 1, seq_len, seq_len)
        split = get_batch_on_this_cp_rank({"tokens": tokens.clone(), "attention_mask": mask.clone(), "x": None})
        assert torch.equal(split["tokens"], tokens[:, expected])
        assert torch.equal(split["attention_mask"], mask[:, :, expected])  # query axis only
        assert split["x"] is None
    with pytest.raises(ValueError, match="divisible by 2 x context-parallel size"):
        load_balanced_indices(10, 2, 0)


def test_thd_split_and_rope_positions_per_sequence():
    lengths, cp = [8, 16, 4], 2
    cu = torch.tensor([0, 8, 24, 28])
    held = [thd_partitioned_indices(cu, 28, cp, r).tolist() for r in range(cp)]
    for rank in range(cp):
        expected, positions = [], []
        for start, length in zip(cu[:-1].tolist(), lengths):
            c = length // (2 * cp)
            expected += [start + p for p in range(rank * c, (rank + 1) * c)]
            expected += [start + p for p in range(length - (rank + 1) * c, length - rank * c)]
            # Megatron's RoPE rule for packed rows under CP: [r*c, (r+1)*c) and [L-(r+1)*c, L-r*c)
            positions += list(range(rank * c, (rank + 1) * c)) + list(range(length - (rank + 1) * c, length - rank * c))
        assert held[rank] == expected
        assert thd_positions(torch.tensor(held[rank]), cu).tolist() == positions
    assert sorted(held[0] + held[1]) == list(range(28))


def _dataset_mask(tokens, eod):
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    return torch.stack([_get_ltor_masks_and_position_ids(row, eod, False, True, False, True)[0][0] for row in tokens])


def test_document_masks_match_the_dataset_mask():
    from megatron.training.utils import document_ids_from_tokens, document_packed_seq_params

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 50, (3, 24), generator=g)
    tokens[0, [0, 5, 6, 23]] = 0
    tokens[1, 11] = 0
    docs = document_ids_from_tokens(tokens, 0)
    params = document_packed_seq_params(docs)
    assert params.qkv_format == "sbhd" and params.cu_seqlens_q[-1] == 72
    assert params.max_seqlen_q == 24  # row 2 has no EOD
    keys = document_keys_from_cu_seqlens(params.cu_seqlens_q, 3, 24, "cpu")
    for cp in (1, 2, 3):
        layout = SequenceLayout(24, 3, cp, "cpu", doc_keys=keys)
        for q_rank in range(cp):
            for k_rank in range(cp):
                q, k = layout.group([q_rank]), layout.group([k_rank])
                want = ~_dataset_mask(tokens, 0)[:, q.index][:, :, k.index]
                assert torch.equal(allowed_mask(q, k).expand_as(want), want)


def _softmax_reference(q, k, v, allowed, scale):
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("bhqk,kbhd->qbhd", torch.softmax(scores, -1), v), torch.logsumexp(scores, -1)


def test_online_softmax_merge_equals_full_softmax():
    g = torch.Generator().manual_seed(1)
    n, b, h, d = 12, 2, 3, 4
    q, k, v = (torch.randn(n, b, h, d, generator=g, dtype=torch.float64) for _ in range(3))
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))[None].expand(b, n, n).clone()
    allowed[1, :, :] = allowed[1] & (torch.arange(n)[:, None] // 5 == torch.arange(n)[None] // 5)
    ref_out, ref_lse = _softmax_reference(q, k, v, allowed, 0.5)
    blocks = [torch.tensor([7, 8, 9, 10, 11]), torch.tensor([0, 1]), torch.tensor([2, 3, 4, 5, 6])]
    out = lse = None
    for keys in blocks:  # later keys first; block [7..11] leaves the first rows with no key at all
        plan = kernels.MathPlan(allowed[:, :, keys], b)
        part, part_lse, _ = kernels.math_forward(q.reshape(n * b, h, d), k[keys].reshape(-1, h, d),
                                                 v[keys].reshape(-1, h, d), plan, 0.5)
        assert torch.isneginf(part_lse.view(n, b, h)[0]).all() if keys[0] == 7 else True
        out, lse = (part, part_lse) if out is None else kernels.merge_partial(out, lse, part, part_lse)
    assert torch.allclose(out.view(n, b, h, d), ref_out, atol=1e-12)
    assert torch.allclose(lse.view(n, b, h), ref_lse.permute(2, 0, 1), atol=1e-12)


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_math_backward_is_the_gradient_of_the_math_forward(dropout_p):
    g = torch.Generator().manual_seed(2)
    nq, nk, b, h, groups, d = 6, 9, 2, 4, 2, 5
    q = torch.randn(nq * b, h, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(nk * b, groups, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(nk * b, groups, d, generator=g, dtype=torch.float64, requires_grad=True)
    allowed = torch.rand(b, nq, nk, generator=g) > 0.4
    allowed[:, :, 0] = True
    plan = kernels.MathPlan(allowed, b)
    torch.manual_seed(3)
    out, lse, keep = kernels.math_forward(q, k, v, plan, 0.7, dropout_p)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad(out, (q, k, v), dout)
    got = kernels.math_backward(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, plan, 0.7, dropout_p,
                                keep)
    for w, x in zip(want, got):
        assert torch.allclose(w, x, atol=1e-12)


def _layouts():
    keys = document_keys_from_cu_seqlens(torch.tensor([0, 5, 6, 19, 32, 40, 64]), 2, 32, "cpu")
    cu_thd = torch.tensor([0, 8, 24, 32])
    for cp in (2, 4):
        yield f"plain-cp{cp}", SequenceLayout(32, 2, cp, "cpu")
        yield f"docs-cp{cp}", SequenceLayout(32, 2, cp, "cpu", doc_keys=keys)
        thd_keys = document_keys_from_cu_seqlens(cu_thd, 1, 32, "cpu")
        yield f"thd-cp{cp}", SequenceLayout(32, 1, cp, "cpu", doc_keys=thd_keys, cu_seqlens_padded=cu_thd)


def _pairs(layout):
    """(query ranks, key ranks) of every block pair the CP algorithms build plans for."""
    cp = layout.cp_size
    pairs = [([r], [s]) for r in range(cp) for s in range(cp)]  # p2p ring steps
    pairs += [([r], list(range(cp))) for r in range(cp)]  # all_gather
    pairs += [(list(range(cp)), list(range(cp)))]  # a2a
    if cp == 4:  # a2a+p2p with levels [2, 2]
        pairs += [(a, b) for a in ([0, 1], [2, 3]) for b in ([0, 1], [2, 3])]
    return pairs


@pytest.mark.parametrize("name,layout", list(_layouts()))
def test_varlen_plans_cover_exactly_the_allowed_pairs(name, layout):
    b = layout.batch
    for q_ranks, k_ranks in _pairs(layout):
        q, k = layout.group(q_ranks), layout.group(k_ranks)
        covered = torch.zeros(b, q.index.numel(), k.index.numel(), dtype=torch.int64)
        for call in kernels.varlen_plan(q, k, b):
            for seg in range(call.cu_q.numel() - 1):
                rows = call.q_index[call.cu_q[seg]:call.cu_q[seg + 1]]
                cols = call.k_index[call.cu_k[seg]:call.cu_k[seg + 1]]
                assert call.max_q >= rows.numel() and call.max_k >= cols.numel()
                if call.causal:
                    assert torch.equal(q.index[rows // b], k.index[cols // b])
                for i, row in enumerate(rows.tolist()):
                    for j, col in enumerate(cols.tolist()):
                        if not call.causal or j <= i:
                            assert row % b == col % b, "a segment mixes batch rows"
                            covered[row % b, row // b, col // b] += 1
        want = allowed_mask(q, k).expand(b, -1, -1).to(torch.int64)
        assert torch.equal(covered, want), (name, q_ranks, k_ranks)


def test_whole_sequence_plan_reads_one_row_in_place():
    """One row of packed documents without CP: one causal call over tokens 0..s-1 (taken without gather or
    scatter); with two rows the flat [s*b] tokens of a document interleave, so the call gathers."""
    for b, in_order in ((1, True), (2, False)):
        keys = document_keys_from_cu_seqlens(torch.tensor([0, 5, 6, 19, 32, 40, 64])[: 2 + 3 * b], b, 32, "cpu")
        layout = SequenceLayout(32, b, 1, "cpu", doc_keys=keys)
        calls = kernels.varlen_plan(layout.group([0]), layout.group([0]), b)
        assert len(calls) == 1 and calls[0].causal and calls[0].in_order is in_order
        assert calls[0].cu_q.tolist()[-1] == 32 * b


def _emulated_flash_forward(q, k, v, call, scale, dropout_p):
    out, lse = torch.zeros_like(q), torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=q.dtype)
    for seg in range(call.cu_q.numel() - 1):
        qs, ks = slice(call.cu_q[seg], call.cu_q[seg + 1]), slice(call.cu_k[seg], call.cu_k[seg + 1])
        allowed = torch.ones(qs.stop - qs.start, ks.stop - ks.start, dtype=torch.bool)
        if call.causal:
            allowed = torch.tril(allowed)
        o, l = _softmax_reference(q[qs][:, None], k[ks][:, None].repeat_interleave(q.shape[1] // k.shape[1], 2),
                                  v[ks][:, None].repeat_interleave(q.shape[1] // k.shape[1], 2), allowed[None], scale)
        out[qs], lse[:, qs] = o[:, 0], l[0]
    return out, lse, torch.zeros(2), torch.empty(0), None


def _emulated_flash_backward(dout, q, k, v, out, lse, call, scale, dropout_p, rng_state, unused):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    rep = q.shape[1] // k.shape[1]
    for seg in range(call.cu_q.numel() - 1):
        qs, ks = slice(call.cu_q[seg], call.cu_q[seg + 1]), slice(call.cu_k[seg], call.cu_k[seg + 1])
        nq, nk = qs.stop - qs.start, ks.stop - ks.start
        allowed = torch.tril(torch.ones(nq, nk, dtype=torch.bool)) if call.causal else torch.ones(nq, nk, dtype=torch.bool)
        plan = kernels.MathPlan(allowed[None], 1)
        grads = kernels.math_backward(dout[qs], q[qs], k[ks], v[ks], out[qs], lse[:, qs].t(), plan, scale, 0.0, None)
        dq[qs], dk[ks], dv[ks] = grads[0], grads[1], grads[2]
    assert rep >= 1
    return dq, dk, dv


def test_varlen_path_matches_math_path_with_an_emulated_kernel(monkeypatch):
    monkeypatch.setattr(kernels, "_flash_varlen_forward", _emulated_flash_forward)
    monkeypatch.setattr(kernels, "_flash_varlen_backward", _emulated_flash_backward)
    g = torch.Generator().manual_seed(4)
    for name, layout in _layouts():
        b, h, groups, d = layout.batch, 4, 2, 3
        for q_ranks, k_ranks in _pairs(layout)[:6]:
            q_group, k_group = layout.group(q_ranks), layout.group(k_ranks)
            q = torch.randn(q_group.index.numel() * b, h, d, generator=g, dtype=torch.float64)
            k, v = (torch.randn(k_group.index.numel() * b, groups, d, generator=g, dtype=torch.float64)
                    for _ in range(2))
            results = []
            for backend in ("math", "flash_varlen"):
                kernel = kernels.BlockKernel(backend)
                plan = kernel.plan(q_group, k_group, b)
                out, lse, state = kernel.forward(q, k, v, plan, 0.4, 0.0)
                dout = torch.ones_like(out)
                results.append((out, lse, *kernel.backward(dout, q, k, v, out, lse, plan, 0.4, 0.0, state)))
            for want, got in zip(*results):
                finite = torch.isfinite(want)
                assert torch.equal(finite, torch.isfinite(got)), name
                assert torch.allclose(want[finite], got[finite], atol=1e-10), (name, q_ranks, k_ranks)


def test_per_layer_cp_comm_type_is_indexed_by_the_one_based_layer_number():
    from megatron.core.transformer.attention import layer_cp_comm_type
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, context_parallel_size=2,
                               cp_comm_type=["a2a", "p2p", "all_gather"])
    assert [layer_cp_comm_type(config, n) for n in (1, 2)] == ["p2p", "all_gather"]
    config.cp_comm_type = ["p2p", "a2a"]
    with pytest.raises(ValueError, match="needs num_layers \\+ 1 = 3 entries"):
        layer_cp_comm_type(config, 2)
    config.cp_comm_type, config.context_parallel_size = "a2a", 1
    assert layer_cp_comm_type(config, 1) is None


def test_context_parallel_command_line_rules():
    from megatron.training.arguments import ArgumentsError, _parse, validate_args

    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 64 "
            "--micro-batch-size 2 --train-iters 10").split()

    def problems(extra, world_size):
        args = _parse(base + extra.split())
        args.world_size, args.rank = world_size, 1
        with pytest.raises(ArgumentsError) as err:
            validate_args(args)
        return "\n".join(err.value.problems)

    text = problems("--seq-length 36 --context-parallel-size 4 --cp-comm-type a2a+p2p allgather", 8)
    for piece in ("--seq-length (36) must be divisible by 2 x --context-parallel-size (8)",
                  "--cp-comm-type allgather: each value must be one of p2p, all_gather, a2a, a2a+p2p",
                  "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes",
                  "--cp-comm-type has 2 values for 2 layers"):
        assert piece in text, text
    text = problems("--seq-length 32 --context-parallel-size 8 --cp-comm-type a2a "
                    "--hierarchical-context-parallel-sizes 2 2", 8)
    assert "must multiply to --context-parallel-size (8)" in text
    assert "the 4 attention heads per tensor-parallel rank" in text and "all-to-all size (8)" in text
    args = _parse(base + "--seq-length 32 --context-parallel-size 2 --cp-comm-type p2p".split())
    args.world_size, args.rank = 4, 1
    validated = validate_args(args)
    assert validated.data_parallel_size == 2 and math.prod([validated.context_parallel_size]) == 2


def test_probe_accepts_a_correct_kernel_and_rejects_a_wrong_one(monkeypatch):
    monkeypatch.setattr(kernels, "_flash_varlen_forward", _emulated_flash_forward)
    monkeypatch.setattr(kernels, "_flash_varlen_backward", _emulated_flash_backward)
    assert kernels._probe_flash_varlen("cpu", torch.float64, 16, 4, 2) is None

    def off_by_a_factor(*args):
        out, *rest = _emulated_flash_forward(*args)
        return (out * 1.5, *rest)
    monkeypatch.setattr(kernels, "_flash_varlen_forward", off_by_a_factor)
    assert "out differs from the math backend" in kernels._probe_flash_varlen("cpu", torch.float64, 16, 4, 2)


def test_thd_rotary_angles_under_cp_follow_megatrons_helper():
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank
    from megatron.core.transformer.rope_utils import _apply_rotary_pos_emb_thd

    class Group:
        def __init__(self, size, rank):
            self._size, self._rank = size, rank

        def size(self):
            return self._size

        def rank(self):
            return self._rank

    g = torch.Generator().manual_seed(6)
    lengths, cp = [8, 16, 4], 2
    cu = torch.tensor([0, 8, 24, 28])
    freqs = torch.randn(16, 1, 1, 6, generator=g, dtype=torch.float64)
    for rank in range(cp):
        local = torch.randn(28 // cp, 2, 6, generator=g, dtype=torch.float64)
        got = _apply_rotary_pos_emb_thd(local, cu, freqs, cp_group=Group(cp, rank))
        pieces, start = [], 0
        for length in lengths:  # Megatron: per sequence, the local chunks' angles from its helper
            piece = local[start:start + length // cp]
            angles = _get_thd_freqs_on_this_cp_rank(rank, cp, piece, freqs)
            cos, sin = torch.cos(angles)[:, 0], torch.sin(angles)[:, 0]
            rotated = piece * cos + torch.cat([-piece[..., 3:], piece[..., :3]], -1) * sin
            pieces.append(rotated)
            start += length // cp
        assert torch.allclose(got, torch.cat(pieces), atol=1e-12)
