"""The AdamW step fused with the model-param copy (`megatron.core.optimizer.fused_adamw`), on CPU.

- The kernel's arithmetic (`adamw_step_reference`) against torch.optim.AdamW over several steps with two
  weight-decay groups, a grad scale and a changing lr. On CPU torch computes the moments in fp32, the
  reference in fp64 (as torch's CUDA source of 2023 reads; torch 2.11's CUDA kernel rounds otherwise, see
  test_fused_adamw_gpu.py), so they agree within a few ulps of each tensor's magnitude.
- The dispatch: which optimizers and params take the fused path; everything else is today's step.
- The orchestration (state creation, step counters, grad_scale / found_inf, which model params are written,
  the copy of the others) through the real Float16OptimizerWithFloat16Params and DistributedOptimizer, with
  torch's own fused kernel standing in for the Triton launch: bit-identical to `optimizer.step()` + the copy.
- Where Triton is installed (not in CI): the Triton kernel under TRITON_INTERPRET=1 against the reference, and
  compiled ahead of time for sm_90 (exact division and sqrt, round-to-nearest conversions, vectorized access).
"""
import copy
import os
import subprocess
import sys
from typing import Optional

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from megatron.core import parallel_state
from megatron.core.optimizer import Float16OptimizerWithFloat16Params, OptimizerConfig, fused_adamw, get_megatron_optimizer
from tests.harness import load_interpreted, run_on_ranks
from tests.unit.distributed import dp_toy
from tests.unit.optimizer.test_optimizer_syncfree import _no_host_reads


def adamw_step_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                         step: torch.Tensor, *, lr: float, beta1: float, beta2: float, weight_decay: float,
                         eps: float, grad_scale: Optional[torch.Tensor] = None,
                         found_inf: Optional[torch.Tensor] = None) -> None:
    """The kernel's arithmetic (`fp64_math=True`) in PyTorch ops, in place on fp32 tensors of any device: the
    executable specification the tests hold the kernel and torch's AdamW to. `step` is already incremented.
    Where torch's CUDA kernel computes in fp64 this does too; fp32 square roots go through fp64 because
    PyTorch's CPU fp32 `sqrt` is not exactly rounded (CUDA's and the kernel's are)."""
    if found_inf is not None and bool(found_inf.reshape(()) == 1):
        return  # torch's kernel skips the whole update (its grad write-back too)
    if grad_scale is not None:
        grad.div_(grad_scale.reshape(()).to(grad.device))
    if weight_decay != 0:
        param64 = param.double()
        param.copy_(param64 - (lr * weight_decay) * param64)
    grad64 = grad.double()
    exp_avg.copy_(beta1 * exp_avg.double() + (1 - beta1) * grad64)
    exp_avg_sq.copy_(beta2 * exp_avg_sq.double() + (1 - beta2) * grad64 * grad64)
    step64 = step.double().reshape(())
    bias_correction1 = (1 - torch.exp2(step64 * torch.log2(torch.tensor(beta1, dtype=torch.float64)))).float()
    bias_correction2_sqrt = torch.sqrt(1 - torch.exp2(step64 * torch.log2(torch.tensor(beta2, dtype=torch.float64))))
    step_size = (lr / bias_correction1.double()).float().to(param.device)
    root = exp_avg_sq.double().sqrt().float() / bias_correction2_sqrt.float().to(param.device)
    denom = (root.double() + eps).float()
    param.sub_(step_size * exp_avg / denom)

HYPER = dict(beta1=0.9, beta2=0.95, eps=1e-8)
SMALL_MIN_NUMEL = 256


def _torch_kernel(param, grad, exp_avg, exp_avg_sq, model_param, step, *, lr, beta1, beta2, weight_decay, eps,
                  grad_scale=None, found_inf=None):
    """The Triton launch's contract with torch's own fused kernel on one tensor (CPU stand-in)."""
    torch._fused_adamw_([param], [grad], [exp_avg], [exp_avg_sq], [], [step], lr=lr, beta1=beta1, beta2=beta2,
                        weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False, grad_scale=grad_scale,
                        found_inf=found_inf)
    if found_inf is None or found_inf.item() != 1:
        model_param.copy_(param.view_as(model_param))


