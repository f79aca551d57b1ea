"""Router math and the balancing losses against formulas written here (single process, no groups)."""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    get_capacity,
    group_limited_topk,
    sequence_load_balancing_loss_func,
    sinkhorn,
    switch_load_balancing_loss_func,
    topk_softmax_with_capacity,
    z_loss_func,
)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig

T, E, K = 12, 8, 2


def _logits(seed=0, shape=(T, E)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _dense(indices, values, shape):
    out = torch.zeros(shape)
    for t in range(shape[0]):
        for j in range(indices.shape[1]):
            out[t, indices[t, j]] = values[t, j]
    return out


def test_softmax_after_topk_renormalises_over_the_chosen_experts():
    logits = _logits()
    probs, routing_map, tokens_per_expert = topk_softmax_with_capacity(logits, K)
    for t in range(T):
        chosen = sorted(range(E), key=lambda e: -logits[t, e].item())[:K]
        values = torch.exp(logits[t, chosen]) / torch.exp(logits[t, chosen]).sum()
        assert set(torch.nonzero(routing_map[t]).view(-1).tolist()) == set(chosen)
        assert torch.allclose(probs[t, chosen], values, atol=1e-6)
        assert probs[t].sum().item() == pytest.approx(1.0, abs=1e-6)
    assert torch.equal(tokens_per_expert, routing_map.sum(0))


def test_pre_softmax_keeps_the_full_softmax_values_and_scaling_factor_multiplies():
    logits = _logits(1)
    probs, routing_map, _ = topk_softmax_with_capacity(logits, K, use_pre_softmax=True, scaling_factor=2.5)
    full = torch.softmax(logits, dim=-1)
    top = torch.topk(full, K, dim=1)
    assert torch.allclose(probs, _dense(top.indices, top.values * 2.5, (T, E)), atol=1e-6)
    assert routing_map.sum().item() == T * K


def test_sigmoid_with_expert_bias_selects_by_biased_scores_and_weights_by_unbiased_ones():
    logits = _logits(2)
    bias = torch.linspace(-1.0, 1.0, E)
    probs, routing_map, _ = topk_softmax_with_capacity(logits, K, score_function="sigmoid", expert_bias=bias)
    scores = torch.sigmoid(logits)
    for t in range(T):
        chosen = sorted(range(E), key=lambda e: -(scores[t, e] + bias[e]).item())[:K]
        expected = scores[t, chosen] / (scores[t, chosen].sum() + 1e-20)
        assert set(torch.nonzero(routing_map[t]).view(-1).tolist()) == set(chosen)
        assert torch.allclose(probs[t, chosen], expected, atol=1e-6)
    # top-1 sigmoid is not renormalised
    probs1, _, _ = topk_softmax_with_capacity(logits, 1, score_function="sigmoid")
    assert torch.allclose(probs1.max(dim=1).values, scores.max(dim=1).values, atol=1e-6)


def test_group_limited_topk_picks_experts_only_from_the_best_groups():
    scores = torch.softmax(_logits(3), dim=-1)
    groups, group_topk, topk = 4, 2, 4
    probs, indices = group_limited_topk(scores, topk, T, E, groups, group_topk)
    per_group = E // groups
    for t in range(T):
        group_score = [sorted(scores[t, g * per_group:(g + 1) * per_group].tolist(), reverse=True)[: topk // group_topk]
                       for g in range(groups)]
        best = sorted(range(groups), key=lambda g: -sum(group_score[g]))[:group_topk]
        allowed = [e for e in range(E) if e // per_group in best]
        expected = sorted(allowed, key=lambda e: -scores[t, e].item())[:topk]
        assert sorted(indices[t].tolist()) == sorted(expected)
        assert torch.allclose(probs[t].sort().values, scores[t, expected].sort().values)
    # routed through topk_softmax_with_capacity (pre-softmax: the scores above are the softmax)
    p, routing_map, _ = topk_softmax_with_capacity(_logits(3), topk, use_pre_softmax=True, num_groups=groups,
                                                   group_topk=group_topk)
    assert all(len({e // per_group for e in torch.nonzero(routing_map[t]).view(-1).tolist()}) <= group_topk
               for t in range(T))


def test_capacity_and_both_drop_policies():
    logits = _logits(4, (16, 4))
    capacity = get_capacity(16 * K, 4, 0.5)
    assert capacity == math.ceil(16 * K / 4 * 0.5) == 4
    gates, topk_map, counts = topk_softmax_with_capacity(logits, K)
    probs, final_map, pre_drop = topk_softmax_with_capacity(logits, K, capacity_factor=0.5, drop_policy="probs")
    assert torch.equal(pre_drop, counts)
    for e in range(4):
        routed = torch.nonzero(topk_map[:, e]).view(-1).tolist()
        keep = sorted(routed, key=lambda t: -gates[t, e].item())[:capacity]
        assert sorted(torch.nonzero(final_map[:, e]).view(-1).tolist()) == sorted(keep)
        assert torch.allclose(probs[:, e], gates[:, e] * final_map[:, e])
    _, position_map, _ = topk_softmax_with_capacity(logits, K, capacity_factor=0.5, drop_policy="position")
    for e in range(4):
        kept = set(torch.nonzero(position_map[:, e]).view(-1).tolist())
        assert kept <= set(torch.nonzero(topk_map[:, e]).view(-1).tolist())
        assert len(kept) == min(capacity, int(counts[e]))
    padded_probs, padded_map, _ = topk_softmax_with_capacity(logits, K, capacity_factor=0.5, pad_to_capacity=True)
    assert padded_map.sum(0).tolist() == [capacity] * 4
    assert torch.all(padded_probs[padded_map & ~topk_map] == 0)


def test_switch_aux_loss_formula():
    probs = torch.softmax(_logits(5), dim=-1)
    counts = torch.zeros(E)
    for t in range(T):
        for e in torch.topk(probs[t], K).indices.tolist():
            counts[e] += 1
    coeff = 0.01
    expected = E * coeff * sum((counts[e] / (T * K)) * (probs[:, e].sum() / T) for e in range(E))
    got = switch_load_balancing_loss_func(probs, counts.clone(), K, coeff)
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)


def test_seq_aux_loss_formula():
    s, b = 6, 2
    probs = torch.softmax(_logits(6, (s * b, E)), dim=-1)
    routing_map = torch.zeros(s * b, E, dtype=torch.bool)
    routing_map.scatter_(1, torch.topk(probs, K).indices, True)
    coeff = 0.1
    p, m = probs.view(s, b, E), routing_map.view(s, b, E).float()
    per_sample = [sum((m[:, i, e].sum() / (s * K / E)) * p[:, i, e].mean() for e in range(E)) for i in range(b)]
    expected = coeff * sum(per_sample) / b
    got = sequence_load_balancing_loss_func(probs, routing_map, b, s, K, coeff)
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)


def test_z_loss_formula():
    logits = _logits(7)
    expected = 1e-3 * sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / T
    assert z_loss_func(logits, 1e-3).item() == pytest.approx(expected, rel=1e-6)


def test_sinkhorn_matches_the_iteration_written_out():
    cost = _logits(8)
    c = torch.exp(cost.double())
    d0, d1 = torch.ones(T, dtype=torch.double), torch.ones(E, dtype=torch.double)
    error, d1_old = 1e9, d1
    while error > 1e-4:
        d0 = 1.0 / (T * ((c * d1).sum(1) + 1e-8))
        d1 = 1.0 / (E * ((d0.unsqueeze(1) * c).sum(0) + 1e-8))
        error = (d1_old - d1).abs().mean().item()
        d1_old = d1
    expected = c * d0.unsqueeze(1) * d1
    assert torch.allclose(sinkhorn(cost.double()), expected, rtol=1e-10)
    # columns carry (nearly) equal mass: the balancing it is used for
    assert torch.allclose(expected.sum(0), torch.full((E,), 1.0 / E, dtype=torch.double), rtol=1e-3)


def _router_config(**kw):
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=4, num_moe_experts=E, moe_router_topk=K,
                add_bias_linear=False, moe_aux_loss_coeff=0.0)
    base.update(kw)
    return TransformerConfig(**base)


def _router(**kw):
    torch.manual_seed(0)
    router = TopKRouter(_router_config(**kw))
    router.set_layer_number(1)
    return router


def test_router_gradients_include_the_aux_and_z_losses_with_the_main_loss_scale():
    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    router = _router(moe_aux_loss_coeff=0.05, moe_z_loss_coeff=0.01)
    x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(1))  # [s, b, h]
    weight_for_main = torch.randn(T, E, generator=torch.Generator().manual_seed(2))
    scale = 0.25
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1) * scale)
    probs, _ = router(x)
    (probs * weight_for_main).sum().mul(scale).backward()
    got = router.weight.grad.clone()

    w = router.weight.detach().clone().requires_grad_()
    logits = x.view(-1, 16) @ w.t()
    top = torch.topk(logits, K, dim=1)
    main_probs = torch.zeros(T, E).scatter(1, top.indices, torch.softmax(top.values, dim=-1))
    scores = torch.softmax(logits, dim=-1)
    counts = torch.zeros(E).scatter_add(0, torch.topk(scores, K).indices.view(-1), torch.ones(T * K))
    aux = E * 0.05 * (scores.sum(0) * counts).sum() / (T * T * K)
    z = 0.01 * (torch.logsumexp(logits, dim=-1) ** 2).mean()
    ((main_probs * weight_for_main).sum() + aux + z).mul(scale).backward()
    assert torch.allclose(got, w.grad, rtol=1e-5, atol=1e-7)
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    assert tracker["load_balancing_loss"]["values"][0].item() == pytest.approx(aux.item() / 0.05, rel=1e-5)
    assert tracker["z_loss"]["values"][0].item() == pytest.approx(z.item() / 0.01, rel=1e-5)
    moe_utils.get_moe_layer_wise_logging_tracker().clear()


