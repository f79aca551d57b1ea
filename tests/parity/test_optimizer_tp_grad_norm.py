"""Optimizer grad norm, clipping, zero counting and inf detection across a TP=2 group vs one process.

Each rank holds half of a TP-split weight (`tensor_model_parallel=True`), a replicated (TP-duplicate)
norm weight with identical grads on both ranks, and a `shared` param that must not count. The
reference is computed in every process on the full, unsplit tensors. Tolerance: the norm is a sum of
squares reduced in a different order, so rtol 1e-6; clipped grads and Adam updates are elementwise
and compared with rtol 1e-6 / atol 1e-7.
"""
import math

import pytest
import torch

from tests.harness import run_on_ranks

parallel_state = pytest.importorskip("megatron.core.parallel_state")
if not hasattr(parallel_state, "initialize_model_parallel"):
    pytest.skip("parallel_state.initialize_model_parallel is not available yet", allow_module_level=True)

from megatron.core.optimizer import (  # noqa: E402
    OptimizerConfig,
    count_zeros_fp32,
    get_grad_norm_fp32,
    get_megatron_optimizer,
)

def _assert_close(actual, expected, rtol=1.3e-6, atol=1e-5):
    """allclose with a readable failure (torch.testing.assert_close imports DTensor: seconds per process)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual.shape, expected.shape)
    diff = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert torch.allclose(actual, expected, rtol=rtol, atol=atol), f"max abs diff {diff}"



class _ShardedToy(torch.nn.Module):
    """Params of one TP rank: a row shard of a [8, 6] weight, a replicated norm weight, a shared copy."""

    def __init__(self, full_weight, norm_weight, shared_weight, rank, extra_bias):
        super().__init__()
        rows = full_weight.shape[0] // 2
        self.weight = torch.nn.Parameter(full_weight[rank * rows : (rank + 1) * rows].clone())
        self.weight.tensor_model_parallel = True
        self.weight.partition_dim = 0
        self.weight.partition_stride = 1
        self.norm_weight = torch.nn.Parameter(norm_weight.clone())
        self.tied = torch.nn.Parameter(shared_weight.clone())
        self.tied.shared = True
        if extra_bias:
            self.extra = torch.nn.Parameter(torch.zeros(3, 2))
            self.extra.tensor_model_parallel = True


def _full_tensors():
    gen = torch.Generator().manual_seed(1234)
    full = {name: torch.randn(shape, generator=gen) for name, shape in
            (("weight", (8, 6)), ("norm_weight", (6,)), ("tied", (4, 6)))}
    grads = {name: torch.randn(t.shape, generator=gen) for name, t in full.items()}
    grads["weight"][0, :3] = 0.0
    return full, grads


def _attach_grads(model, grads, rank, scale=1.0):
    rows = grads["weight"].shape[0] // 2
    dtype = model.weight.dtype
    model.weight.grad = (grads["weight"][rank * rows : (rank + 1) * rows] * scale).to(dtype)
    model.norm_weight.grad = (grads["norm_weight"] * scale).to(dtype)
    model.tied.grad = (grads["tied"] * scale).to(dtype)
    if hasattr(model, "extra"):
        model.extra.grad = torch.zeros(3, 2)


def _check_norms(model, grads, rank):
    opt = get_megatron_optimizer(
        OptimizerConfig(lr=0.1, clip_grad=0.0), [model], scale_lr_cond=lambda name, p: name == "extra", lr_mult=2.0
    )
    _attach_grads(model, grads, rank)
    counted = torch.cat([grads["weight"].flatten(), grads["norm_weight"].flatten()])  # [8, 6] + [6] -> [54]
    group = opt.get_grad_stats_parallel_group()
    assert group is parallel_state.get_model_parallel_group()
    l2 = get_grad_norm_fp32(opt.get_main_grads_for_grad_norm(), 2, group)
    assert l2 == pytest.approx(counted.norm().item(), rel=1e-6)
    inf = get_grad_norm_fp32(opt.get_main_grads_for_grad_norm(), math.inf, group)
    assert inf == pytest.approx(counted.abs().max().item(), rel=1e-6)
    l3 = get_grad_norm_fp32(opt.get_main_grads_for_grad_norm(), 3, group)
    assert l3 == pytest.approx(counted.norm(3).item(), rel=1e-5)
    zeros = count_zeros_fp32(opt.get_parameters(), group)
    assert zeros == 3 + 6
    keys = [(g["wd_mult"], g["lr_mult"], g["is_expert_parallel"], g["is_decoupled_lr"]) for g in opt.param_groups]
    assert keys == [(1.0, 1.0, False, False), (0.0, 1.0, False, False), (1.0, 2.0, False, False)]
    assert len(opt.param_groups[2]["params"]) == (1 if rank == 1 else 0)
    return counted.norm().item()


def _check_clipped_step(model, full, grads, rank, total_norm):
    config = OptimizerConfig(lr=0.1, clip_grad=0.5, weight_decay=0.0)
    opt = get_megatron_optimizer(config, [model])
    _attach_grads(model, grads, rank)
    ok, norm, _ = opt.step()
    assert ok and norm == pytest.approx(total_norm, rel=1e-6)
    coeff = 0.5 / (total_norm + 1e-6)
    ref_weight = torch.nn.Parameter(full["weight"].clone())
    ref_weight.grad = grads["weight"] * coeff
    ref_tied = torch.nn.Parameter(full["tied"].clone())
    ref_tied.grad = grads["tied"] * coeff
    torch.optim.AdamW([ref_weight, ref_tied], lr=0.1, weight_decay=0.0, foreach=False).step()
    rows = full["weight"].shape[0] // 2
    _assert_close(model.weight.grad, ref_weight.grad[rank * rows : (rank + 1) * rows])
    _assert_close(model.weight.data, ref_weight.data[rank * rows : (rank + 1) * rows],
                               rtol=1e-6, atol=1e-7)
    _assert_close(model.tied.data, ref_tied.data, rtol=1e-6, atol=1e-7)


def _check_bf16_and_found_inf(full, grads, rank, total_norm):
    model = _ShardedToy(full["weight"], full["norm_weight"], full["tied"], rank, extra_bias=False).bfloat16()
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.1, bf16=True, clip_grad=1e9), [model])
    assert all(getattr(m, "tensor_model_parallel", False) == getattr(p, "tensor_model_parallel", False)
               for p, m in zip(model.parameters(), opt.get_parameters()))
    for name, param in model.named_parameters():
        source = grads[name] if name != "weight" else grads[name].chunk(2)[rank]
        param.main_grad = source.clone()
    ok, norm, _ = opt.step()
    assert ok and norm == pytest.approx(total_norm, rel=1e-6)

    fp16 = _ShardedToy(full["weight"], full["norm_weight"], full["tied"], rank, extra_bias=False).half()
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.1, fp16=True, initial_loss_scale=4.0, hysteresis=1), [fp16])
    before = fp16.weight.detach().clone()
    _attach_grads(fp16, grads, rank, scale=4.0)
    if rank == 1:
        fp16.norm_weight.grad[0] = float("inf")
    assert opt.step() == (False, None, None)
    assert torch.equal(fp16.weight, before)
    assert opt.get_loss_scale().item() == 2.0


def _tp2_checks():
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = parallel_state.get_tensor_model_parallel_rank()
    full, grads = _full_tensors()
    model = _ShardedToy(full["weight"], full["norm_weight"], full["tied"], rank, extra_bias=rank == 1)
    total_norm = _check_norms(model, grads, rank)
    model = _ShardedToy(full["weight"], full["norm_weight"], full["tied"], rank, extra_bias=False)
    _check_clipped_step(model, full, grads, rank, total_norm)
    _check_bf16_and_found_inf(full, grads, rank, total_norm)
    return total_norm


def test_grad_norm_clip_and_inf_check_across_tp2():
    # The first torch optimizer of a process imports torch._dynamo (seconds of CPU); do it once here
    # so the forked ranks inherit it instead of each paying for it.
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    results = run_on_ranks(_tp2_checks, 2, timeout=120)
    assert results[0] == pytest.approx(results[1])