def _enable_on_cpu(launch):
    """Module attributes that let the fused path run on CPU tensors with `launch` as the kernel."""
    return {"_kernels_available": lambda: True, "_kernel_device": lambda tensor: True, "_launch_step": launch,
            "FUSED_COPY_MIN_NUMEL": SMALL_MIN_NUMEL}


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """The fused path on CPU with torch's kernel per tensor; returns the list of params launched."""
    launched = []

    def launch(param, *args, **kwargs):
        launched.append(param)
        _torch_kernel(param, *args, **kwargs)

    for name, value in _enable_on_cpu(launch).items():
        monkeypatch.setattr(fused_adamw, name, value)
    return launched


def _ulps_of_magnitude(actual, expected):
    """max |actual - expected| in units of the fp32 spacing at max |expected|."""
    spacing = expected.abs().max().clamp_min(1e-30).double() * 2.0 ** -23
    return ((actual.double() - expected.double()).abs().max() / spacing).item()


def test_reference_arithmetic_matches_torch_adamw():
    torch.manual_seed(0)
    shapes, decays = [(300, 200), (1000,), (64, 64)], [0.1, 0.1, 0.0]
    params = [torch.randn(shape) * 0.02 for shape in shapes]
    mine = [param.clone() for param in params]
    states = [dict(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p), step=torch.zeros(())) for p in mine]
    opt = torch.optim.AdamW([{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}],
                            lr=1e-3, betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"], fused=True)
    for step in range(6):
        lr = 1e-3 * (1 + step)
        for group in opt.param_groups:
            group["lr"] = lr
        grads = [torch.randn(shape) * 1e-2 for shape in shapes]
        grad_scale = {2: torch.tensor([2.5]), 3: torch.tensor([1.0])}.get(step)
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        if grad_scale is not None:
            opt.grad_scale = grad_scale
        opt.step()
        opt.__dict__.pop("grad_scale", None)
        for index, (param, grad, state, decay) in enumerate(zip(mine, grads, states, decays)):
            state["step"] += 1
            adamw_step_reference(param, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], lr=lr,
                                             weight_decay=decay, grad_scale=grad_scale, **HYPER)
            assert torch.equal(grad, params[index].grad)  # unscaled and written back as torch does
    for param, ref, state in zip(params, mine, states):
        assert _ulps_of_magnitude(ref, param) <= 4
        for key in ("exp_avg", "exp_avg_sq"):
            assert _ulps_of_magnitude(state[key], opt.state[param][key]) <= 4, key
        assert torch.equal(opt.state[param]["step"], torch.tensor(6.0))


def _one_param_adam(cls=torch.optim.AdamW, **kwargs):
    kwargs.setdefault("fused", True)
    return cls([torch.zeros(4, requires_grad=True)], lr=kwargs.pop("lr", 1e-3), **kwargs)


class _MyAdamW(torch.optim.AdamW):
    """A subclass may change the step: it keeps torch's path."""


def _patched_step(opt):
    original = opt.step
    opt.step = lambda *args, **kwargs: original(*args, **kwargs)
    return opt


def _with_pre_hook(opt):
    opt.register_step_pre_hook(lambda *args: None)
    return opt


@pytest.mark.parametrize("build,expected", [
    (lambda: _one_param_adam(), True),
    (lambda: _one_param_adam(torch.optim.Adam, weight_decay=0.0), True),
    (lambda: _one_param_adam(torch.optim.Adam, weight_decay=0.1), False),
    (lambda: _one_param_adam(fused=False, foreach=True), False),
    (lambda: _one_param_adam(fused=None), False),
    (lambda: _one_param_adam(amsgrad=True), False),
    (lambda: _one_param_adam(maximize=True), False),
    (lambda: _one_param_adam(lr=torch.tensor(1e-3)), False),
    (lambda: _one_param_adam(_MyAdamW), False),
    (lambda: _patched_step(_one_param_adam()), False),
    (lambda: _with_pre_hook(_one_param_adam()), False),
    (lambda: torch.optim.SGD([torch.zeros(4, requires_grad=True)], lr=0.1), False),
])
def test_which_optimizers_take_the_fused_path(build, expected):
    assert fused_adamw.optimizer_supported(build()) is expected


def test_grad_scale_found_inf_and_global_hooks_decide_too():
    opt = _one_param_adam()
    opt.grad_scale = torch.ones(1)
    opt.found_inf = torch.zeros(())
    assert fused_adamw.optimizer_supported(opt)
    opt.grad_scale = torch.ones(1, dtype=torch.float64)
    assert not fused_adamw.optimizer_supported(opt)
    del opt.grad_scale
    handle = register_optimizer_step_post_hook(lambda *args: None)
    try:
        assert not fused_adamw.optimizer_supported(opt)
    finally:
        handle.remove()
    assert fused_adamw.optimizer_supported(opt)