@pytest.mark.parametrize("pre_softmax,scaling", [(False, None), (True, 2.5)])
def test_fused_softmax_aux_loss_routing_equals_the_unfused_path(pre_softmax, scaling, monkeypatch):
    """The plain softmax + Switch-loss case goes through one fused function (compiled on CUDA); on CPU it runs
    the same operations as the general path: identical probabilities, map, recorded loss and gradients."""
    from megatron.core.transformer.moe import router as router_module

    calls = []
    fused_fn = router_module._softmax_topk_with_switch_loss_fused
    monkeypatch.setattr(router_module, "_softmax_topk_with_switch_loss_fused",
                        lambda *args: calls.append(1) or fused_fn(*args))
    results = []
    for fused in (True, False):
        moe_utils.get_moe_layer_wise_logging_tracker().clear()
        router = _router(moe_aux_loss_coeff=0.05, moe_router_pre_softmax=pre_softmax,
                         moe_router_topk_scaling_factor=scaling)
        if not fused:
            monkeypatch.setattr(router, "_fused_aux_loss_routing", lambda logits: None)
        x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(1))
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1) * 0.5)
        probs, routing_map = router(x)
        (probs * torch.arange(T * E, dtype=torch.float32).view(T, E)).sum().backward()
        recorded = moe_utils.get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"][0].clone()
        results.append((probs.detach(), routing_map, recorded, router.weight.grad.clone()))
    assert len(calls) == 1
    for got, want in zip(*results):
        assert torch.equal(got, want)
    moe_utils.get_moe_layer_wise_logging_tracker().clear()


