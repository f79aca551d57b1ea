"""The fused AdamW + model-copy step (`fused_adamw`, Triton) on CUDA against torch's fused AdamW followed by
`torch._foreach_copy_` (skipped without a GPU or without Triton).

Not bit for bit: on an H200 with torch 2.11 the first version (fp64 moments, as torch's CUDA source of 2023
reads) differed from torch's kernel in the last bit of nearly every moment (2026-11-30,
`benchmarks/gpu/adam_bench.py`). Both paths are AdamW in fp32 with different roundings, so every fp32 tensor
must agree to within a few ulps of each value (or of the tensor's scale, for values near zero) and the
fp16/bf16 model copies within one ulp in a small fraction of the elements; the tests print how many differ.

  python -m pytest -q tests/unit/optimizer/test_fused_adamw_gpu.py -s
"""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.optimizer import Float16OptimizerWithFloat16Params, OptimizerConfig, fused_adamw, get_megatron_optimizer
from tests.unit.distributed import dp_toy

pytestmark = pytest.mark.gpu

MAX_ULPS = 4  # fp32 tensors: roundings that differ at each of a few steps
MAX_DIFFERING_HALF_FRACTION = 1e-3  # fp16/bf16 model copies: an fp32 difference moves a rounding now and then


@pytest.fixture(autouse=True)
def _needs_triton():
    pytest.importorskip("triton")


@pytest.fixture(params=[True, False], ids=["fp64-math", "fp32-math"])
def launches(request, monkeypatch):
    """Records the params the Triton kernel steps; runs the kernel with fp64 or fp32 arithmetic."""
    launched = []
    kernels = fused_adamw._triton_kernels()

    def spy(param, *args, **kwargs):
        launched.append(param)
        kernels.adamw_step(param, *args, fp64_math=request.param, **kwargs)

    monkeypatch.setattr(fused_adamw, "_launch_step", spy)
    return launched


def _ulp(values: torch.Tensor) -> torch.Tensor:
    """The spacing of the floating-point numbers of `values`' dtype at |values|, as fp64 (subnormal spacing
    near zero)."""
    info = torch.finfo(values.dtype)
    magnitude = values.detach().double().abs().clamp_min(info.tiny)
    return torch.exp2(torch.floor(torch.log2(magnitude))) * info.eps