def _param_with_grad(shape=(SMALL_MIN_NUMEL, 2), dtype=torch.float32, transposed_grad=False):
    param = torch.zeros(shape, dtype=dtype, requires_grad=True)
    param.grad = torch.zeros(shape[::-1], dtype=dtype).t() if transposed_grad else torch.zeros(shape, dtype=dtype)
    return param


def test_which_params_take_the_kernel(fused_on_cpu):
    param = _param_with_grad()
    model = torch.zeros(param.shape, dtype=torch.bfloat16)
    takes = fused_adamw._takes_kernel
    assert takes(param, model, None) and takes(param, model.half(), {})
    assert not takes(param, None, None)
    assert not takes(_param_with_grad((SMALL_MIN_NUMEL - 1,)), torch.zeros(SMALL_MIN_NUMEL - 1).bfloat16(), None)
    assert not takes(param, model.float(), None)
    assert not takes(param, torch.zeros(2, SMALL_MIN_NUMEL, dtype=torch.bfloat16).t(), None)
    assert not takes(param, torch.zeros(4 * SMALL_MIN_NUMEL, dtype=torch.bfloat16)[::2], None)
    assert not takes(_param_with_grad(transposed_grad=True), model, None)
    assert not takes(_param_with_grad(dtype=torch.float64), model, None)
    state = {"step": torch.zeros(()), "exp_avg": torch.zeros(param.shape), "exp_avg_sq": torch.zeros(param.shape)}
    assert takes(param, model, state)
    assert not takes(param, model, dict(state, step=torch.zeros((), dtype=torch.float64)))
    assert not takes(param, model, dict(state, exp_avg=torch.zeros(2, SMALL_MIN_NUMEL).t()))


class _Net(torch.nn.Module):
    """Params the kernel takes (the two weights, the embedding), small ones (biases) and an fp32 norm."""

    def __init__(self, dtype):
        super().__init__()
        self.embedding = torch.nn.Embedding(32, 16)
        self.fc1 = torch.nn.Linear(16, 64)
        self.fc2 = torch.nn.Linear(64, 16)
        self.to(dtype)
        self.norm = torch.nn.LayerNorm(16)


def _build(dtype, seed=0, **config):
    torch.manual_seed(seed)
    model = _Net(dtype)
    precision = {"fp16": True, "initial_loss_scale": 2.0 ** 8} if dtype == torch.float16 else {"bf16": True}
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0, **precision, **config),
                                 [model])
    for group in opt.param_groups:
        group["weight_decay"] = 0.1 * group["wd_mult"]
    return model, opt


def _train(model, opt, steps, seed=1):
    """Random grads (a large first step, so that clipping acts) and a decaying lr, as a scheduler sets it."""
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = 1e-2 / (step + 1)
        opt.zero_grad()
        for param in model.parameters():
            grad = torch.randn(param.shape, generator=gen) * (10.0 if step == 0 else 1e-3)
            param.grad = (grad * opt.get_loss_scale().item()).to(param.dtype)
        assert opt.step()[0]


def _assert_same_state(opt_a, opt_b):
    for group_a, group_b in zip(opt_a.param_groups, opt_b.param_groups):
        for param_a, param_b in zip(group_a["params"], group_b["params"]):
            assert torch.equal(param_a, param_b)
            state_a, state_b = opt_a.optimizer.state[param_a], opt_b.optimizer.state[param_b]
            assert state_a.keys() == state_b.keys()
            for key in state_a:
                assert state_a[key].dtype == state_b[key].dtype and state_a[key].shape == state_b[key].shape
                assert torch.equal(state_a[key], state_b[key]), key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float16_optimizer_fused_step_is_the_plain_step(dtype, fused_on_cpu, monkeypatch):
    model, opt = _build(dtype)
    ref_model, ref_opt = _build(dtype)
    assert isinstance(opt, Float16OptimizerWithFloat16Params)
    with monkeypatch.context() as patch:
        patch.setattr(fused_adamw, "_kernels_available", lambda: False)
        _train(ref_model, ref_opt, 3)
    with _no_host_reads() if dtype == torch.bfloat16 else torch.no_grad():
        _train(model, opt, 3)
    big = {id(main) for main, model_param in zip(*opt._get_main_params_and_model_data_float16())
           if model_param.numel() >= SMALL_MIN_NUMEL}
    assert len(big) == 3 and {id(p) for p in fused_on_cpu} == big and len(fused_on_cpu) == 9
    for param, ref in zip(model.parameters(), ref_model.parameters()):
        assert param.dtype == ref.dtype and torch.equal(param, ref)
    _assert_same_state(opt, ref_opt)
    state, ref_state = opt.state_dict(), ref_opt.state_dict()
    assert state["optimizer"]["param_groups"] == ref_state["optimizer"]["param_groups"]
    assert all(entry["step"].dtype == torch.float32 and entry["step"].dim() == 0
               for entry in state["optimizer"]["state"].values())
    assert "grad_scale" not in opt.optimizer.__dict__


