"""Grad norm / clipping / zero counting in one process, and the loss scalers' state."""
import io
import math

import pytest
import torch

from megatron.core.optimizer import ConstantGradScaler, DynamicGradScaler
from megatron.core.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    defer_clip_to_fused_adam,
    get_grad_norm_fp32,
    get_grad_norm_fp32_tensor,
    param_is_not_shared,
    param_is_not_tensor_parallel_duplicate,
)

def _assert_close(actual, expected, rtol=1.3e-6, atol=1e-5):
    """allclose with a readable failure (torch.testing.assert_close imports DTensor: seconds per process)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual.shape, expected.shape)
    diff = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert torch.allclose(actual, expected, rtol=rtol, atol=atol), f"max abs diff {diff}"



def _params(seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((5, 3), (7,), (2, 2, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * scale
    return params


def test_norm_and_clip_match_torch():
    params, ref = _params(), _params()
    norm = get_grad_norm_fp32([p.grad for p in params])
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 0.3).item()
    assert norm == pytest.approx(ref_norm, rel=1e-6)
    clip_grad_by_total_norm_fp32(params, 0.3, norm)
    for p, q in zip(params, ref):
        _assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
    clipped = get_grad_norm_fp32([p.grad for p in params])
    assert clipped == pytest.approx(0.3 * norm / (norm + 1e-6), rel=1e-6)

    small = _params(scale=1e-3)
    before = [p.grad.clone() for p in small]
    small_norm = get_grad_norm_fp32([p.grad for p in small])
    clip_grad_by_total_norm_fp32(small, 1.0, small_norm)
    assert all(torch.equal(p.grad, b) for p, b in zip(small, before))


def test_other_norm_types_bf16_and_empty():
    params = _params(1)
    grads = [p.grad for p in params]
    flat = torch.cat([g.flatten() for g in grads])  # [15] + [7] + [8] -> [30]
    assert get_grad_norm_fp32(grads, math.inf) == pytest.approx(flat.abs().max().item())
    assert get_grad_norm_fp32(grads, 1) == pytest.approx(flat.abs().sum().item(), rel=1e-6)
    assert get_grad_norm_fp32(grads[0]) == pytest.approx(grads[0].norm().item(), rel=1e-6)
    bf16 = [g.bfloat16() for g in grads]
    expected = torch.cat([g.float().flatten() for g in bf16]).norm().item()  # [*] -> [30]
    assert get_grad_norm_fp32(bf16) == pytest.approx(expected, rel=1e-6)
    assert get_grad_norm_fp32([]) == 0.0
    assert get_grad_norm_fp32([], math.inf) == 0.0


def test_shared_and_tp_attributes_and_zero_count():
    params = _params(2)
    params[0].shared = True
    params[1].grad[:4] = 0.0
    params[2].grad[0] = 0.0
    params[2].tensor_model_parallel = True
    assert not param_is_not_shared(params[0]) and param_is_not_shared(params[1])
    assert param_is_not_tensor_parallel_duplicate(params[1]) and param_is_not_tensor_parallel_duplicate(params[2])
    assert count_zeros_fp32(params) == 4 + 4
    no_grad = torch.nn.Parameter(torch.zeros(3))
    assert count_zeros_fp32(params + [no_grad]) == 8


@pytest.mark.parametrize("scale", [10.0, 1e-3])  # clipped / not clipped
def test_clip_deferred_to_fused_adamw_matches_explicit_clip(scale):
    """The fused AdamW step with the coefficient as `grad_scale` = explicit clip + step: same params and
    moments (<= 1e-6 relative), grads left clipped, the attribute gone after the step; bit-identical when
    nothing is clipped. An unfused optimizer refuses (the caller clips as before)."""
    results = []
    for deferred in (False, True):
        params = _params(seed=3, scale=scale)
        optimizer = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, fused=True)
        for _ in range(2):
            for index, p in enumerate(params):
                p.grad = torch.full_like(p, 0.5 * (index + 1) * scale) + p.detach() * scale
            norm = get_grad_norm_fp32_tensor([p.grad for p in params])
            if not (deferred and defer_clip_to_fused_adam(optimizer, 1.0, norm)):
                clip_grad_by_total_norm_fp32(params, 1.0, norm)
            optimizer.step()
            optimizer.__dict__.pop("grad_scale", None)
        state = [optimizer.state[p][key] for p in params for key in ("exp_avg", "exp_avg_sq")]
        results.append(([p.detach().clone() for p in params], [p.grad.clone() for p in params], state))
    for explicit, deferred in zip(*[sum(r, []) for r in results]):
        if scale < 1:
            assert torch.equal(explicit, deferred)
        else:
            _assert_close(deferred, explicit, rtol=1e-6, atol=1e-7)
    plain = torch.optim.AdamW(_params(), fused=False)
    assert not defer_clip_to_fused_adam(plain, 1.0, torch.tensor(5.0)) and not hasattr(plain, "grad_scale")


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_dynamic_scaler_state_and_validation():
    scaler = DynamicGradScaler(2.0**16, 1.0, 2.0, 0.5, growth_interval=2, hysteresis=2)
    assert scaler.inv_scale.item() == 2.0**-16
    for found_inf in (False, True, True, True):
        scaler.update(found_inf)
    assert scaler.scale.item() == 2.0**14
    state = _roundtrip(scaler.state_dict())
    assert set(state) == {"scale", "growth_tracker", "hysteresis_tracker"}
    other = DynamicGradScaler(4.0, 1.0, 2.0, 0.5, growth_interval=2, hysteresis=2)
    other.load_state_dict(state)
    assert other.scale.item() == 2.0**14 and other._hysteresis_tracker == -1
    other.update(False)
    other.update(False)
    assert other.scale.item() == 2.0**15 and other._hysteresis_tracker == 2
    constant = ConstantGradScaler(8.0)
    constant.update(True)
    assert constant.scale.item() == 8.0 and _roundtrip(constant.state_dict()) == {}
    with pytest.raises(ValueError) as err:
        DynamicGradScaler(1.0, 2.0, 1.0, 1.5, growth_interval=0, hysteresis=0)
    for needle in ("--min-loss-scale", "growth factor", "backoff factor", "--loss-scale-window", "--hysteresis"):
        assert needle in str(err.value)
