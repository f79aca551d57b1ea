"""No host synchronisation inside a bf16/fp32 optimizer step or on non-log iterations of the training log.

A "sync" is any Python-level read of a tensor value (`.item()`, `.tolist()`, `bool()`, `float()`,
`int()`) made from a `megatron.*` frame; `_no_host_reads` turns those into errors. torch's own
internals are not flagged (their CPU-side bookkeeping, e.g. Adam's step counter, is not a device sync).
"""
import contextlib
import sys
import types

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.optimizer import (
    ChainedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron.core.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32_tensor,
    get_grad_norm_fp32,
    get_grad_norm_fp32_tensor,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training import train_step as train_step_module
from megatron.training import training_log as training_log_module
from tests.harness import run_on_ranks

_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


class HostSyncError(AssertionError):
    """A megatron frame read a tensor value back to the host."""


@contextlib.contextmanager
def _no_host_reads():
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def guarded(name, original):
        def read(self, *args, **kwargs):
            frame = sys._getframe(1)
            caller = frame.f_globals.get("__name__", "")
            if caller.startswith("megatron."):
                raise HostSyncError(f"Tensor.{name} called from {caller}.{frame.f_code.co_name}:{frame.f_lineno}")
            return original(self, *args, **kwargs)
        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, guarded(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


class _TinyLM(torch.nn.Module):
    def __init__(self, vocab=32, hidden=16):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.fc = torch.nn.Linear(hidden, hidden)
        self.output_layer = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        return self.output_layer(torch.tanh(self.fc(self.norm(self.embedding(tokens)))))


def _model(dtype, seed=0):
    torch.manual_seed(seed)
    return _TinyLM().to(dtype)


def _backward(model, seed=0):
    tokens = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(seed))
    model(tokens).float().square().mean().backward()


def _reference_step(params, grads, clip, lr):
    """fp32 reference: torch's clip_grad_norm_ then a plain AdamW (no weight decay)."""
    params = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    for p, g in zip(params, grads):
        p.grad = g.detach().float().clone()
    norm = torch.nn.utils.clip_grad_norm_(params, clip).item()
    torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=False).step()
    return norm, params


def _step_under_guard(dtype, clip, chained=False):
    model = _model(dtype)
    if chained:
        model.fc.weight.allreduce = False
        model.fc.bias.allreduce = False
    config = OptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=clip, log_num_zeros_in_grad=True,
                             bf16=dtype == torch.bfloat16, params_dtype=dtype)
    opt = get_megatron_optimizer(config, [model])
    OptimizerParamScheduler(opt, 0.0, 1e-2, 0.0, 0, 100, "constant", 0.0, 0.0, 100, "constant")
    _backward(model)
    model.fc.bias.grad[:3] = 0.0
    params = list(model.parameters())
    initial = [p.detach().clone() for p in params]
    grads = [p.grad.clone() for p in params]
    zeros = sum(int((g == 0).sum()) for g in grads)
    with _no_host_reads():
        ok, grad_norm, num_zeros = opt.step()
    return opt, params, initial, grads, zeros, ok, grad_norm, num_zeros


@pytest.mark.parametrize("dtype, chained", [(torch.float32, False), (torch.bfloat16, False),
                                            (torch.float32, True)])
