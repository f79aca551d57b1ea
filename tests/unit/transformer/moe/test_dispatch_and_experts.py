"""Permutation, the alltoall chunk bookkeeping (§1.5's worked example), experts, specs and the loss tracker."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.moe import moe_utils, token_dispatcher
from megatron.core.transformer.moe.moe_utils import permute, sort_chunks_by_idxs, unpermute
from megatron.core.transformer.transformer_config import TransformerConfig


def _map(routes, num_tokens, num_experts):
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    for t, experts in enumerate(routes):
        routing_map[t, experts] = True
    return routing_map


def test_permute_unpermute_worked_example():
    # T=3, E=4, k=2: t0 -> {0, 2}, t1 -> {1, 2}, t2 -> {0, 3}
    routing_map = _map([[0, 2], [1, 2], [0, 3]], 3, 4)
    tokens = torch.tensor([[10.0], [11.0], [12.0]])
    probs = torch.tensor([[0.6, 0, 0.4, 0], [0, 0.7, 0.3, 0], [0.2, 0, 0, 0.8]])
    for num_out in (None, 6):
        permuted, permuted_probs, sorted_indices = permute(tokens, routing_map, probs=probs, num_out_tokens=num_out)
        assert sorted_indices.tolist() == [0, 2, 1, 0, 1, 2]
        assert permuted.view(-1).tolist() == [10, 12, 11, 10, 11, 12]
        assert torch.allclose(permuted_probs, torch.tensor([0.6, 0.2, 0.7, 0.4, 0.3, 0.8]))
    restored = unpermute(permuted, sorted_indices, restore_shape=tokens.shape)
    assert restored.view(-1).tolist() == [20, 22, 24]  # each token's k copies summed
    weighted = unpermute(permuted, sorted_indices, tokens.shape, probs=probs, routing_map=routing_map)
    assert torch.allclose(weighted.view(-1), torch.tensor([10.0, 11.0, 12.0]))
    # drop-and-pad: exactly `capacity` rows per expert, routed tokens first, then unrouted ones in order
    padded, _, padded_indices = permute(tokens, routing_map, num_out_tokens=8, drop_and_pad=True)
    assert padded_indices.tolist() == [0, 2, 1, 0, 0, 1, 2, 0]


@pytest.mark.parametrize("topk", [1, 2, 3])
def test_topk_gather_permutation_equals_permute_and_unpermute(topk):
    """Dropless top-k: `permute_topk` / `unpermute_topk` give `permute` / `unpermute`'s rows, order, sums and
    gradients (their backward gathers instead of scatter-adding)."""
    gen = torch.Generator().manual_seed(topk)
    num_tokens, num_experts, hidden = 11, 5, 6
    routes = [torch.randperm(num_experts, generator=gen)[:topk].tolist() for _ in range(num_tokens)]
    routing_map = _map(routes, num_tokens, num_experts)
    probs = torch.rand(num_tokens, num_experts, generator=gen) * routing_map
    tokens = torch.randn(num_tokens, hidden, generator=gen)
    results = []
    for gather in (False, True):
        x, p = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
        if gather:
            rows, row_probs, mapping = moe_utils.permute_topk(x, routing_map, topk, probs=p)
        else:
            rows, row_probs, mapping = permute(x, routing_map, probs=p, num_out_tokens=num_tokens * topk)
        weighted = rows * (row_probs.unsqueeze(-1) + torch.arange(rows.shape[0]).unsqueeze(-1))
        out = moe_utils.unpermute_topk(weighted, mapping) if gather else unpermute(weighted, mapping, tokens.shape)
        out.pow(2).sum().backward()
        results.append((rows, row_probs, out, x.grad, p.grad))
    for got, want in zip(results[1], results[0]):
        assert torch.allclose(got, want, atol=1e-6)


def test_alltoall_counts_and_chunk_sort_worked_example(monkeypatch):
    """EP = 2, L = 2, k = 2, T = 3 per rank, seen from EP rank 0 (the other rank's counts come from the
    all-gather): rank 0 routes t0->{0,2}, t1->{1,2}, t2->{0,3}; rank 1 routes t0->{1,3}, t1->{0,1}, t2->{2,3}."""
    config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1, num_moe_experts=4,
                               add_bias_linear=False, moe_token_dispatcher_type="alltoall")
    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher(2, [0, 1], config)
    dispatcher.ep_size = 2
    dispatcher.sort_input_by_local_experts = torch.arange(4).reshape(-1, 2).T.ravel()
    dispatcher.restore_output_by_local_experts = torch.arange(4).reshape(2, -1).T.ravel()
    rank1_counts = _map([[1, 3], [0, 1], [2, 3]], 3, 4).sum(0)
    monkeypatch.setattr(token_dispatcher, "all_gather_along_first_dim",
                        lambda counts, group=None: torch.cat([counts, rank1_counts]))
    tokens = torch.tensor([[0.0], [1.0], [2.0]])
    routing_map = _map([[0, 2], [1, 2], [0, 3]], 3, 4)
    permuted, _ = dispatcher.dispatch_preprocess(tokens.view(3, 1, 1), routing_map, routing_map.float())
    assert permuted.view(-1).tolist() == [0, 2, 1, 0, 1, 2]  # [t0, t2, t1 | t0, t1, t2]
    dispatcher._host_counts()
    assert dispatcher.input_splits == [3, 3] and dispatcher.output_splits == [3, 3]
    assert dispatcher.num_global_tokens_per_local_expert.tolist() == [[2, 1], [1, 2]]
    assert dispatcher.tokens_per_expert.tolist() == [3, 3]
    # rows after the A2A: [r0:e0 t0, r0:e0 t2, r0:e1 t1 | r1:e0 t1, r1:e1 t0, r1:e1 t1]
    received = ["r0t0", "r0t2", "r0t1", "r1t1", "r1t0", "r1t1'"]
    rows = torch.arange(6.0).view(6, 1)
    sorted_rows, _ = sort_chunks_by_idxs(rows, dispatcher.num_global_tokens_per_local_expert.ravel(),
                                         dispatcher.sort_input_by_local_experts)
    assert [received[int(i)] for i in sorted_rows.view(-1)] == ["r0t0", "r0t2", "r1t1", "r0t1", "r1t0", "r1t1'"]
    restored, _ = sort_chunks_by_idxs(sorted_rows, dispatcher.num_global_tokens_per_local_expert.T.ravel(),
                                      dispatcher.restore_output_by_local_experts)
    assert torch.equal(restored, rows)


def _moe_config(**kw):
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24, num_moe_experts=4,
                moe_router_topk=2, add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
                use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)
    base.update(kw)
    return TransformerConfig(**base)


def _experts(grouped, **kw):
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.spec_utils import build_module

    module, submodules = LocalSpecProvider().grouped_mlp_modules(grouped, False)
    from megatron.core.transformer.spec_utils import ModuleSpec

    return build_module(ModuleSpec(module=module, submodules=submodules), 4, _moe_config(moe_grouped_gemm=grouped, **kw))


@pytest.mark.parametrize("probs_on_input", [False, True])
def test_grouped_and_sequential_experts_agree_and_empty_experts_get_zero_grads(probs_on_input):
    from tests.parity.test_moe_parity import assemble, global_pieces, load_global

    kw = dict(moe_apply_probs_on_input=True, moe_router_topk=1, moe_router_pre_softmax=True) if probs_on_input else {}
    torch.manual_seed(0)
    sequential = _experts(False, **kw)
    grouped = _experts(True, **kw)
    load_global(grouped, assemble([global_pieces(sequential)]))
    tokens_per_expert = torch.tensor([3, 0, 4, 1])  # expert 1 gets no rows
    x = torch.randn(8, 16)
    probs = torch.rand(8)
    outputs = []
    for experts in (sequential, grouped):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        out, bias = experts(xi, tokens_per_expert, pi)
        assert bias is None
        out.backward(torch.ones_like(out))
        outputs.append((out, xi.grad, pi.grad))
    for a, b in zip(*outputs):
        assert torch.allclose(a, b, atol=1e-6)
    grads = assemble([[(k, s, i, d, m) for k, s, i, d, m in _grad_pieces(sequential)]])
    fc1 = grads["experts.linear_fc1.weight"]
    assert fc1[1].abs().sum() == 0 and fc1[0].abs().sum() > 0
    # every weight has a gradient, also with no rows at all
    out, _ = grouped(torch.zeros(0, 16), torch.zeros(4, dtype=torch.long), torch.zeros(0))
    grouped.zero_grad()
    out.sum().backward()
    assert grouped.weight1.grad is not None and grouped.weight2.grad is not None


def _grad_pieces(module):
    from tests.parity.test_moe_parity import global_pieces

    saved = {p: p.data for p in module.parameters()}
    for p in module.parameters():
        p.data = p.grad
    try:
        return global_pieces(module)
    finally:
        for p, data in saved.items():
            p.data = data


def test_grouped_gemm_loop_fallback_matches_per_group_matmuls():
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    a = torch.randn(7, 5)
    b = torch.randn(3, 5, 4)
    sizes = torch.tensor([2, 0, 5])
    expected = torch.cat([a[:2] @ b[0], a[2:2] @ b[1], a[2:] @ b[2]])
    assert torch.allclose(gg.ops.gmm(a, b, sizes), expected)
    assert torch.allclose(gg.ops.gmm(a, b.transpose(1, 2).contiguous(), sizes, trans_b=True), expected)
    assert not gg.torch_grouped_mm_supported(torch.device("cpu"), torch.float32)


def test_moe_layer_pattern_and_decoder_block_specs():
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_with_transformer_engine_spec,
        moe_layer_pattern,
    )
    from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    config = _moe_config(num_layers=4, moe_layer_freq=2)
    assert moe_layer_pattern(config) == [1, 0, 1, 0]
    assert moe_layer_pattern(_moe_config(num_layers=4, moe_layer_freq=[0, 1, 1, 0])) == [0, 1, 1, 0]
    with pytest.raises(ValueError, match="has 3 entries but num_layers is 4"):
        moe_layer_pattern(_moe_config(num_layers=4, moe_layer_freq=[0, 1, 1]))
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    kinds = [spec.submodules.mlp.module for spec in block.layer_specs]
    assert kinds[0] is MoELayer and kinds[2] is MoELayer and kinds[1] is not MoELayer
    local = block.layer_specs[0].submodules
    assert local.sharded_state_dict_keys_map["pre_mlp_layernorm."] == "mlp.linear_fc1.layer_norm_"
    assert local.mlp.submodules.experts.module is SequentialMLP
    te = get_gpt_layer_with_transformer_engine_spec(num_experts=4, moe_grouped_gemm=True).submodules
    assert te.sharded_state_dict_keys_map == {} and te.mlp.submodules.experts.module is GroupedMLP
    assert te.pre_mlp_layernorm is not None and te.mlp.submodules.shared_experts.params == {"gate": False}


class _Writer:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, name, value, iteration):
        self.scalars.append((name, float(value), iteration))


class _Wandb:
    def __init__(self):
        self.logs = []

    def log(self, values, iteration):
        self.logs.append(({k: float(v) for k, v in values.items()}, iteration))


def test_track_moe_metrics_values_names_and_total_loss_dict_rule():
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    tracker.clear()
    for layer, value in ((1, 2.0), (3, 4.0), (1, 1.0)):  # layer 1 seen by two microbatches
        moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(value), layer, 4)
    moe_utils.save_to_aux_losses_tracker("z_loss", torch.tensor(8.0), 3, 4)
    assert tracker["load_balancing_loss"]["values"].tolist() == [3.0, 0.0, 4.0, 0.0]
    total = {}
    # without a writer nothing is logged and total_loss_dict stays untouched (Megatron 0.13.1), but it is cleared
    moe_utils.track_moe_metrics(0.5, 7, None, total_loss_dict=total, num_layers=4, moe_layer_freq=2)
    assert total == {} and tracker["load_balancing_loss"]["values"].sum() == 0
    for layer, value in ((1, 2.0), (3, 4.0)):
        moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(value), layer, 4)
    moe_utils.save_to_aux_losses_tracker("z_loss", torch.tensor(8.0), 3, 4)
    writer, wandb = _Writer(), _Wandb()
    moe_utils.track_moe_metrics(0.5, 7, writer, wandb, total_loss_dict=total, per_layer_logging=True,
                                force_initialize=True, track_names=["load_balancing_loss", "z_loss"], num_layers=4,
                                moe_layer_freq=2)
    # 2 MoE layers (0 and 2 of 4): value = sum over layers * loss_scale / 2
    assert total["load_balancing_loss"].item() == pytest.approx((2 + 4) * 0.5 / 2)
    assert total["z_loss"].item() == pytest.approx(8 * 0.5 / 2)
    names = {name: value for name, value, _ in writer.scalars}
    assert names["load_balancing_loss"] == pytest.approx(1.5) and names["moe/load_balancing_loss_layer_2"] == 2.0
    assert names["moe/z_loss_layer_2"] == 4.0 and all(it == 7 for _, _, it in writer.scalars)
    assert {"load_balancing_loss": 1.5} in [log for log, _ in wandb.logs]
    moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(2.0), 1, 4)
    moe_utils.track_moe_metrics(1.0, 8, _Writer(), total_loss_dict=total, num_layers=4, moe_layer_freq=[1, 1, 0, 0],
                                mtp_num_layers=1)
    assert total["load_balancing_loss"].item() == pytest.approx(1.5 + 2.0 / 3)  # 2 MoE + 1 MTP layer: added
    tracker.clear()


def test_config_rules_name_the_fields():
    cases = [
        (dict(moe_router_topk=1), "needs moe_router_pre_softmax"),
        (dict(moe_router_enable_expert_bias=True), "needs moe_router_score_function 'sigmoid'"),
        (dict(moe_router_group_topk=2), "needs moe_router_num_groups"),
        (dict(moe_router_group_topk=2, moe_router_num_groups=3), "divisible by moe_router_num_groups"),
        (dict(moe_expert_capacity_factor=1.0, moe_router_load_balancing_type="sinkhorn"), "works only with"),
        (dict(moe_pad_expert_input_to_capacity=True), "needs moe_expert_capacity_factor"),
        (dict(moe_shared_expert_intermediate_size=16, moe_shared_expert_overlap=True), "only with the alltoall"),
        (dict(add_bias_linear=True), "--disable-bias-linear"),
        (dict(recompute_granularity="selective", recompute_modules=["moe_act"]), "needs moe_grouped_gemm"),
        (dict(expert_model_parallel_size=3), "divisible by expert_model_parallel_size"),
        (dict(moe_apply_probs_on_input=True), "needs moe_router_topk = 1"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            _moe_config(**kw)
    with pytest.warns(UserWarning, match="deprecated"):
        config = _moe_config(moe_expert_capacity_factor=-1.0, moe_layer_recompute=True)
    assert config.moe_expert_capacity_factor is None
    assert config.recompute_granularity == "selective" and "moe" in config.recompute_modules


def test_shared_expert_gate_and_its_checkpoint_key():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    config = _moe_config(moe_shared_expert_intermediate_size=32)
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    torch.manual_seed(0)
    gated = SharedExpertMLP(config, submodules, gate=True)
    assert gated.linear_fc1.weight.shape == (64, 16) and gated.gate_weight.shape == (1, 16)
    x = torch.randn(5, 2, 16)
    plain, _ = super(SharedExpertMLP, gated).forward(x)
    assert torch.allclose(gated(x), plain * torch.sigmoid(x @ gated.gate_weight.t()))
    assert "gate_weight" in gated.sharded_state_dict()


def test_moe_layer_runs_eagerly_inside_a_compiled_function():
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module

    layer = build_module(get_moe_module_spec(use_te=False, num_experts=4), config=_moe_config())
    x = torch.randn(6, 2, 16)
    expected, _ = layer(x)
    compiled = torch.compile(lambda inputs: layer(inputs)[0] * 2, backend="eager")
    assert torch.allclose(compiled(x), expected * 2)


def _grouped_mm_on_cpu() -> bool:
    try:
        torch._grouped_mm(torch.zeros(4, 4), torch.zeros(1, 4, 4), offs=torch.tensor([4], dtype=torch.int32))
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


def _reference_wgrad_accumulate_(main_grad, x, dy, offsets):
    """main_grad[g] += x_g^T dy_g, the groups read from the cumulative end offsets (the kernel's contract)."""
    start = 0
    for group, end in enumerate(offsets.tolist()):
        main_grad[group] += x[start:end].t() @ dy[start:end]
        start = end


@pytest.mark.parametrize("kernel", ["reference", "triton-interpreter"])
def test_grouped_mlp_fused_weight_gradient_goes_into_main_grad(kernel, monkeypatch):
    """GroupedMLP with gradient-accumulation fusion under DDP's attributes: the weight gradients land in
    main_grad (on top of what it held), autograd gets the placeholder with grad_added_to_main_grad set, and
    output and input gradients equal the unfused path. Run on CPU in fp32 through torch._grouped_mm with the
    CUDA-only checks bypassed; the Triton kernel itself runs in Triton's interpreter."""
    from megatron.core.transformer.moe import _triton_grouped_wgrad
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    if not _grouped_mm_on_cpu():
        pytest.skip("this torch has no CPU torch._grouped_mm")
    if kernel == "triton-interpreter":
        pytest.importorskip("triton")
        from tests.harness import load_interpreted

        interpreted = load_interpreted(_triton_grouped_wgrad.__file__, "triton_grouped_wgrad_interpreted")
        small = interpreted.WgradLaunch(block_k=16, block_m=16, block_r=16, group_k=2, num_warps=1, num_stages=1)
        accumulate = lambda *args: interpreted.grouped_wgrad_accumulate_(*args, launch=small)  # noqa: E731
    else:
        accumulate = _reference_wgrad_accumulate_
    torch.manual_seed(0)
    unfused = _experts(True)
    fused = _experts(True, gradient_accumulation_fusion=True)
    fused.load_state_dict(unfused.state_dict())
    starts = {}
    for name, param in fused.named_parameters():
        starts[name] = torch.randn(param.shape)
        param.main_grad = starts[name].clone()
        param.grad_added_to_main_grad = False
    calls = []
    monkeypatch.setattr(gg, "fused_wgrad_supported", lambda *args: True)
    monkeypatch.setattr(_triton_grouped_wgrad, "grouped_wgrad_accumulate_",
                        lambda *args: calls.append(1) or accumulate(*args))
    tokens_per_expert = torch.tensor([3, 0, 4, 1])
    x, probs = torch.randn(8, 16), torch.rand(8)
    outputs = []
    for experts in (unfused, fused):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        out, _ = experts(xi, tokens_per_expert, pi)
        out.backward(torch.arange(out.numel(), dtype=torch.float32).view_as(out) / out.numel())
        outputs.append((out, xi.grad, pi.grad))
    assert len(calls) == 2  # fc1 and fc2
    for got, want in zip(outputs[1], outputs[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (name, param), (_, reference) in zip(fused.named_parameters(), unfused.named_parameters()):
        assert param.grad_added_to_main_grad, name
        torch.testing.assert_close(param.main_grad, starts[name] + reference.grad, rtol=1e-5, atol=1e-5)
