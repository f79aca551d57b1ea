"""OptimizerParamScheduler against closed-form LR / WD values, per-group settings and state round trip."""
import io
import math

import pytest
import torch

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


class _Groups:
    """Stand-in optimizer: only `param_groups` is used by the scheduler."""

    def __init__(self, *groups):
        self.param_groups = [dict(g) for g in groups] or [{}]


def _sched(style="linear", init_lr=0.0, max_lr=1.0, min_lr=0.1, warmup=10, decay=110, optimizer=None, **kw):
    kwargs = dict(start_wd=0.01, end_wd=0.01, wd_incr_steps=100, wd_incr_style="constant")
    kwargs.update(kw)
    return OptimizerParamScheduler(
        optimizer or _Groups(), init_lr, max_lr, min_lr, warmup, decay, style, **kwargs
    )


def _lr_at(sched, steps):
    sched.step(steps - sched.num_steps)
    return sched.optimizer.param_groups[0]["lr"]


def test_warmup_boundary_and_construction():
    sched = _sched(init_lr=0.05)
    assert sched.num_steps == 0
    assert sched.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert _lr_at(sched, 5) == pytest.approx(0.05 + 0.95 * 0.5)
    assert _lr_at(sched, 10) == pytest.approx(1.0)
    assert _lr_at(sched, 11) == pytest.approx(0.1 + 0.9 * (1 - 1 / 100))
    no_warmup = _sched(warmup=0)
    assert no_warmup.optimizer.param_groups[0]["lr"] == pytest.approx(1.0)


@pytest.mark.parametrize("style", ["linear", "cosine", "constant"])
def test_decay_styles_closed_form(style):
    sched = _sched(style)
    for n in (10, 11, 35, 60, 109, 110, 111, 500):
        lr = _lr_at(sched, n)
        ratio = (n - 10) / 100
        if style == "constant":
            expected = 1.0
        elif n > 110:
            expected = 0.1
        elif style == "linear":
            expected = 0.1 + 0.9 * (1 - ratio)
        else:
            expected = 0.1 + 0.9 * 0.5 * (math.cos(math.pi * ratio) + 1)
        assert lr == pytest.approx(expected, abs=1e-12), (style, n)


def test_inverse_square_root():
    sched = _sched("inverse-square-root", min_lr=0.05, warmup=16, decay=10_000)
    assert _lr_at(sched, 16) == pytest.approx(1.0)
    assert _lr_at(sched, 64) == pytest.approx(math.sqrt(16) / math.sqrt(64))
    assert _lr_at(sched, 9_000) == pytest.approx(0.05)
    assert _lr_at(sched, 20_000) == pytest.approx(0.05)
    no_warmup = _sched("inverse-square-root", min_lr=0.0, warmup=0, decay=1000)
    assert no_warmup.optimizer.param_groups[0]["lr"] == pytest.approx(1.0)
    assert _lr_at(no_warmup, 4) == pytest.approx(0.5)


@pytest.mark.parametrize(
    "wsd_style,curve",
    [
        ("linear", lambda r: 1 - r),
        ("cosine", lambda r: 0.5 * (math.cos(math.pi * r) + 1)),
        ("exponential", lambda r: 2 * 0.5**r - 1),
        ("minus_sqrt", lambda r: 1 - math.sqrt(r)),
    ],
)
def test_wsd_phases(wsd_style, curve):
    sched = _sched("WSD", warmup=10, decay=110, wsd_decay_steps=40, lr_wsd_decay_style=wsd_style)
    assert _lr_at(sched, 5) == pytest.approx(0.5)
    assert _lr_at(sched, 30) == pytest.approx(1.0)
    assert _lr_at(sched, 70) == pytest.approx(1.0)
    for n in (71, 80, 90, 110):
        assert _lr_at(sched, n) == pytest.approx(0.1 + 0.9 * curve((n - 70) / 40)), n
    assert _lr_at(sched, 111) == pytest.approx(0.1)


