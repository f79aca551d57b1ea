"""Tensor-parallel layers, mappings, cross-entropy, broadcast, RNG tracker and recompute on 4 gloo ranks.

One launch runs every check at TP=4 and again at TP=2 (x DP=2). Each TP result is compared with a
single-device computation built from the same full tensors (fp32, atol 1e-5: only summation order
differs).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.harness import run_on_ranks

ATOL = 1e-5


def _close(a, b, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= ATOL, f"{what}: max abs error {err}"


def _chunk(t, dim, rank, n):
    return t.chunk(n, dim=dim)[rank].contiguous()


def _config(**kw):
    from megatron.core.model_parallel_config import ModelParallelConfig

    kw.setdefault("use_cpu_initialization", True)
    kw.setdefault("tensor_model_parallel_size", dist.get_world_size(_tp_group()))
    return ModelParallelConfig(**kw)


def _tp_group():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()


def _full_weight(seed, out, inp, init):
    torch.manual_seed(seed)
    w = torch.empty(out, inp, device="cpu")  # CPU init draws from the CPU generator on every device
    init(w)
    return w.to(torch.get_default_device())


def _dev(module):
    """Move a layer to the default device (CPU here; CUDA in the GPU variant of this test)."""
    return module.to(torch.get_default_device())


def _check_column(tp, r):
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.utils import init_method_normal

    init = init_method_normal(0.5)
    s, b, hin, hout = 8, 2, 8, 16
    torch.manual_seed(1)
    x, g = torch.randn(s, b, hin), torch.randn(s, b, hout)
    for sp, gather, skip in [(False, False, False), (False, True, False), (False, False, True), (True, False, False)]:
        w_full = _full_weight(7, hout, hin, init)
        ref_w = w_full.clone().requires_grad_()
        ref_b = torch.randn(hout).requires_grad_()
        ref_x = x.clone().requires_grad_()
        ref_y = F.linear(ref_x, ref_w, None if skip else ref_b)
        (ref_y * g).sum().backward()
        torch.manual_seed(7)
        layer = _dev(ColumnParallelLinear(hin, hout, config=_config(sequence_parallel=sp), init_method=init,
                                          bias=True, gather_output=gather, skip_bias_add=skip))
        assert layer.weight.partition_dim == 0 and layer.weight.tensor_model_parallel
        _check_sharded_state_dict(layer, {"weight": 0, "bias": 0}, r, tp)
        _close(layer.weight.data, _chunk(w_full, 0, r, tp), "column weight init")
        with torch.no_grad():
            layer.bias.copy_(_chunk(ref_b.detach(), 0, r, tp))
        inp = (_chunk(x, 0, r, tp) if sp else x.clone()).requires_grad_()
        y, bias_out = layer(inp)
        expect_y = ref_y.detach() if gather else _chunk(ref_y.detach(), 2, r, tp)
        _close(y, expect_y, f"column forward sp={sp} gather={gather} skip={skip}")
        assert (bias_out is layer.bias) if skip else bias_out is None
        (y * (g if gather else _chunk(g, 2, r, tp))).sum().backward()
        _close(inp.grad, _chunk(ref_x.grad, 0, r, tp) if sp else ref_x.grad, f"column dgrad sp={sp}")
        _close(layer.weight.grad, _chunk(ref_w.grad, 0, r, tp), "column wgrad")
        if not skip:
            _close(layer.bias.grad, _chunk(ref_b.grad, 0, r, tp), "column bias grad")


def _check_sharded_state_dict(layer, tp_axes, r, tp):
    """torch_dist layout: TP-split tensors get a TP offset on their split axis, others are TP replicas."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    dp = ps.get_data_parallel_rank(with_context_parallel=True)
    sharded = layer.sharded_state_dict(prefix="layer.", sharded_offsets=((0, 1, 3),))  # e.g. a stacked-layer axis
    for name, tensor in layer.state_dict(keep_vars=True).items():
        item = sharded[f"layer.{name}"]
        if name.endswith("_extra_state"):
            assert isinstance(item, ShardedObject) and item.global_shape == (3,) and item.global_offset == (1,)
            continue
        assert item.data is tensor and item.prepend_axis_num == 1
        global_shape, offset = [3] + list(tensor.shape), [1] + [0] * tensor.dim()
        if name in tp_axes:
            global_shape[1 + tp_axes[name]] *= tp
            offset[1 + tp_axes[name]] = r * tensor.shape[tp_axes[name]]
            assert item.replica_id == (0, 0, dp)
        else:
            assert item.replica_id == (0, r, dp)
        assert item.global_shape == tuple(global_shape) and item.global_offset == tuple(offset), name
    return sharded


