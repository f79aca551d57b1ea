"""The fused AdamW + model-copy step (`fused_adamw`, Triton) on CUDA (skipped without a GPU or without Triton).

- It is AdamW to fp32 rounding: against AdamW computed in fp64 from the same fp32 inputs, the kernel with fp64
  moments (the default) is at most MAX_ULPS ulps of the largest term of each update off (H200, 2026-11-30:
  4.8 for params, 1.0 for moments), and with fp32 arithmetic no farther than torch's fused kernel on the same
  inputs (224 and 855 ulps where the update's terms cancel). The model copy is its fp32 result rounded to
  nearest even. The two kernels round differently (torch 2.11's computes in fp32, not as its 2023 source
  reads), so they are compared with the exact update, not with each other bit for bit.
- Through the Float16 and distributed optimizers, a few steps against torch's fused AdamW + copy: fp32 state
  within RELATIVE_STATE_TOLERANCE of each value (torch's rounding carried over steps), model copies within
  that plus one ulp (an fp32 difference flips a rounding now and then).

  python -m pytest -q tests/unit/optimizer/test_fused_adamw_gpu.py -s
"""
import functools
import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.optimizer import Float16OptimizerWithFloat16Params, OptimizerConfig, fused_adamw, get_megatron_optimizer
from tests.unit.distributed import dp_toy

pytestmark = pytest.mark.gpu

MAX_ULPS = 8.0  # against exact AdamW, in fp32 ulps of the largest term (the update alone rounds ~6 times)
RELATIVE_STATE_TOLERANCE = 3e-5  # fp32 state after a few steps through the optimizers (seen: 1.3e-5)


@pytest.fixture(autouse=True)
def _needs_triton():
    pytest.importorskip("triton")


@pytest.fixture(params=[True, False], ids=["fp64-math", "fp32-math"])
def fp64_math(request):
    return request.param


@pytest.fixture
def launches(fp64_math, monkeypatch):
    """Records the params the Triton kernel steps; runs the kernel with fp64 or fp32 arithmetic."""
    launched = []
    kernels = fused_adamw._triton_kernels()

    def spy(param, *args, **kwargs):
        launched.append(param)
        kernels.adamw_step(param, *args, fp64_math=fp64_math, **kwargs)

    monkeypatch.setattr(fused_adamw, "_launch_step", spy)
    return launched


def _ulp(values: torch.Tensor) -> torch.Tensor:
    """The spacing of the floating-point numbers of `values`' dtype at |values|, as fp64 (subnormal spacing
    near zero)."""
    info = torch.finfo(values.dtype)
    magnitude = values.detach().double().abs().clamp_min(info.tiny)
    return torch.exp2(torch.floor(torch.log2(magnitude))) * info.eps