def test_unsupported_settings_keep_todays_step(fused_on_cpu, monkeypatch):
    model, opt = _build(torch.bfloat16)
    ref_model, ref_opt = _build(torch.bfloat16)
    for optimizer in (opt, ref_opt):
        for group in optimizer.param_groups:
            group["amsgrad"] = True
    with monkeypatch.context() as patch:
        patch.setattr(fused_adamw, "_kernels_available", lambda: False)
        _train(ref_model, ref_opt, 2)
    _train(model, opt, 2)
    assert not fused_on_cpu
    for param, ref in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(param, ref)
    _assert_same_state(opt, ref_opt)


def test_without_triton_nothing_is_done(monkeypatch):
    monkeypatch.setattr(fused_adamw, "_kernels_available", lambda: False)
    param = _param_with_grad((SMALL_MIN_NUMEL * 8,))
    opt = torch.optim.AdamW([param], lr=1e-3, fused=True)
    model = torch.zeros(param.shape, dtype=torch.bfloat16)
    assert fused_adamw.step_with_model_copy(opt, [param], [model]) is None
    assert not opt.state and torch.equal(param, torch.zeros_like(param)) and not model.any()


def _raw_pair(seed):
    torch.manual_seed(seed)
    params = [(torch.randn(32, 16) * 0.02).requires_grad_(), (torch.randn(10) * 0.02).requires_grad_()]
    models = [p.detach().bfloat16() for p in params]
    opt = torch.optim.AdamW([{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}],
                            lr=1e-2, betas=(HYPER["beta1"], HYPER["beta2"]), fused=True)
    return params, models, opt


