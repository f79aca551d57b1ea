"""get_megatron_optimizer and the FP32 / Float16 / Chained wrappers against plain torch optimizers."""
import copy
import io

import pytest
import torch

from megatron.core.optimizer import (
    ChainedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

def _assert_close(actual, expected, rtol=1.3e-6, atol=1e-5):
    """allclose with a readable failure (torch.testing.assert_close imports DTensor: seconds per process)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual.shape, expected.shape)
    diff = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert torch.allclose(actual, expected, rtol=rtol, atol=atol), f"max abs diff {diff}"



class _TinyLM(torch.nn.Module):
    """Embedding, a norm, a hidden linear and an output layer named like Megatron's GPT."""

    def __init__(self, vocab=32, hidden=16):
        super().__init__()
        self.embedding = torch.nn.Module()
        self.embedding.word_embeddings = torch.nn.Embedding(vocab, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.fc = torch.nn.Linear(hidden, hidden)
        self.output_layer = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        return self.output_layer(torch.tanh(self.fc(self.norm(self.embedding.word_embeddings(tokens)))))


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return _TinyLM().to(dtype)


def _loss(model, seed):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32, (4, 6), generator=gen)
    return model(tokens).float().square().mean()


def _constant_scheduler(opt, lr, wd):
    return OptimizerParamScheduler(opt, 0.0, lr, 0.0, 0, 100, "constant", wd, wd, 100, "constant")


def _reference_groups(model, wd):
    decay = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or p.dim() == 1)]
    no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias") or p.dim() == 1]
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_fp32_adamw_matches_torch_adamw_and_groups():
    model, ref_model = _model(), _model()
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0, adam_beta2=0.95)
    opt = get_megatron_optimizer(config, [model])
    assert isinstance(opt, FP32Optimizer)
    keys = [(g["wd_mult"], g["lr_mult"], g["is_expert_parallel"], g["is_decoupled_lr"]) for g in opt.param_groups]
    assert keys == [(1.0, 1.0, False, False), (0.0, 1.0, False, False)]
    assert [len(g["params"]) for g in opt.param_groups] == [3, 3]
    assert all(g["max_lr"] == 1e-2 and g["min_lr"] is None for g in opt.param_groups)
    _constant_scheduler(opt, 1e-2, 0.1)
    fused = opt.optimizer.defaults.get("fused")
    ref = torch.optim.AdamW(_reference_groups(ref_model, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=fused)
    loose_model = _model()
    loose = torch.optim.AdamW(_reference_groups(loose_model, 0.1), lr=1e-2, betas=(0.9, 0.95), foreach=False)
    for step in range(3):
        for m, o in ((model, opt), (ref_model, ref), (loose_model, loose)):
            o.zero_grad()
            _loss(m, step).backward()
        assert opt.step() == (True, None, None)
        ref.step()
        loose.step()
    for p, q, r in zip(model.parameters(), ref_model.parameters(), loose_model.parameters()):
        assert torch.equal(p, q)
        _assert_close(p, r, rtol=1e-5, atol=1e-6)
    assert opt.get_loss_scale().item() == 1.0
    assert torch.equal(opt.scale_loss(torch.tensor(3.0)), torch.tensor([3.0]))


def test_sgd_and_main_grad_and_timers():
    calls = []

    class _Timer:
        def __init__(self, name):
            self.name = name

        def start(self, barrier=False):
            calls.append(("start", self.name))

        def stop(self):
            calls.append(("stop", self.name))

    model, ref_model = _model(), _model()
    config = OptimizerConfig(optimizer="sgd", lr=0.1, weight_decay=0.0, sgd_momentum=0.5, clip_grad=0.0,
                             timers=lambda name, log_level=None: _Timer(name))
    opt = get_megatron_optimizer(config, [model])
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.5)
    for step in range(2):
        _loss(ref_model, step).backward()
        for p, q in zip(model.parameters(), ref_model.parameters()):
            p.main_grad = q.grad.clone()
            p.grad = None
        assert opt.step()[0]
        ref.step()
        ref.zero_grad()
        opt.zero_grad()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        _assert_close(p, q, rtol=0, atol=1e-7)
    names = [name for kind, name in calls if kind == "start"]
    assert names[:3] == ["optimizer-copy-to-main-grad", "optimizer-clip-main-grad", "optimizer-count-zeros"]
    assert "optimizer-inner-step" in names
    assert calls.count(("stop", "optimizer-inner-step")) == 2


