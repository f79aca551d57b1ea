"""`HybridDeviceOptimizer` (CPU offload) on CPU, single process: Megatron's split rule, equality with the plain
optimizer (fp32 params, bf16 params with fp32 masters, Adam and SGD, every offload fraction, with and without
the per-parameter host optimizers of the overlap mode), the state dict, and `get_megatron_optimizer` with it.

On a CPU-only run every param is a candidate for the host part, so the host copies, gradient downloads and
param uploads all run (as CPU -> CPU copies). The inner optimizers are the same torch kernels as the
reference's, so results are compared bit for bit; where Megatron's clipping takes a different route (the
plain fused AdamW divides inside its kernel, the hybrid optimizer multiplies the gradients first) the bound
is 2e-6 relative.
"""
import io

import pytest
import torch

from megatron.core.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer, OptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

SIZES = [(10,), (6, 5), (20,), (8, 5)]  # 10, 30, 20, 40 elements


def _params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype)) for shape in SIZES]


def _groups(params):
    return [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]


def _hybrid(params, cls, fraction, overlap, **kwargs):
    return HybridDeviceOptimizer(_groups(params), offload_fraction=fraction, cpu_optimizer_cls=cls,
                                 gpu_optimizer_cls=cls, param_update_in_fp32=True,
                                 overlap_cpu_optimizer_d2h_h2d=overlap, **kwargs)


def _grads(step, dtype):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=gen).to(dtype) for shape in SIZES]


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_split_follows_megatron_order_and_defaults():
    params = _params(torch.float32)
    opt = _hybrid(params, torch.optim.AdamW, 0.3, overlap=True, lr=0.1)
    # Threshold 0.3 * 100 elements: offload while fewer than 30 are offloaded -> the first two params (10 + 30).
    assert [opt.param_to_inner_param[p].device.type for p in params] == ["cpu"] * 4
    assert [opt.param_to_inner_param[p] is not p for p in params] == [True, True, False, False]
    assert len(opt.cpu_optimizers) == 2 and opt.gpu_optimizer is not None
    assert [len(g["params"]) for g in opt.gpu_optimizer.param_groups] == [2]
    assert opt.defaults["cpu_optimizer_cls"] is torch.optim.AdamW and opt.defaults["offload_fraction"] == 0.3
    assert all("cpu_optimizer_cls" not in g for g in opt.param_groups)
    rebuilt = HybridDeviceOptimizer(_groups(_params(torch.float32)), **opt.defaults)
    assert rebuilt.overlap_cpu_optimizer_d2h_h2d and len(rebuilt.cpu_optimizers) == 2
    single = _hybrid(_params(torch.float32), torch.optim.AdamW, 0.3, overlap=False, lr=0.1)
    assert len(single.cpu_optimizers) == 1 and [len(g["params"]) for g in single.cpu_optimizers[0].param_groups] == [2]
    assert _hybrid(_params(torch.float32), torch.optim.AdamW, 0.0, overlap=True, lr=0.1).cpu_optimizers == []
    assert _hybrid(_params(torch.float32), torch.optim.AdamW, 1.0, overlap=True, lr=0.1).gpu_optimizer is None
    with pytest.raises(ValueError, match="gpu_optimizer_cls"):
        HybridDeviceOptimizer(params, cpu_optimizer_cls=torch.optim.AdamW)


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=0.05, betas=(0.9, 0.95), eps=1e-8, fused=True)),
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
}


def _run_plain(name, dtype, steps, decoupled):
    """fp32 masters stepped by the plain optimizer; low-precision params get the rounded masters."""
    cls, kwargs = OPTIMIZERS[name]
    params = _params(dtype)
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = cls(_groups(masters), **kwargs)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = kwargs["lr"] / (step + 1)
        for master, grad in zip(masters, _grads(step, dtype)):
            master.grad = grad.float()
        opt.step()
    return [m.detach().to(dtype) for m in masters]


def _run_hybrid(name, dtype, fraction, overlap, steps, decoupled):
    cls, kwargs = OPTIMIZERS[name]
    params = _params(dtype)
    opt = _hybrid(params, cls, fraction, overlap, **kwargs)
    for step in range(steps):
        for group in opt.param_groups:  # what the LR scheduler does
            group["lr"] = kwargs["lr"] / (step + 1)
        for param, grad in zip(params, _grads(step, dtype)):
            if decoupled:
                param.decoupled_grad = grad.float()
            else:
                param.grad = grad
        opt.step()
        opt.zero_grad()
        assert all(p.grad is None and getattr(p, "decoupled_grad", None) is None for p in params)
    return params, opt