def _check_row(tp, r):
    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.utils import init_method_normal

    init = init_method_normal(0.5)
    s, b, hin, hout = 8, 2, 16, 8
    torch.manual_seed(2)
    x, g = torch.randn(s, b, hin), torch.randn(s, b, hout)
    for sp, parallel_in in [(False, True), (False, False), (True, True)]:
        w_full = _full_weight(9, hout, hin, init)
        ref_w, ref_x = w_full.clone().requires_grad_(), x.clone().requires_grad_()
        ref_b = torch.randn(hout).requires_grad_()
        ref_y = F.linear(ref_x, ref_w, ref_b)
        (ref_y * g).sum().backward()
        torch.manual_seed(9)
        layer = _dev(RowParallelLinear(hin, hout, config=_config(sequence_parallel=sp), init_method=init, bias=True,
                                       input_is_parallel=parallel_in, skip_bias_add=False))
        assert layer.weight.partition_dim == 1 and layer.bias.sequence_parallel == sp
        _check_sharded_state_dict(layer, {"weight": 1}, r, tp)
        _close(layer.weight.data, _chunk(w_full, 1, r, tp), "row weight init")
        with torch.no_grad():
            layer.bias.copy_(ref_b.detach())
        inp = (_chunk(x, 2, r, tp) if parallel_in else x.clone()).requires_grad_()
        y, _ = layer(inp)
        _close(y, _chunk(ref_y.detach(), 0, r, tp) if sp else ref_y.detach(), f"row forward sp={sp}")
        (y * (_chunk(g, 0, r, tp) if sp else g)).sum().backward()
        _close(inp.grad, _chunk(ref_x.grad, 2, r, tp) if parallel_in else ref_x.grad, "row dgrad")
        _close(layer.weight.grad, _chunk(ref_w.grad, 1, r, tp), "row wgrad")
        bias_grad = layer.bias.grad.clone()
        if sp:  # SP bias grads are partial sums over this rank's tokens: finalize_model_grads all-reduces them
            dist.all_reduce(bias_grad, group=_tp_group())
        _close(bias_grad, ref_b.grad, "row bias grad")