def _assert_close_after_steps(actual, expected, what):
    """fp32: within RELATIVE_STATE_TOLERANCE of each value, or 1e-6 of the tensor's largest value near zero;
    fp16/bf16 model copies (roundings of such fp32 values): that plus one ulp of the larger of the two."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    a, b = actual.detach().flatten().double(), expected.detach().flatten().double()
    difference = (a - b).abs()
    allowed = torch.maximum(RELATIVE_STATE_TOLERANCE * b.abs(), 1e-6 * b.abs().max().clamp_min(1e-30))
    if expected.dtype != torch.float32:
        allowed = allowed + _ulp(torch.maximum(a.abs(), b.abs()).to(expected.dtype))
    worst = float((difference / allowed).max())
    assert worst <= 1.0, f"{what}: a difference of {worst:.2f} times the allowed one ({float(difference.max()):.3g})"
    differing = int((difference > 0).sum())
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


def _inputs(opt, params):
    """fp32 clones of (param, grad, exp_avg, exp_avg_sq, step) of each param before a step (zero moments and
    step before the first)."""
    rows = []
    for param in params:
        state = opt.state.get(param) or {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param),
                                         "step": torch.zeros((), device=param.device)}
        rows.append(tuple(t.detach().clone() for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"],
                                                        state["step"])))
    return rows


def _largest(*terms):
    return functools.reduce(torch.maximum, [term.abs() for term in terms])


def _unscaled(grad, grad_scale):
    """The fp32 grad divided by the fp32 `grad_scale`, rounded to fp32: what torch's kernel steps with and
    writes back (the fp64 quotient of two fp32 values rounds to the exactly rounded fp32 quotient)."""
    if grad_scale is None:
        return grad
    return (grad.double() / torch.tensor(grad_scale, dtype=torch.float32).item()).float()


def _exact_adamw(inputs, *, lr, weight_decay, grad_scale, beta1=0.9, beta2=0.95, eps=1e-8):
    """AdamW computed in fp64 from fp32 inputs: name -> (exact new value, largest term of its update)."""
    param, _, exp_avg, exp_avg_sq, step = (t.double() for t in inputs)
    grad = _unscaled(inputs[1], grad_scale).double()
    step = float(step) + 1
    decay = lr * weight_decay * param
    avg_terms = (beta1 * exp_avg, (1 - beta1) * grad)
    sq_terms = (beta2 * exp_avg_sq, (1 - beta2) * grad * grad)
    new_avg, new_sq = sum(avg_terms), sum(sq_terms)
    update = lr / (1 - beta1 ** step) * new_avg / (new_sq.sqrt() / math.sqrt(1 - beta2 ** step) + eps)
    return {"param": (param - decay - update, _largest(param, decay, update)),
            "exp_avg": (new_avg, _largest(*avg_terms)), "exp_avg_sq": (new_sq, _largest(*sq_terms))}


def _ulps_off(actual, exact, scale):
    """Largest |actual - exact| in fp32 ulps of `scale` (elementwise)."""
    return float(((actual.detach().double() - exact).abs() / _ulp(scale.float())).max())


def _stepped(opt, param):
    state = opt.state[param]
    return {"param": param, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}


# (grad scale, grad multiplier, lr multiplier) per step; 5300 is a clip of a grad norm of ~5300 down to 1.
STEPS = [(None, 1e-2, 1.0), (2.0, 1e-2, 0.5), (1.0, 1e-2, 0.25), (0.37, 1e-2, 2.0), (5300.0, 30.0, 1.0)]


def _step_both(opt, mains, models, ref_opt, ref_mains, ref_models, gen, grad_scale, grad_size, lr):
    """One step of the fused path and of torch's fused AdamW + copy, from their own states."""
    for optimizer in (opt, ref_opt):
        for group in optimizer.param_groups:
            group["lr"] = lr
        if grad_scale is not None:
            optimizer.grad_scale = torch.tensor([grad_scale], device="cuda")
    for main, ref in zip(mains, ref_mains):
        main.grad = torch.randn(main.shape, device="cuda", generator=gen) * grad_size
        ref.grad = main.grad.clone()
    before, ref_before = _inputs(opt, mains), _inputs(ref_opt, ref_mains)
    written = fused_adamw.step_with_model_copy(opt, mains, models)
    done = {id(p) for p in written}
    torch._foreach_copy_([m for m, p in zip(models, mains) if id(p) not in done],
                         [p.detach() for p in mains if id(p) not in done])
    ref_opt.step()
    torch._foreach_copy_(ref_models, [p.detach() for p in ref_mains])
    for optimizer in (opt, ref_opt):
        optimizer.__dict__.pop("grad_scale", None)
    return done, before, ref_before


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16])
def test_fused_step_is_adamw_to_fp32_rounding(model_dtype, launches, fp64_math):
    mains, models, opt = _raw_setup(model_dtype)
    ref_mains, ref_models, ref_opt = _raw_setup(model_dtype)
    decay = {id(p): group["weight_decay"] for group in opt.param_groups for p in group["params"]}
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step, (grad_scale, grad_size, lr_scale) in enumerate(STEPS):
        lr = 1e-3 * lr_scale
        done, before, ref_before = _step_both(opt, mains, models, ref_opt, ref_mains, ref_models, gen, grad_scale,
                                              grad_size, lr)
        assert done == {id(mains[i]) for i in range(3)}
        for index in range(3):
            main, ref = mains[index], ref_mains[index]
            hyper = dict(lr=lr, weight_decay=decay[id(main)], grad_scale=grad_scale)
            exact, ref_exact = _exact_adamw(before[index], **hyper), _exact_adamw(ref_before[index], **hyper)
            for name, actual in _stepped(opt, main).items():
                ours = _ulps_off(actual, *exact[name])
                theirs = _ulps_off(_stepped(ref_opt, ref)[name], *ref_exact[name])
                print(f"step {step} param {index} {name}: {ours:.2f} ulps off exact AdamW (torch: {theirs:.2f})")
                # fp32 arithmetic: the update's terms cancel now and then, as in torch's kernel
                limit = MAX_ULPS if fp64_math else max(MAX_ULPS, theirs)
                assert ours <= limit, f"step {step} param {index} {name}: {ours:.2f} ulps off"
            assert torch.equal(models[index], main.detach().to(model_dtype)), "the model copy is the rounded param"
            assert torch.equal(main.grad, _unscaled(before[index][1], grad_scale)), "the unscaled grad written back"
            assert torch.equal(opt.state[main]["step"], ref_opt.state[ref]["step"])
    assert len(launches) == 3 * len(STEPS)


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
            _assert_close_after_steps(mains[index], ref_mains[index], f"found_inf {found_inf} param {index}")
            _assert_close_after_steps(mains[index].grad, ref_mains[index].grad, f"found_inf {found_inf} grad {index}")
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
        _assert_close_after_steps(param, ref, name)
    for group, ref_group in zip(opt.param_groups, ref_opt.param_groups):
        for main, ref in zip(group["params"], ref_group["params"]):
            _assert_close_after_steps(main, ref, "main param")
            for key in ("exp_avg", "exp_avg_sq"):
                _assert_close_after_steps(opt.optimizer.state[main][key], ref_opt.optimizer.state[ref][key], key)


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
    # One step: the toy model's loss grows over steps (8 -> 20 at lr 3e-4, CPU), which magnifies one run's
    # roundings in the next step's grads. Steps with carried state are the raw tests' and the CPU tests' part.
    batches = dp_toy.global_batches(1, 4)
    results = {}
    for fused in (False, True):
        with monkeypatch.context() as patch:
            patch.setattr(fused_adamw, "_kernels_available", lambda: fused)
            model, ddp, opt = dp_toy.build(dict(use_distributed_optimizer=True, grad_reduce_in_fp32=True),
                                           dtype=torch.bfloat16, hidden=1024, device="cuda")
            losses = dp_toy.train_steps(ddp, opt, batches, 1)
        shards = [t.clone() for group in opt.shard_fp32_from_float16_groups for t in group]
        results[fused] = (losses, {name: p.detach().clone() for name, p in model.named_parameters()}, shards)
    assert len(launches) == 3  # the three 1024 x 1024 layer weights
    print("losses fused / torch:", results[True][0], results[False][0])
    for name, value in results[False][1].items():
        _assert_close_after_steps(results[True][1][name], value, name)
    for index, (a, b) in enumerate(zip(results[True][2], results[False][2])):
        _assert_close_after_steps(a, b, f"main shard {index}")