def test_bf16_params_with_fp32_main_params():
    model = _model(torch.bfloat16)
    shadow = copy.deepcopy(model)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True, clip_grad=0.0), [model])
    assert isinstance(opt, Float16OptimizerWithFloat16Params) and opt.grad_scaler is None
    _constant_scheduler(opt, 1e-2, 0.01)
    masters = [p.detach().float().clone() for p in shadow.parameters()]
    ref = torch.optim.AdamW([masters[i] for i in (0, 3, 5)], lr=1e-2, weight_decay=0.01, foreach=False)
    ref.add_param_group({"params": [masters[i] for i in (1, 2, 4)], "weight_decay": 0.0})
    for step in range(2):
        opt.zero_grad()
        _loss(model, step).backward()
        for index, param in enumerate(model.parameters()):
            if index == 0:
                param.main_grad = param.grad.float() * 0.5
                param.grad = None
        grads = [getattr(p, "main_grad", None) if p.grad is None else p.grad for p in model.parameters()]
        for master, grad in zip(masters, grads):
            master.grad = grad.float()
        assert opt.step() == (True, 0.0, None)
        ref.step()
    mains = [m for g in opt.fp32_from_float16_groups for m in g]
    assert all(m.dtype == torch.float32 for m in mains)
    by_id = {id(p): m for group_model, group_main in zip(opt.float16_groups, opt.fp32_from_float16_groups)
             for p, m in zip(group_model, group_main)}
    for param, master in zip(model.parameters(), masters):
        main = by_id[id(param)]
        _assert_close(main, master, rtol=1e-5, atol=1e-6)
        assert param.dtype == torch.bfloat16 and torch.equal(param, main.to(torch.bfloat16))
    assert opt.get_loss_scale().item() == 1.0


def _set_fp16_grads(model, scale, poison=None):
    for index, param in enumerate(model.parameters()):
        grad = torch.full_like(param, 0.01, dtype=torch.float32) * scale
        if index == 1 and poison is not None:
            grad.view(-1)[0] = poison  # [*] -> [n]
        param.grad = grad.half()


def test_fp16_dynamic_loss_scaling():
    model = _model(torch.float16)
    config = OptimizerConfig(lr=1e-3, fp16=True, initial_loss_scale=2.0**10, min_loss_scale=2.0**8,
                             loss_scale_window=3, hysteresis=2, clip_grad=1e9)
    opt = get_megatron_optimizer(config, [model])
    _constant_scheduler(opt, 1e-3, 0.0)
    assert opt.get_loss_scale().item() == 1024.0
    assert opt.scale_loss(torch.tensor(2.0)).item() == 2048.0
    before = [p.clone() for p in model.parameters()]
    _set_fp16_grads(model, 1024.0)
    ok, norm, zeros = opt.step()
    expected_norm = 0.01 * sum(p.numel() for p in model.parameters()) ** 0.5
    assert ok and zeros is None and norm == pytest.approx(expected_norm, rel=1e-3)
    assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    scales = []
    for poison in (float("inf"), float("nan"), float("inf")):
        snapshot = [p.clone() for p in model.parameters()]
        _set_fp16_grads(model, opt.get_loss_scale().item(), poison)
        assert opt.step() == (False, None, None)
        assert all(torch.equal(p, s) for p, s in zip(model.parameters(), snapshot))
        scales.append(opt.get_loss_scale().item())
    assert scales == [1024.0, 512.0, 256.0]
    _set_fp16_grads(model, 256.0, float("inf"))
    opt.step()
    assert opt.get_loss_scale().item() == 256.0
    for _ in range(3):
        _set_fp16_grads(model, opt.get_loss_scale().item())
        assert opt.step()[0]
    assert opt.get_loss_scale().item() == 512.0
    assert opt.grad_scaler._hysteresis_tracker == 2


def test_constant_loss_scale_for_bf16_and_fp32_ignores_it():
    bf16 = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True, loss_scale=4.0), [_model(torch.bfloat16)])
    assert bf16.get_loss_scale().item() == 4.0
    fp32 = get_megatron_optimizer(OptimizerConfig(lr=1e-3, loss_scale=4.0), [_model()])
    assert fp32.get_loss_scale().item() == 1.0