def _check_embedding(tp, r):
    from megatron.core.tensor_parallel import VocabParallelEmbedding
    from megatron.core.utils import init_method_normal

    init = init_method_normal(1.0)
    vocab, h, b, s = 32, 8, 2, 8
    torch.manual_seed(3)
    ids, g = torch.randint(0, vocab, (b, s)), torch.randn(b, s, h)
    for reduce_scatter in (False, True):
        w_full = _full_weight(11, vocab, h, init)
        ref_w = w_full.clone().requires_grad_()
        ref_y = F.embedding(ids, ref_w)
        (ref_y * g).sum().backward()
        torch.manual_seed(11)
        emb = _dev(VocabParallelEmbedding(vocab, h, init_method=init, config=_config(),
                                          reduce_scatter_embeddings=reduce_scatter))
        assert (emb.vocab_start_index, emb.vocab_end_index) == (r * vocab // tp, (r + 1) * vocab // tp)
        _close(emb.weight.data, _chunk(w_full, 0, r, tp), "embedding init")
        sharded = _check_sharded_state_dict(emb, {"weight": 0}, r, tp)
        assert sharded["layer.weight"].allow_shape_mismatch
        y = emb(ids)
        if reduce_scatter:
            expect, gl = _chunk(ref_y.detach().transpose(0, 1), 0, r, tp), _chunk(g.transpose(0, 1), 0, r, tp)
        else:
            expect, gl = ref_y.detach(), g
        _close(y, expect, f"embedding forward rs={reduce_scatter}")
        (y * gl).sum().backward()
        _close(emb.weight.grad, _chunk(ref_w.grad, 0, r, tp), "embedding grad")


def _check_grad_accumulation_fusion(tp, r):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.utils import init_method_normal

    init = init_method_normal(0.5)
    torch.manual_seed(4)
    x = torch.randn(4, 2, 8)
    cfg = _config(gradient_accumulation_fusion=True)
    col = _dev(ColumnParallelLinear(8, 8, config=cfg, init_method=init, bias=False))
    row = _dev(RowParallelLinear(8, 8, config=cfg, init_method=init, bias=False, input_is_parallel=True,
                                 skip_bias_add=False))
    ref = _dev(ColumnParallelLinear(8, 8, config=_config(), init_method=init, bias=False))
    with torch.no_grad():
        ref.weight.copy_(col.weight)
    for p in (col.weight, row.weight):
        p.main_grad = torch.full(p.shape, 0.25)
    col.weight.grad_added_to_main_grad = False  # DDP-style: placeholder grad expected
    for _ in range(2):
        row(col(x)[0])[0].sum().backward()
    ref_out = ref(x)[0]
    ref_grad = torch.autograd.grad(row(ref_out)[0].sum(), ref.weight)[0]
    _close(col.weight.main_grad, 0.25 + 2 * ref_grad, "fused wgrad accumulated into main_grad")
    assert col.weight.grad is not None and col.weight.grad_added_to_main_grad  # placeholder for DDP's hook
    assert row.weight.grad is None  # no grad_added_to_main_grad attribute: nothing handed to autograd
    plain = _dev(ColumnParallelLinear(8, 8, config=cfg, init_method=init, bias=False))  # no main_grad: autograd
    plain(x)[0].sum().backward()
    assert plain.weight.grad is not None and plain.weight.grad.abs().sum() > 0


def _check_cross_entropy(tp, r):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    s, b, vocab = 6, 2, 32
    torch.manual_seed(5)
    logits, target, g = torch.randn(s, b, vocab) * 3, torch.randint(0, vocab, (s, b)), torch.rand(s, b)
    for eps in (0.0, 0.1):
        ref_logits = logits.clone().requires_grad_()
        torch_eps = eps * vocab / (vocab - 1)  # Megatron's smoothing in torch's parameterisation
        ref = F.cross_entropy(ref_logits.view(-1, vocab), target.view(-1), reduction="none",
                              label_smoothing=torch_eps).view(s, b)
        (ref * g).sum().backward()
        local = _chunk(logits, 2, r, tp).requires_grad_()
        before = local.detach().clone()
        loss = vocab_parallel_cross_entropy(local, target, label_smoothing=eps)
        _close(loss, ref.detach(), f"cross entropy eps={eps}")
        assert torch.equal(local.detach(), before), "input logits must not be modified"
        (loss * g).sum().backward()
        _close(local.grad, _chunk(ref_logits.grad, 2, r, tp), f"cross entropy grad eps={eps}")
    half = _chunk(logits, 2, r, tp).bfloat16().requires_grad_()
    loss = vocab_parallel_cross_entropy(half, target)
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()


def _check_mappings(tp, r):
    from megatron.core import tensor_parallel as tpl

    torch.manual_seed(6)
    X, G = torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    k = sum(range(1, tp + 1))  # sum over ranks of (rank + 1)
    scale = float(r + 1)

    def run(fn, inp, grad):
        inp = inp.clone().requires_grad_()
        out = fn(inp)
        out.backward(grad)
        return out.detach(), inp.grad

    out, gr = run(tpl.copy_to_tensor_model_parallel_region, X, G * scale)
    _close(out, X, "copy fwd"), _close(gr, G * k, "copy bwd")
    out, gr = run(tpl.reduce_from_tensor_model_parallel_region, X * scale, G)
    _close(out, X * k, "reduce fwd"), _close(gr, G, "reduce bwd")
    out, gr = run(tpl.scatter_to_tensor_model_parallel_region, X, _chunk(G, 2, r, tp))
    _close(out, _chunk(X, 2, r, tp), "scatter tp fwd"), _close(gr, G, "scatter tp bwd")
    out, gr = run(tpl.gather_from_tensor_model_parallel_region, _chunk(X, 2, r, tp), G)
    _close(out, X, "gather tp fwd"), _close(gr, _chunk(G, 2, r, tp), "gather tp bwd")
    out, gr = run(tpl.scatter_to_sequence_parallel_region, X, _chunk(G, 0, r, tp))
    _close(out, _chunk(X, 0, r, tp), "scatter sp fwd"), _close(gr, G, "scatter sp bwd")
    out, gr = run(tpl.gather_from_sequence_parallel_region, _chunk(X, 0, r, tp), G * scale)
    _close(out, X, "gather sp fwd"), _close(gr, _chunk(G, 0, r, tp) * k, "gather sp bwd (reduce-scatter)")
    out, gr = run(lambda t: tpl.gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=False),
                  _chunk(X, 0, r, tp), G)
    _close(gr, _chunk(G, 0, r, tp), "gather sp bwd (split)")
    out, gr = run(tpl.reduce_scatter_to_sequence_parallel_region, X * scale, _chunk(G, 0, r, tp))
    _close(out, _chunk(X, 0, r, tp) * k, "reduce-scatter sp fwd"), _close(gr, G, "reduce-scatter sp bwd")
    out, gr = run(tpl.all_gather_last_dim_from_tensor_parallel_region, _chunk(X, 2, r, tp), G * scale)
    _close(out, X, "ag last fwd"), _close(gr, _chunk(G, 2, r, tp) * k, "ag last bwd")
    out, gr = run(tpl.reduce_scatter_last_dim_to_tensor_parallel_region, X * scale, _chunk(G, 2, r, tp))
    _close(out, _chunk(X, 2, r, tp) * k, "rs last fwd"), _close(gr, G, "rs last bwd")
    # uneven sequence gather (MoE-style output_split_sizes)
    sizes = [i + 1 for i in range(tp)]
    full = torch.arange(float(sum(sizes) * 3)).view(sum(sizes), 3)
    mine = full[sum(sizes[:r]):sum(sizes[:r + 1])]
    out, gr = run(lambda t: tpl.gather_from_sequence_parallel_region(t, output_split_sizes=sizes), mine, full * scale)
    _close(out, full, "uneven gather fwd"), _close(gr, mine * k, "uneven gather bwd")
    from megatron.core.tensor_parallel import mappings
    gather = mappings.all_gather_along_first_dim_async(_chunk(X, 0, r, tp))
    scatter = mappings.reduce_scatter_along_first_dim_async(X * scale)  # both in flight at once
    _close(scatter.wait(), _chunk(X, 0, r, tp) * k, "async reduce-scatter")
    _close(gather.wait(), X, "async all-gather")
    _check_all_to_all(tp, r)