def test_step_does_not_read_device_values(dtype, chained):
    opt, params, initial, grads, zeros, ok, grad_norm, num_zeros = _step_under_guard(dtype, 0.05, chained)
    expected_type = {torch.float32: FP32Optimizer, torch.bfloat16: Float16OptimizerWithFloat16Params}[dtype]
    if chained:
        assert isinstance(opt, ChainedOptimizer) and len(opt.chained_optimizers) == 2
    else:
        assert isinstance(opt, expected_type)
    assert ok is True
    assert isinstance(grad_norm, torch.Tensor) and grad_norm.dim() == 0
    assert isinstance(num_zeros, torch.Tensor) and int(num_zeros.item()) == zeros > 0
    ref_norm, ref_params = _reference_step(initial, grads, 0.05, 1e-2)
    assert ref_norm > 0.05  # the clip coefficient is < 1: clipping really happened
    assert grad_norm.item() == pytest.approx(ref_norm, rel=1e-5)
    main_params = params
    if dtype == torch.bfloat16:
        main_of = {id(model_param): main for model_group, main_group in
                   zip(opt.float16_groups, opt.fp32_from_float16_groups)
                   for model_param, main in zip(model_group, main_group)}
        main_params = [main_of[id(p)] for p in params]
        for model_param, main in zip(params, main_params):
            assert torch.equal(model_param, main.to(torch.bfloat16))
    for main, ref in zip(main_params, ref_params):
        assert torch.allclose(main.float(), ref, rtol=1e-5, atol=1e-6)


def test_guard_catches_syncs_and_fp16_keeps_its_one_sync():
    grads = [torch.randn(4, 3), torch.randn(5)]
    with _no_host_reads(), pytest.raises(HostSyncError):
        get_grad_norm_fp32(grads)
    model = _model(torch.float16)
    config = OptimizerConfig(lr=1e-2, fp16=True, params_dtype=torch.float16, clip_grad=1.0,
                             initial_loss_scale=2.0 ** 8)
    opt = get_megatron_optimizer(config, [model])
    _backward(model)
    with _no_host_reads(), pytest.raises(HostSyncError, match="_unscale_main_grads_and_check_for_nan"):
        opt.step()
    assert train_step_module.optimizer_can_skip_step(opt)
    assert not train_step_module.optimizer_can_skip_step(_step_under_guard(torch.bfloat16, 1.0)[0])


def test_device_clip_coefficient_matches_host_path_and_one_is_exact():
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(6, 5, generator=gen), torch.randn(7, generator=gen), torch.randn(3, generator=gen)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    host = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, q, g in zip(params, host, grads):
        p.grad, q.grad = g.clone(), g.clone()
    with _no_host_reads():
        norm = get_grad_norm_fp32_tensor([p.grad for p in params])
        clip_grad_by_total_norm_fp32(params, 0.5, norm)
    assert norm.dtype == torch.float64
    assert norm.item() == get_grad_norm_fp32(grads)
    clip_grad_by_total_norm_fp32(host, 0.5, get_grad_norm_fp32(grads))
    for p, q in zip(params, host):
        assert torch.equal(p.grad, q.grad)  # same coefficient as Megatron's host computation, bit for bit
    before = [p.grad.clone() for p in params]
    with _no_host_reads():
        clip_grad_by_total_norm_fp32(params, 1e3, get_grad_norm_fp32_tensor([p.grad for p in params]))
        inf_norm = get_grad_norm_fp32_tensor([p.grad for p in params], float("inf"))
        l3_norm = get_grad_norm_fp32_tensor([p.grad for p in params], 3)
        zeros = count_zeros_fp32_tensor(params)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))  # coefficient 1.0 changes nothing
    flat = torch.cat([b.flatten() for b in before])  # [30] + [7] + [3] -> [40]
    assert inf_norm.item() == flat.abs().max().item()
    assert l3_norm.item() == pytest.approx(flat.abs().pow(3).sum().pow(1 / 3).item(), rel=1e-6)
    assert zeros.item() == 0.0
    bf16 = [torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))]
    bf16[0].grad = torch.tensor([1.0, -2.0, 0.5, 4.0], dtype=torch.bfloat16)
    clip_grad_by_total_norm_fp32(bf16, 1.0, get_grad_norm_fp32_tensor([bf16[0].grad]))
    assert bf16[0].grad.dtype == torch.bfloat16
    assert torch.allclose(bf16[0].grad.float().norm(), torch.tensor(1.0), rtol=1e-2)


class _Timers:
    def __call__(self, name, log_level=0):
        return types.SimpleNamespace(elapsed=lambda barrier=False, reset=True: 0.25)

    def log(self, *args, **kwargs):
        return None