def test_decoupled_lr_lr_mult_and_custom_conditions():
    model = _model()
    config = OptimizerConfig(lr=0.1, min_lr=0.01, decoupled_lr=0.5, weight_decay=0.1)
    opt = get_megatron_optimizer(
        config, [model], scale_lr_cond=lambda name, p: name.startswith("fc."), lr_mult=3.0
    )
    groups = {(g["wd_mult"], g["lr_mult"], g["is_decoupled_lr"]): g for g in opt.param_groups}
    ids = {key: {id(p) for p in g["params"]} for key, g in groups.items()}
    assert ids[(1.0, 1.0, True)] == {id(model.embedding.word_embeddings.weight), id(model.output_layer.weight)}
    assert ids[(1.0, 3.0, False)] == {id(model.fc.weight)}
    assert ids[(0.0, 3.0, False)] == {id(model.fc.bias)}
    assert groups[(1.0, 1.0, True)]["max_lr"] == 0.5 and groups[(1.0, 1.0, True)]["min_lr"] == 0.01
    _constant_scheduler(opt, 0.1, 0.1)
    assert groups[(1.0, 1.0, True)]["lr"] == pytest.approx(0.5)
    assert groups[(1.0, 3.0, False)]["lr"] == pytest.approx(0.3)
    assert groups[(0.0, 3.0, False)]["weight_decay"] == 0.0

    flagged = _model()
    flagged.output_layer.weight.is_embedding_or_output_parameter = False
    flagged.fc.weight.is_embedding_or_output_parameter = True
    opt = get_megatron_optimizer(
        OptimizerConfig(lr=0.1, decoupled_lr=0.5, decoupled_min_lr=0.05), [flagged],
        no_weight_decay_cond=lambda name, p: "norm" in name,
    )
    decoupled = [g for g in opt.param_groups if g["is_decoupled_lr"]]
    assert {id(p) for p in decoupled[0]["params"]} == {
        id(flagged.embedding.word_embeddings.weight), id(flagged.fc.weight)}
    assert decoupled[0]["min_lr"] == 0.05
    no_wd = [p for g in opt.param_groups if g["wd_mult"] == 0.0 for p in g["params"]]
    assert {id(p) for p in no_wd} == {id(flagged.norm.weight), id(flagged.norm.bias)}


def _train(model, opt, steps, start=0):
    for step in range(start, start + steps):
        opt.zero_grad()
        opt.scale_loss(_loss(model, step)).backward()
        opt.step()


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_state_dict_round_trip_is_bit_exact(precision):
    dtype = torch.float16 if precision == "fp16" else torch.float32
    config = OptimizerConfig(lr=1e-2, fp16=precision == "fp16", initial_loss_scale=2.0**8, clip_grad=0.5)
    model = _model(dtype)
    opt = get_megatron_optimizer(config, [model])
    sched = _constant_scheduler(opt, 1e-2, 0.01)
    _train(model, opt, 2)
    saved_model = _roundtrip(model.state_dict())
    saved = _roundtrip({"optimizer": opt.state_dict(), "sched": sched.state_dict()})
    resumed = _model(dtype, seed=1)
    resumed.load_state_dict(saved_model)
    opt2 = get_megatron_optimizer(config, [resumed])
    sched2 = _constant_scheduler(opt2, 1e-2, 0.01)
    opt2.load_state_dict(saved["optimizer"])
    sched2.load_state_dict(saved["sched"])
    _train(model, opt, 2, start=2)
    _train(resumed, opt2, 2, start=2)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    if precision == "fp16":
        assert opt2.get_loss_scale().item() == opt.get_loss_scale().item()
        for m1, m2 in zip(opt.get_parameters(), opt2.get_parameters()):
            assert m1.dtype == torch.float32 and torch.equal(m1, m2)


def test_fused_adam_style_checkpoint_without_per_param_step_loads():
    model = _model()
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [model])
    _train(model, opt, 1)
    state = _roundtrip(opt.state_dict())
    for group in state["param_groups"]:
        group["step"] = 1
        for key in ("fused", "foreach", "capturable", "amsgrad", "maximize", "differentiable"):
            group.pop(key, None)
    for entry in state["state"].values():
        del entry["step"]
    model2 = _model()
    opt2 = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [model2])
    flags = [(g["fused"], g["foreach"]) for g in opt2.param_groups]
    opt2.load_state_dict(state)
    assert all(float(s["step"]) == 1.0 for s in opt2.optimizer.state.values())
    assert [(g["fused"], g["foreach"]) for g in opt2.param_groups] == flags
    assert all(g["decoupled_weight_decay"] and not g["amsgrad"] for g in opt2.param_groups)
    before = [p.clone() for p in model2.parameters()]
    _train(model2, opt2, 1, start=1)
    assert all(float(s["step"]) == 2.0 for s in opt2.optimizer.state.values())
    assert not any(torch.equal(p, b) for p, b in zip(model2.parameters(), before))