def test_grad_scale_and_found_inf_as_torch(fused_on_cpu):
    params, models, opt = _raw_pair(0)
    ref_params, ref_models, ref_opt = _raw_pair(0)
    settings = [(torch.tensor([2.0]), torch.tensor(0.0)), (torch.tensor([2.0]), torch.tensor(1.0)),
                (None, torch.tensor(1.0)), (torch.tensor([0.5]), None), (None, None)]
    for step, (grad_scale, found_inf) in enumerate(settings):
        for index, (param, ref) in enumerate(zip(params, ref_params)):
            param.grad = torch.full(param.shape, 0.1 * (step + 1) * (index + 1))
            ref.grad = param.grad.clone()
        for optimizer in (opt, ref_opt):
            optimizer.__dict__.update(grad_scale=grad_scale, found_inf=found_inf)
        written = fused_adamw.step_with_model_copy(opt, params, models)
        assert [id(p) for p in written] == [id(params[0])]
        models[1].copy_(params[1])
        ref_opt.step()
        torch._foreach_copy_(ref_models, [p.detach() for p in ref_params])
        for a, b in zip(params + models + [p.grad for p in params], ref_params + ref_models + [p.grad for p in ref_params]):
            assert torch.equal(a, b)
        for a, b in zip(params, ref_params):
            assert all(torch.equal(opt.state[a][k], ref_opt.state[b][k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    assert opt.state[params[0]]["step"].item() == 3.0


def _distopt_rank(launched_counts):
    """DP=2 with the distributed optimizer (bf16 params, fp32 main shards): fused path vs today's step."""
    parallel_state.initialize_model_parallel()
    batches = dp_toy.global_batches(3, 4)
    launched = []

    def launch(param, *args, **kwargs):
        launched.append(param)
        _torch_kernel(param, *args, **kwargs)

    results = {}
    for fused in (False, True):
        for name, value in _enable_on_cpu(launch).items():
            setattr(fused_adamw, name, value)
        fused_adamw._kernels_available = lambda: fused
        model, ddp, opt = dp_toy.build(dict(use_distributed_optimizer=True), dtype=torch.bfloat16, hidden=64)
        losses = dp_toy.train_steps(ddp, opt, batches, 1)
        shards = [t.clone() for group in opt.shard_fp32_from_float16_groups for t in group]
        results[fused] = (losses, dp_toy.params_of(model), shards)
    assert results[True][0] == results[False][0]
    for name, value in results[False][1].items():
        assert torch.equal(results[True][1][name], value), name
    assert all(torch.equal(a, b) for a, b in zip(results[True][2], results[False][2]))
    assert len(launched) >= launched_counts
    return len(launched)


def test_distributed_optimizer_fused_step_is_the_plain_step():
    counts = run_on_ranks(_distopt_rank, 2, 3, timeout=180)
    assert all(count >= 3 for count in counts)


def test_importing_the_optimizer_does_not_import_triton():
    code = "import sys, megatron.core.optimizer; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__))))))


# --------------------------------------------------------------------------------------------------
# The Triton kernel itself (skipped where Triton is not installed)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interpreted():
    """A copy of `_adamw_triton` whose kernels run in Triton's interpreter (numpy, on CPU tensors)."""
    pytest.importorskip("triton")
    path = os.path.join(os.path.dirname(fused_adamw.__file__), "_adamw_triton.py")
    module = load_interpreted(path, "_adamw_triton_interpreted")
    if not _interpreter_runs_runtime_loops(module):
        pytest.skip("this Triton's interpreter cannot run loops with runtime bounds (Triton 3.6: a program id's "
                    "`__index__` fails on its one-element array); the kernel cannot be interpreted here")
    return module


def _interpreter_runs_runtime_loops(module) -> bool:
    """Whether the interpreted kernel runs at all on a tiny tensor (its block loop has runtime bounds)."""
    tensors = [torch.zeros(8) for _ in range(4)]
    try:
        module.adamw_step(*tensors, torch.zeros(8, dtype=torch.float16), torch.ones(()), lr=1e-3, beta1=0.9,
                          beta2=0.95, weight_decay=0.0, eps=1e-8)
    except Exception as error:  # the interpreter's own failure, whatever its type
        return "0-dimensional" not in str(error)
    return True


def _operands(numel, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen) * scale for scale in (0.02, 1e-3, 1e-4)] + \
        [torch.rand(numel, generator=gen) * 1e-7]


def _assert_model_copy(model_param, param):
    """fp16 exactly; bf16 within one bf16 step: the interpreter truncates fp32 -> bf16 (the GPU kernel rounds
    to nearest even, see the compile test)."""
    if model_param.dtype == torch.float16:
        assert torch.equal(model_param, param.half())
    else:
        spacing = param.abs().clamp_min(1e-30) * 2.0 ** -7
        assert ((model_param.float() - param).abs() <= spacing).all()


@pytest.mark.parametrize("numel", [5000, 3 * 512, 300])
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16])
def test_interpreted_kernel_is_the_reference(interpreted, numel, model_dtype):
    for grad_scale, weight_decay in ((torch.tensor([2.5]), 0.1), (None, 0.0), (torch.tensor([1.0]), 0.1)):
        param, grad, exp_avg, exp_avg_sq = _operands(numel)
        expected = [t.clone() for t in (param, grad, exp_avg, exp_avg_sq)]
        step = torch.tensor(3.0)
        model_param = torch.empty(numel, dtype=model_dtype)
        interpreted.adamw_step(param, grad, exp_avg, exp_avg_sq, model_param, step, lr=3e-4, weight_decay=weight_decay,
                               grad_scale=grad_scale, block=512, blocks_per_program=2, **HYPER)
        adamw_step_reference(*expected, step, lr=3e-4, weight_decay=weight_decay, grad_scale=grad_scale,
                                         **HYPER)
        for actual, wanted in zip((param, grad, exp_avg, exp_avg_sq), expected):
            assert torch.equal(actual, wanted)
        _assert_model_copy(model_param, param)