def test_training_log_reads_device_values_only_on_log_iterations(monkeypatch):
    args = types.SimpleNamespace(micro_batch_size=2, data_parallel_size=1, log_interval=2,
                                 tensorboard_log_interval=1, tensorboard_dir=None, wandb_project="",
                                 train_iters=10, consumed_train_samples=8, skipped_train_samples=0,
                                 log_throughput=False, decoupled_lr=None, world_size=1,
                                 log_timers_to_tensorboard=False, num_experts=None, mtp_num_layers=None)
    printed, reductions = [], []
    patches = {
        "get_args": lambda: args, "get_timers": _Timers, "get_tensorboard_writer": lambda: None,
        "get_wandb_writer": lambda: None, "get_num_microbatches": lambda: 1, "print_rank_last": printed.append,
        "reduce_max_stat_across_model_parallel_group": lambda v: reductions.append(v) or v,
        "mpu": types.SimpleNamespace(is_pipeline_first_stage=lambda ignore_virtual: True,
                                     is_pipeline_last_stage=lambda ignore_virtual: True),
    }
    for name, value in patches.items():
        monkeypatch.setattr(training_log_module, name, value)
    monkeypatch.setattr(training_log_module, "num_floating_point_operations", lambda a, b: 1.0)
    totals = {}
    for iteration, loss in ((1, 3.0), (2, 5.0)):
        loss_dict = {"lm loss": torch.tensor(loss)}
        norm, zeros = torch.tensor(1.23456, dtype=torch.float64), torch.tensor(7.0)
        guard = _no_host_reads() if iteration == 1 else contextlib.nullcontext()
        with guard:
            training_log_module.training_log(loss_dict, totals, 1e-3, None, iteration, torch.tensor([4.0]), False,
                                             0, norm, None, zeros)
    assert reductions == [1e-3]  # the learning rate is reduced for the log line only
    assert len(printed) == 1
    expected = training_log_module._format_line(
        args, {training_log_module.ADVANCED_ITERS_KEY: 2, training_log_module.SKIPPED_ITERS_KEY: 0,
               training_log_module.NAN_ITERS_KEY: 0, "lm loss": torch.tensor(8.0)},
        2, 0.125, 0.0, 1e-3, None, 2, 4.0, 1.23456, 7.0, None)
    assert printed[0].split("]", 1)[1] == expected.split("]", 1)[1]
    assert " grad norm: 1.235 | num zeros: 7 |" in printed[0] and " lm loss: 4.000000E+00 |" in printed[0]


def _model_parallel_stats():
    rank = torch.distributed.get_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        norm = torch.tensor(1.5 + rank, dtype=torch.float64)
        reduced = train_step_module.reduce_max_stat_across_model_parallel_group(norm)
        absent = train_step_module.reduce_max_stat_across_model_parallel_group(None if rank == 0 else 2.0)
        all_absent = train_step_module.reduce_max_stat_across_model_parallel_group(None)
        mixed = train_step_module.reduce_max_stat_across_model_parallel_group(
            torch.tensor(3.0) if rank == 0 else None)
        return (type(reduced).__name__, norm.item(), train_step_module.stat_to_host(reduced), absent, all_absent,
                train_step_module.stat_to_host(mixed), train_step_module.logical_and_across_model_parallel_group(
                    rank == 0))
    finally:
        parallel_state.destroy_model_parallel()


def test_model_parallel_stats_stay_on_device():
    results = run_on_ranks(_model_parallel_stats, 2, timeout=120)
    for rank, result in enumerate(results):
        assert result == ("Tensor", 1.5 + rank, 2.5, 2.0, None, 3.0, False)
    assert train_step_module.stat_to_host(None) is None
    assert train_step_module.stat_to_host(torch.tensor(-1.0)) is None
    assert train_step_module.stat_to_host(0.5) == 0.5