def test_chained_optimizer_for_expert_params():
    model, ref_model = _model(), _model()
    model.fc.weight.allreduce = False
    model.fc.bias.allreduce = False
    config = OptimizerConfig(lr=1e-2, clip_grad=0.05, log_num_zeros_in_grad=True)
    opt = get_megatron_optimizer(config, [model])
    assert isinstance(opt, ChainedOptimizer) and len(opt.chained_optimizers) == 2
    from megatron.core.optimizer.optimizer import ChainedOptimizer as megatron_path  # Megatron's import path
    assert megatron_path is ChainedOptimizer
    expert = opt.chained_optimizers[1]
    assert {id(p) for p in expert.get_parameters()} == {id(model.fc.weight), id(model.fc.bias)}
    assert all(g["is_expert_parallel"] for g in expert.param_groups)
    _constant_scheduler(opt, 1e-2, 0.0)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    _loss(model, 0).backward()
    _loss(ref_model, 0).backward()
    model.fc.bias.grad[0] = 0.0
    ref_model.fc.bias.grad[0] = 0.0
    ref_zeros = sum(int((q.grad == 0).sum()) for q in ref_model.parameters())
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05).item()
    ok, norm, zeros = opt.step()
    ref.step()
    assert ok and norm == pytest.approx(ref_norm, rel=1e-5) and zeros == ref_zeros > 0
    for p, q in zip(model.parameters(), ref_model.parameters()):
        _assert_close(p, q, rtol=1e-5, atol=1e-6)
    state = _roundtrip(opt.state_dict())
    assert isinstance(state, list) and len(state) == 2
    opt.load_state_dict(state)
    assert len(opt.param_groups) == len(opt.chained_optimizers[0].param_groups) + len(expert.param_groups)


def test_unsupported_settings_raise():
    with pytest.raises(ValueError, match="--lr"):
        get_megatron_optimizer(OptimizerConfig(), [_model()])
    with pytest.raises(ValueError, match="--optimizer-cpu-offload"):
        config = OptimizerConfig(lr=1.0, use_precision_aware_optimizer=True, use_distributed_optimizer=True)
        get_megatron_optimizer(config, [_model()])
    with pytest.raises(ValueError) as err:
        OptimizerConfig(fp16=True, bf16=True, optimizer="lamb", exp_avg_dtype=torch.bfloat16)
    for needle in ("mutually exclusive", "'lamb'", "exp_avg_dtype"):
        assert needle in str(err.value)


class _SyncRecordingChunk(_TinyLM):
    """Stand-in for a DDP-wrapped chunk: records `start_param_sync` calls."""

    def __init__(self):
        super().__init__()
        self.sync_calls = []

    def start_param_sync(self, *unused, force_sync=False, force_dispatch=False):
        self.sync_calls.append(force_dispatch)


def test_overlap_param_gather_splits_first_chunk_and_reload_model_params():
    chunks = [_SyncRecordingChunk(), _SyncRecordingChunk()]
    config = OptimizerConfig(lr=1e-2, overlap_param_gather_with_optimizer_step=True)
    opt = get_megatron_optimizer(config, chunks)
    assert isinstance(opt, ChainedOptimizer) and len(opt.chained_optimizers) == 2
    assert [c.overlap_param_gather_with_optimizer_step for c in chunks] == [True, False]
    first_ids = {id(p) for p in opt.chained_optimizers[0].get_parameters()}
    assert first_ids == {id(p) for p in chunks[0].parameters()}
    for step, chunk in enumerate(chunks):
        _loss(chunk, step).backward()
    assert opt.step()[0]
    assert chunks[0].sync_calls == [True] and chunks[1].sync_calls == []

    model = _model(torch.bfloat16)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True), [model])
    with torch.no_grad():
        model.fc.weight.fill_(0.25)
    main = opt.fp32_from_float16_groups[0][1]
    assert main.shape == model.fc.weight.shape and not torch.equal(main, model.fc.weight.float())
    opt.reload_model_params()
    assert torch.equal(main, model.fc.weight.float())