def _check_all_to_all(tp, r):
    from megatron.core import tensor_parallel as tpl

    n, h = 4 * tp, 2 * tp
    torch.manual_seed(8)
    X = torch.randn(n, h)  # the same full [tokens, hidden] on every rank
    sp_in = _chunk(X, 0, r, tp).requires_grad_()
    hp = tpl.all_to_all_sp2hp(sp_in)
    _close(hp, _chunk(X, 1, r, tp), "sp2hp")
    back = tpl.all_to_all_hp2sp(hp)
    _close(back, sp_in.detach(), "hp2sp(sp2hp(x))")
    back.backward(torch.full_like(back, float(r + 1)))
    _close(sp_in.grad, torch.full_like(sp_in, float(r + 1)), "sp2hp/hp2sp backward is the inverse")
    # raw all_to_all: chunk j of rank r's input goes to rank j
    inp = torch.stack([torch.full((2,), float(10 * r + j)) for j in range(tp)]).requires_grad_()
    out = tpl.all_to_all(_tp_group(), inp)
    _close(out, torch.stack([torch.full((2,), float(10 * j + r)) for j in range(tp)]), "all_to_all fwd")
    out.backward(out.detach())
    _close(inp.grad, inp.detach(), "all_to_all bwd")


def _check_broadcast(tp, r):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import broadcast_data

    dp_rank = ps.get_data_parallel_rank()
    data = None
    if r == 0:
        data = {"tokens": torch.arange(12).view(3, 4) + 100 * dp_rank, "labels": torch.arange(5) - dp_rank}
    out = broadcast_data(["tokens", "labels"], data, torch.int64)
    assert torch.equal(out["tokens"], torch.arange(12).view(3, 4) + 100 * dp_rank)
    assert torch.equal(out["labels"], torch.arange(5) - dp_rank)