def test_every_fraction_matches_the_plain_optimizer_bit_for_bit():
    for name in OPTIMIZERS:
        for dtype in (torch.float32, torch.bfloat16):
            want = _run_plain(name, dtype, 3, False)
            for fraction in (0.0, 0.5, 1.0):
                for overlap in (False, True):
                    got, opt = _run_hybrid(name, dtype, fraction, overlap, 3, decoupled=overlap)
                    label = f"{name} {dtype} fraction {fraction} overlap {overlap}"
                    assert all(torch.equal(g.detach(), w) for g, w in zip(got, want)), label
                    state = opt.state[got[0]]
                    assert state["master_param"].dtype == torch.float32, label
                    if name == "adamw":
                        assert float(state["step"]) == 3.0 and state["exp_avg"].shape == SIZES[0], label


def test_state_dict_weights_only_round_trip_resumes_exactly():
    dtype = torch.bfloat16
    full, _ = _run_hybrid("adamw", dtype, 0.5, True, 4, decoupled=False)
    half, opt = _run_hybrid("adamw", dtype, 0.5, True, 2, decoupled=False)
    saved = _roundtrip(opt.state_dict())
    assert saved["state"][0]["master_param"].dtype == torch.float32
    assert [sorted(g) for g in saved["param_groups"]][0] == ["betas", "eps", "fused", "lr", "params", "weight_decay"]

    resumed = [torch.nn.Parameter(p.detach().clone()) for p in half]
    cls, kwargs = OPTIMIZERS["adamw"]
    new = _hybrid(resumed, cls, 0.5, True, **kwargs)
    new.dummy_step()
    assert all(torch.equal(a, b) for a, b in zip(resumed, half)), "dummy_step must not change params"
    assert float(new.state[resumed[0]]["step"]) == 0.0 and not new.state[resumed[0]]["exp_avg"].any()
    new.load_state_dict(saved)
    inner = new.param_to_inner_param[resumed[0]]
    assert inner.device.type == "cpu" and inner.dtype == torch.float32
    assert torch.equal(inner, opt.state[half[0]]["master_param"]), "the fp32 master comes from the checkpoint"
    for step in range(2, 4):
        for group in new.param_groups:
            group["lr"] = kwargs["lr"] / (step + 1)
        for param, grad in zip(resumed, _grads(step, dtype)):
            param.grad = grad
        new.step()
        new.zero_grad()
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(resumed, full))
    with pytest.raises(ValueError, match="grouping differ"):
        new.load_state_dict({**saved, "param_groups": saved["param_groups"][:1]})


def _train(dtype, offload, clip_grad, steps=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)
    extra = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5) if offload else {}
    config = OptimizerConfig(lr=1e-2, min_lr=1e-3, weight_decay=0.1, clip_grad=clip_grad, bf16=dtype == torch.bfloat16, **extra)
    opt = get_megatron_optimizer(config, [model])
    scheduler = OptimizerParamScheduler(opt, 0.0, 1e-2, 1e-3, 1, 4, "cosine", 0.1, 0.1, 4, "constant")
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(5, 8, generator=gen).to(dtype)
        model(x).float().square().mean().backward()
        opt.step()
        scheduler.step(1)
    return [p.detach().float() for p in model.parameters()], opt


def test_get_megatron_optimizer_with_offload_matches_without():
    for dtype, wrapper in ((torch.float32, FP32Optimizer), (torch.bfloat16, Float16OptimizerWithFloat16Params)):
        want, _ = _train(dtype, False, 0.0)
        got, opt = _train(dtype, True, 0.0)
        assert isinstance(opt, wrapper) and isinstance(opt.optimizer, HybridDeviceOptimizer)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), dtype
        want, _ = _train(dtype, False, 0.05)
        got, _ = _train(dtype, True, 0.05)
        for a, b in zip(got, want):
            tolerance = 2e-6 if dtype == torch.float32 else 1e-2  # bf16: a 1-ulp rounding flip of a model param
            assert (a - b).abs().max() <= tolerance * b.abs().max(), dtype