def test_per_token_loss_multiplies_the_aux_loss_by_the_local_token_count():
    grads = []
    for per_token in (False, True):
        router = _router(moe_aux_loss_coeff=0.05, calculate_per_token_loss=per_token,
                         moe_router_load_balancing_type="aux_loss")
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
        probs, _ = router(torch.ones(6, 2, 16))
        (probs * 0).sum().backward()
        grads.append(router.weight.grad.clone())
    assert grads[0].abs().sum() > 0 and torch.allclose(grads[1], grads[0] * T, rtol=1e-5)
    moe_utils.get_moe_layer_wise_logging_tracker().clear()


def test_no_losses_in_eval_or_without_grad_and_expert_bias_counts_only_with_grad():
    router = _router(moe_aux_loss_coeff=0.05, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    tracker.clear()
    x = torch.randn(6, 2, 16)
    with torch.no_grad():
        router(x)
    assert "load_balancing_loss" not in tracker and router.local_tokens_per_expert.sum() == 0
    router.eval()
    router(x)
    assert "load_balancing_loss" not in tracker
    assert router.local_tokens_per_expert.sum().item() == T * K  # counted whenever grad is on
    assert router.expert_bias.dtype == torch.float32 and "expert_bias" in router.state_dict()
    assert "local_tokens_per_expert" not in router.state_dict()


def test_get_updated_expert_bias_formula():
    counts = torch.tensor([[4.0, 0.0, 2.0, 2.0], [1.0, 1.0, 1.0, 5.0]])
    bias = torch.zeros(2, 4)
    updated = moe_utils.get_updated_expert_bias(counts, bias, 0.1)
    assert torch.allclose(updated, torch.tensor([[-0.1, 0.1, 0.0, 0.0], [0.1, 0.1, 0.1, -0.1]]))


def test_router_dtype_input_jitter_and_forced_random_logits():
    for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64)):
        router = _router(moe_router_dtype=name).to(torch.bfloat16)
        x = torch.randn(6, 2, 16, dtype=torch.bfloat16, requires_grad=True)
        logits = router.gating(x)
        assert logits.dtype == dtype
        logits.sum().backward()
        assert x.grad.dtype == torch.bfloat16 and router.weight.grad.dtype == torch.bfloat16
    jitter = _router(moe_input_jitter_eps=0.1)
    x = torch.ones(6, 2, 16)
    noisy = jitter.apply_input_jitter(x)
    assert noisy.min() >= 0.9 and noisy.max() <= 1.1 and not torch.equal(noisy, x)
    moe_utils.RandomSTE.generator = None
    forced = _router(moe_router_force_load_balancing=True)
    x = torch.randn(6, 2, 16, requires_grad=True)
    logits = moe_utils.apply_random_logits(forced.gating(x))
    expected = torch.empty(6, 2, E).normal_(generator=torch.Generator().manual_seed(42))
    assert torch.allclose(logits, expected)
    logits.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    moe_utils.RandomSTE.generator = None