def _gather(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def _check_rng_tracker(tp, r):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    tracker = get_cuda_rng_tracker()
    assert tracker.is_initialized() and set(tracker.get_states()) == {
        "data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"}
    outside = F.dropout(torch.ones(64), 0.5)
    with tracker.fork():
        inside = F.dropout(torch.ones(64), 0.5)
    saved = tracker.get_states()
    with tracker.fork():
        second = F.dropout(torch.ones(64), 0.5)
    assert not torch.equal(inside, second), "fork must advance the tracked stream"
    tracker.set_states(saved)
    with tracker.fork():
        again = F.dropout(torch.ones(64), 0.5)
    assert torch.equal(again, second), "set_states must restore the stream"
    outs, ins = _gather(outside), _gather(inside)
    tp_ranks = [ps.get_rank_generator().coordinates(q)["tp"] for q in range(dist.get_world_size())]
    for q in range(dist.get_world_size()):
        assert torch.equal(outs[q], outs[0]), "dropout outside fork must match on every rank"
        same_tp = tp_ranks[q] == tp_ranks[dist.get_rank()]
        assert torch.equal(ins[q], inside) == same_tp, "dropout inside fork differs exactly across TP ranks"


def _block(layer, x):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    y = F.dropout(x, 0.3)
    h, _ = layer(y)
    with get_cuda_rng_tracker().fork():
        h = F.dropout(h, 0.3)
    return torch.tanh(h)


def _check_recompute(tp, r):
    from megatron.core.tensor_parallel import (CheckpointWithoutOutput, ColumnParallelLinear, checkpoint,
                                               get_cuda_rng_tracker, model_parallel_cuda_manual_seed)
    from megatron.core.utils import init_method_normal

    layer = _dev(ColumnParallelLinear(8, 16, config=_config(), init_method=init_method_normal(0.5), bias=True))
    torch.manual_seed(10)
    x0 = torch.randn(4, 2, 8)
    results = []
    for mode in ("plain", "checkpoint", "distributed", "without_output"):
        model_parallel_cuda_manual_seed(99)
        torch.manual_seed(5)
        layer.zero_grad()
        x = x0.clone().requires_grad_()
        inner = x * 1.0  # a viewless non-leaf, as the transformer block's hidden states are
        if mode == "plain":
            out = _block(layer, inner)
        elif mode == "without_output":
            ckpt = CheckpointWithoutOutput()
            mid = ckpt.checkpoint(lambda t: _block(layer, t), inner)
            out = mid * 2.0 / 2.0
            ckpt.discard_output_and_register_recompute(out)
        else:
            out = checkpoint(lambda t: _block(layer, t), mode == "distributed", inner)
        after = torch.rand(3)  # RNG position after forward must not depend on the mode
        out.backward(torch.ones_like(out))
        results.append((out.detach(), x.grad, layer.weight.grad.clone(), after,
                        get_cuda_rng_tracker().get_states()["model-parallel-rng"]))
    for mode_result in results[1:]:
        for got, want in zip(mode_result, results[0]):
            assert torch.equal(got, want), "recompute must reproduce outputs, grads and RNG streams exactly"


def _tp_body(tp_sizes=(4, 2)):
    from megatron.core import parallel_state as ps

    for tp in tp_sizes:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        r = ps.get_tensor_model_parallel_rank()
        for check in (_check_column, _check_row, _check_embedding, _check_grad_accumulation_fusion,
                      _check_cross_entropy, _check_mappings, _check_broadcast, _check_rng_tracker, _check_recompute):
            check(tp, r)
        ps.destroy_model_parallel()
    return True


def test_tensor_parallel_layers_mappings_and_rng_on_4_ranks():
    assert run_on_ranks(_tp_body, 4, timeout=300) == [True] * 4