@pytest.mark.parametrize("wd_style", ["linear", "cosine"])
def test_weight_decay_increment(wd_style):
    sched = _sched(start_wd=0.0, end_wd=0.1, wd_incr_steps=50, wd_incr_style=wd_style)
    for n in (0, 10, 25, 50, 80):
        _lr_at(sched, n)
        ratio = min(n / 50, 1.0)
        coeff = ratio if wd_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1)
        assert sched.get_wd() == pytest.approx(0.1 * coeff)
        assert sched.optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.1 * coeff)


def test_per_group_mults_and_lr_bounds():
    opt = _Groups(
        {"lr_mult": 1.0, "wd_mult": 1.0},
        {"lr_mult": 0.5, "wd_mult": 0.0},
        {"lr_mult": 1.0, "wd_mult": 1.0, "max_lr": 2.0, "min_lr": 0.2},
    )
    sched = _sched(optimizer=opt, warmup=0, decay=100)
    lrs = [g["lr"] for g in opt.param_groups]
    assert lrs == pytest.approx([1.0, 0.5, 2.0])
    assert [g["weight_decay"] for g in opt.param_groups] == pytest.approx([0.01, 0.0, 0.01])
    sched.step(60)
    assert opt.param_groups[2]["lr"] == pytest.approx(0.2 + 1.8 * 0.4)
    assert opt.param_groups[1]["lr"] == pytest.approx(0.5 * (0.1 + 0.9 * 0.4))


def test_state_dict_round_trip_and_mismatch():
    sched = _sched("cosine", start_wd=0.0, end_wd=0.1, wd_incr_steps=50, wd_incr_style="linear")
    sched.step(37)
    buffer = io.BytesIO()
    torch.save(sched.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert set(state) == {
        "max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style", "lr_decay_steps",
        "min_lr", "start_wd", "end_wd", "wd_incr_style", "wd_incr_steps",
    }
    fresh = _sched("cosine", start_wd=0.0, end_wd=0.1, wd_incr_steps=50, wd_incr_style="linear",
                   use_checkpoint_opt_param_scheduler=False)
    fresh.load_state_dict(state)
    assert fresh.num_steps == 37
    assert fresh.optimizer.param_groups[0]["lr"] == sched.optimizer.param_groups[0]["lr"]
    assert fresh.optimizer.param_groups[0]["weight_decay"] == sched.optimizer.param_groups[0]["weight_decay"]

    strict = _sched("cosine", max_lr=2.0, start_wd=0.0, end_wd=0.1, wd_incr_steps=50, wd_incr_style="linear",
                    use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match="learning rate do not match") as err:
        strict.load_state_dict(state)
    assert "--override-opt_param-scheduler" in str(err.value)
    override = _sched("cosine", max_lr=2.0, start_wd=0.0, end_wd=0.1, wd_incr_steps=50, wd_incr_style="linear",
                      use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
    override.load_state_dict(state)
    assert override.max_lr == 2.0 and override.num_steps == 37
    from_ckpt = _sched("linear", max_lr=2.0)
    from_ckpt.load_state_dict(state)
    assert from_ckpt.max_lr == 1.0 and from_ckpt.lr_decay_style == "cosine"
    assert from_ckpt.wd_incr_style == "linear"


def test_legacy_keys_and_invalid_settings():
    legacy = {"start_lr": 1.0, "min_lr": 0.1, "warmup_iter": 10, "end_iter": 110, "decay_style": "linear",
              "num_iters": 60}
    sched = _sched(use_checkpoint_opt_param_scheduler=False)
    sched.load_state_dict(legacy)
    assert sched.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 + 0.9 * 0.5)
    with pytest.raises(ValueError) as err:
        _sched(min_lr=2.0, warmup=200, decay=100, override_opt_param_scheduler=True)
    message = str(err.value)
    for needle in ("--lr (1.0) must be >= --min-lr (2.0)", "warm-up steps (200)", "mutually exclusive"):
        assert needle in message
    with pytest.raises(ValueError, match="--lr-decay-style"):
        _sched("bogus")
    with pytest.raises(ValueError, match="WSD needs"):
        _sched("WSD", lr_wsd_decay_style="linear")