def _assert_nearly_identical(actual, expected, what):
    """fp32: within MAX_ULPS ulps of each value, or 1e-6 of the tensor's largest value near zero; fp16/bf16:
    within one ulp, and equal in all but MAX_DIFFERING_HALF_FRACTION of the elements."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    a, b = actual.detach().flatten(), expected.detach().flatten()
    difference = (a.double() - b.double()).abs()
    differing = int((difference > 0).sum())
    if expected.dtype == torch.float32:
        allowed = torch.maximum(MAX_ULPS * _ulp(b), 1e-6 * b.double().abs().max().clamp_min(1e-30))
    else:
        allowed = _ulp(b)
        limit = max(1, MAX_DIFFERING_HALF_FRACTION * a.numel())
        assert differing <= limit, f"{what}: {differing} of {a.numel()} differ"
    worst = float((difference / allowed).max())
    assert worst <= 1.0, f"{what}: a difference of {worst:.2f} times the allowed one ({float(difference.max()):.3g})"
    if differing:
        print(f"{what}: {differing} of {a.numel()} elements differ, at most {worst:.2f} of the allowed difference")


SHAPES = [(2048, 1024), (1536, 1536), (3001, 701), (1000,), (64, 64), (4096,)]


def _raw_setup(model_dtype, seed=0):
    """fp32 main params (big, odd-sized and small) in two weight-decay groups, their model copies, fused AdamW."""
    torch.manual_seed(seed)
    mains = [(torch.randn(shape, device="cuda") * 0.02).requires_grad_() for shape in SHAPES]
    models = [main.detach().to(model_dtype) for main in mains]
    # Big params in both groups (the kernel with and without weight decay), small ones in both.
    groups = [{"params": [mains[0], mains[1], mains[4]], "weight_decay": 0.1},
              {"params": [mains[2], mains[3], mains[5]], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    return mains, models, opt


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16])
def test_fused_step_matches_torch_fused_adamw_and_copy(model_dtype, launches):
    mains, models, opt = _raw_setup(model_dtype)
    ref_mains, ref_models, ref_opt = _raw_setup(model_dtype)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step, grad_scale in enumerate([None, 2.0, 1.0, 0.37, None]):
        for optimizer in (opt, ref_opt):
            for group in optimizer.param_groups:
                group["lr"] = 1e-3 * (1.0, 0.5, 0.25, 2.0, 1.0)[step]
            if grad_scale is not None:
                optimizer.grad_scale = torch.tensor([grad_scale], device="cuda")
        for main, ref in zip(mains, ref_mains):
            main.grad = torch.randn(main.shape, device="cuda", generator=gen) * 1e-2
            ref.grad = main.grad.clone()
        written = fused_adamw.step_with_model_copy(opt, mains, models)
        done = {id(p) for p in written}
        torch._foreach_copy_([m for m, p in zip(models, mains) if id(p) not in done],
                             [p.detach() for p in mains if id(p) not in done])
        ref_opt.step()
        torch._foreach_copy_(ref_models, [p.detach() for p in ref_mains])
        for optimizer in (opt, ref_opt):
            optimizer.__dict__.pop("grad_scale", None)
        assert done == {id(mains[i]) for i in range(3)}
        for index, (main, ref) in enumerate(zip(mains, ref_mains)):
            _assert_nearly_identical(main, ref, f"step {step} param {index}")
            _assert_nearly_identical(main.grad, ref.grad, f"step {step} grad {index}")
            _assert_nearly_identical(models[index], ref_models[index], f"step {step} model {index}")
            for key in ("exp_avg", "exp_avg_sq"):
                _assert_nearly_identical(opt.state[main][key], ref_opt.state[ref][key], f"step {step} {key} {index}")
            assert torch.equal(opt.state[main]["step"], ref_opt.state[ref]["step"])
    assert len(launches) == 15


def test_found_inf_skips_the_update_like_torch(launches):
    mains, models, opt = _raw_setup(torch.bfloat16)
    ref_mains, ref_models, ref_opt = _raw_setup(torch.bfloat16)
    for found_inf in (0.0, 1.0, 1.0, 0.0):
        for main, ref in zip(mains, ref_mains):
            main.grad = torch.full_like(main, 0.01)
            ref.grad = main.grad.clone()
        for optimizer in (opt, ref_opt):
            optimizer.grad_scale = torch.tensor(4.0, device="cuda")
            optimizer.found_inf = torch.tensor(found_inf, device="cuda")
        written = fused_adamw.step_with_model_copy(opt, mains, models)
        assert len(written) == 3
        ref_opt.step()
        for index in range(3):
            _assert_nearly_identical(mains[index], ref_mains[index], f"found_inf {found_inf} param {index}")
            _assert_nearly_identical(mains[index].grad, ref_mains[index].grad, f"found_inf {found_inf} grad {index}")
            assert torch.equal(opt.state[mains[index]]["step"], ref_opt.state[ref_mains[index]]["step"])
    assert opt.state[mains[0]]["step"].item() == 2.0


class _Net(torch.nn.Module):
    """Two weights the kernel takes (2M and 1M elements), small biases and an fp32 norm."""

    def __init__(self, dtype):
        super().__init__()
        self.fc1 = torch.nn.Linear(1024, 2048)
        self.fc2 = torch.nn.Linear(2048, 512)
        self.to(device="cuda", dtype=dtype)
        self.norm = torch.nn.LayerNorm(512, device="cuda")


def _float16_run(dtype, steps=3):
    torch.manual_seed(0)
    model = _Net(dtype)
    precision = {"fp16": True, "initial_loss_scale": 2.0 ** 10} if dtype == torch.float16 else {"bf16": True}
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, weight_decay=0.1, clip_grad=1.0, **precision), [model])
    assert isinstance(opt, Float16OptimizerWithFloat16Params)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = 1e-3 / (step + 1)
            group["weight_decay"] = 0.1 * group["wd_mult"]
        opt.zero_grad()
        for param in model.parameters():
            grad = torch.randn(param.shape, device="cuda", generator=gen) * (3.0 if step == 0 else 1e-3)
            param.grad = (grad * opt.get_loss_scale()).to(param.dtype)
        assert opt.step()[0]
    return model, opt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float16_optimizer_on_cuda(dtype, launches, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(fused_adamw, "_kernels_available", lambda: False)
        ref_model, ref_opt = _float16_run(dtype)
    assert not launches
    model, opt = _float16_run(dtype)
    assert len(launches) == 6
    for (name, param), ref in zip(model.named_parameters(), ref_model.parameters()):
        _assert_nearly_identical(param, ref, name)
    for group, ref_group in zip(opt.param_groups, ref_opt.param_groups):
        for main, ref in zip(group["params"], ref_group["params"]):
            _assert_nearly_identical(main, ref, "main param")
            for key in ("exp_avg", "exp_avg_sq"):
                _assert_nearly_identical(opt.optimizer.state[main][key], ref_opt.optimizer.state[ref][key], key)


@pytest.fixture
def nccl_world_of_one():
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        yield
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_distributed_optimizer_on_cuda(nccl_world_of_one, launches, monkeypatch):
    batches = dp_toy.global_batches(3, 4)
    results = {}
    for fused in (False, True):
        with monkeypatch.context() as patch:
            patch.setattr(fused_adamw, "_kernels_available", lambda: fused)
            model, ddp, opt = dp_toy.build(dict(use_distributed_optimizer=True, grad_reduce_in_fp32=True),
                                           dtype=torch.bfloat16, hidden=1024, device="cuda")
            losses = dp_toy.train_steps(ddp, opt, batches, 1)
        shards = [t.clone() for group in opt.shard_fp32_from_float16_groups for t in group]
        results[fused] = (losses, {name: p.detach().clone() for name, p in model.named_parameters()}, shards)
    assert len(launches) == 3 * 3  # the three 1024 x 1024 layer weights, three steps
    print("losses fused / torch:", results[True][0], results[False][0])
    for name, value in results[False][1].items():
        _assert_nearly_identical(results[True][1][name], value, name)
    for index, (a, b) in enumerate(zip(results[True][2], results[False][2])):
        _assert_nearly_identical(a, b, f"main shard {index}")