def test_sinkhorn_router_and_its_rules():
    router = _router(moe_router_load_balancing_type="sinkhorn", moe_router_topk=1)
    probs, routing_map = router(torch.randn(6, 2, 16))
    assert routing_map.sum(1).tolist() == [1] * T
    assert torch.all((probs > 0) == routing_map)
    with pytest.raises(ValueError, match="sinkhorn.*moe_aux_loss_coeff = 0"):
        _router_config(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.1)


def test_autoscaler_identity_forward_and_scale_in_backward():
    x = torch.randn(3, requires_grad=True)
    loss = (x ** 2).sum()
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1) * 3.0)
    y = MoEAuxLossAutoScaler.apply(x.detach().requires_grad_(), loss)
    y.sum().backward()
    assert torch.allclose(x.grad, 3.0 * 2 * x.detach())


def test_weighted_swiglu_matches_autograd_of_the_formula():
    from megatron.core.transformer.moe.experts import weighted_swiglu

    y = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.rand(5, 1, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, 4, dtype=torch.float64)
    weighted_swiglu(y, w).backward(g)
    y2, w2 = y.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (F.silu(y2[:, :4]) * y2[:, 4:] * w2).backward(g)
    assert torch.allclose(y.grad, y2.grad) and torch.allclose(w.grad, w2.grad)
    bf16 = weighted_swiglu(y.detach().bfloat16(), w.detach().float())
    assert bf16.dtype == torch.bfloat16