def test_interpreted_kernel_found_inf_and_fp32_arithmetic(interpreted):
    operands = _operands(2000)
    before = [t.clone() for t in operands]
    model_param = torch.full((2000,), 7.0, dtype=torch.bfloat16)
    kwargs = dict(lr=3e-4, weight_decay=0.1, grad_scale=torch.tensor([2.0]), block=512, blocks_per_program=1, **HYPER)
    interpreted.adamw_step(*operands, model_param, torch.tensor(2.0), found_inf=torch.tensor([1.0]), **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(operands, before)) and (model_param == 7).all()
    interpreted.adamw_step(*operands, model_param, torch.tensor(2.0), found_inf=torch.tensor([0.0]), **kwargs)
    fp32 = [t.clone() for t in before]
    interpreted.adamw_step(*fp32, model_param, torch.tensor(2.0), fp64_math=False, **kwargs)
    for actual, wanted in zip(fp32, operands):
        assert _ulps_of_magnitude(actual, wanted) <= 2
    assert not torch.equal(operands[0], before[0])


def test_interpreted_kernel_in_the_float16_optimizer(interpreted, monkeypatch):
    model, opt = _build(torch.bfloat16)
    ref_model, ref_opt = _build(torch.bfloat16)
    with monkeypatch.context() as patch:
        patch.setattr(fused_adamw, "_kernels_available", lambda: False)
        _train(ref_model, ref_opt, 3)
    for name, value in _enable_on_cpu(interpreted.adamw_step).items():
        monkeypatch.setattr(fused_adamw, name, value)
    _train(model, opt, 3)
    mains = [p for group in opt.param_groups for p in group["params"]]
    ref_mains = [p for group in ref_opt.param_groups for p in group["params"]]
    for main, ref in zip(mains, ref_mains):
        assert _ulps_of_magnitude(main, ref) <= 4
        assert torch.equal(opt.optimizer.state[main]["step"], ref_opt.optimizer.state[ref]["step"])
    for param, main in zip(*opt._get_main_params_and_model_data_float16()[::-1]):
        _assert_model_copy(param.view(-1), main.detach().view(-1))


def _compile_ptx(model_type, fp64_math, grad_scale=True, found_inf=True, n_type="i32"):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megatron.core.optimizer import _adamw_triton

    names = ["param_ptr", "grad_ptr", "exp_avg_ptr", "exp_avg_sq_ptr", "model_ptr", "step_ptr", "grad_scale_ptr",
             "found_inf_ptr"]
    signature = {name: "*fp32" for name in names}
    signature.update(model_ptr=f"*{model_type}", n=n_type)
    signature.update({name: "i64" for name in ("lr_bits", "beta1_bits", "beta2_bits", "weight_decay_bits", "eps_bits")})
    constexprs = dict(HAS_GRAD_SCALE=grad_scale, HAS_FOUND_INF=found_inf, HAS_WEIGHT_DECAY=True, FP64_MATH=fp64_math,
                      BLOCK=_adamw_triton._BLOCK, BLOCKS_PER_PROGRAM=_adamw_triton._BLOCKS_PER_PROGRAM)
    signature.update({name: "constexpr" for name in constexprs})
    # What the launcher specializes at run time for 16-byte aligned tensors.
    attrs = {(index,): [["tt.divisibility", 16]] for index in range(len(names))}
    source = ASTSource(fn=_adamw_triton._adamw_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": _adamw_triton._WARPS})
    return compiled.asm["ptx"], compiled.metadata.shared


@pytest.mark.parametrize("model_type,fp64_math,n_type", [("bf16", True, "i32"), ("fp16", True, "i64"),
                                                         ("bf16", False, "i32")])
def test_kernel_compiles_for_sm90_with_exact_arithmetic(model_type, fp64_math, n_type):
    pytest.importorskip("triton")
    ptx, shared = _compile_ptx(model_type, fp64_math, n_type=n_type)
    assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx and "div.full" not in ptx and "sqrt.approx.f32" not in ptx
    assert f"cvt.rn.{'bf16' if model_type == 'bf16' else 'f16'}" in ptx
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx  # the full blocks are vectorized
    assert shared == 0  # loads and stores share one layout: nothing goes through shared memory
    assert ("cvt.f64.f32" in ptx and "fma.rn.f64" in ptx) if fp64_math else "fma.rn.f32" in ptx


def test_kernel_compiles_without_grad_scale_and_found_inf():
    pytest.importorskip("triton")
    ptx, _ = _compile_ptx("bf16", True, grad_scale=False, found_inf=False)
    assert "ld.global.v4.b32" in ptx
