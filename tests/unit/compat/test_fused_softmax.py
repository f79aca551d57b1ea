"""`megatron.core.fusions.fused_softmax` against softmax written out: scale, masks, fp16/bf16, causal."""
import pytest
import torch

from megatron.core.fusions.fused_softmax import (
    FusedScaleMaskSoftmax,
    ScaledMaskedSoftmax,
    ScaledSoftmax,
    ScaledUpperTriangMaskedSoftmax,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import attention_mask_func


def _reference(x, scale, mask=None, fill=-10000.0):
    """softmax(scale * x) in float64, masked entries (True) replaced by `fill` first."""
    scores = x.double() * scale
    if mask is not None:
        scores = scores.masked_fill(mask, fill)
    return torch.softmax(scores, dim=-1)


def _causal(sq):
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autograd_functions_match_the_formula_forward_and_backward(dtype):
    torch.manual_seed(0)
    b, np, sq, sk, scale = 2, 4, 32, 32, 0.37
    x = torch.randn(b, np, sq, sk)
    grad = torch.randn(b, np, sq, sk)
    mask = torch.rand(b, 1, sq, sk) < 0.3
    tol = dict(atol=4e-3, rtol=0) if dtype == torch.float16 else dict(atol=2e-2, rtol=0)

    cases = [
        (lambda t: ScaledSoftmax.apply(t, scale), None, 0.0),
        (lambda t: ScaledMaskedSoftmax.apply(t, mask, scale), mask, -10000.0),
        (lambda t: ScaledUpperTriangMaskedSoftmax.apply(t.view(-1, sq, sk), scale).view(b, np, sq, sk),
         _causal(sq), float("-inf")),
    ]
    for fn, ref_mask, fill in cases:
        leaf = x.to(dtype).requires_grad_()
        probs = fn(leaf)
        assert probs.dtype == dtype
        reference = _reference(x.to(dtype), scale, ref_mask, fill)
        torch.testing.assert_close(probs.double(), reference, **tol)
        probs.backward(grad.to(dtype))
        ref_leaf = x.to(dtype).double().requires_grad_()
        _reference(ref_leaf, scale, ref_mask, fill).backward(grad.to(dtype).double())
        assert leaf.grad.dtype == dtype
        torch.testing.assert_close(leaf.grad.double(), ref_leaf.grad, **tol)
    # The causal kernel gives future keys exactly zero probability; rows sum to one.
    causal = ScaledUpperTriangMaskedSoftmax.apply(x.to(dtype).view(-1, sq, sk), scale)
    assert torch.all(causal[:, _causal(sq)] == 0)
    torch.testing.assert_close(causal.float().sum(-1), torch.ones(b * np, sq), atol=1e-2, rtol=0)


def test_module_picks_the_fused_path_where_megatrons_kernel_would():
    softmax = FusedScaleMaskSoftmax(True, False, AttnMaskType.causal, True, attention_mask_func, True, 0.5)
    assert softmax.is_kernel_available(None, 2, 4, 32, 32)
    assert not softmax.is_kernel_available(None, 2, 4, 32, 16)   # sk must exceed 16
    assert not softmax.is_kernel_available(None, 2, 4, 30, 32)   # sq % 4
    assert not softmax.is_kernel_available(None, 1, 3, 32, 32)   # b * np % 4
    assert not softmax.is_kernel_available(None, 2, 4, 32, 8192)  # sk <= 4096
    # Megatron's kernel: 128 threads, one warp per row up to 32 keys, two rows per warp up to 128 keys.
    assert FusedScaleMaskSoftmax.get_batch_per_block(32, 32, 2, 4) == 8
    assert FusedScaleMaskSoftmax.get_batch_per_block(32, 128, 2, 4) == 8
    assert FusedScaleMaskSoftmax.get_batch_per_block(32, 2048, 2, 4) == 4
    unfused = FusedScaleMaskSoftmax(True, False, AttnMaskType.causal, False, attention_mask_func, True, 0.5)
    assert not unfused.is_kernel_available(None, 2, 4, 32, 32)
    fp32 = FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, True, attention_mask_func, True, None)
    assert not fp32.is_kernel_available(None, 2, 4, 32, 32)


@pytest.mark.parametrize("fusion", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_module_matches_the_formula_on_both_paths(fusion, dtype):
    torch.manual_seed(1)
    b, np, s, scale = 4, 2, 32, 0.125  # b * np a multiple of the kernel's 8 rows per block
    x = torch.randn(b, np, s, s, dtype=dtype)
    mask = torch.rand(b, 1, s, s) < 0.4
    tol = dict(atol=4e-3, rtol=0) if dtype == torch.float16 else dict(atol=2e-2, rtol=0)
    fp16, bf16 = dtype == torch.float16, dtype == torch.bfloat16

    causal = FusedScaleMaskSoftmax(fp16, bf16, AttnMaskType.causal, fusion, attention_mask_func, True, scale)
    assert causal.is_kernel_available(None, b, np, s, s) == fusion
    out = causal(x.clone(), None)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), _reference(x, scale, _causal(s)), **tol)

    padding = FusedScaleMaskSoftmax(fp16, bf16, AttnMaskType.padding, fusion, attention_mask_func, True, scale)
    torch.testing.assert_close(padding(x.clone(), mask).double(), _reference(x, scale, mask), **tol)
    torch.testing.assert_close(padding(x.clone(), None).double(), _reference(x, scale), **tol)


def test_module_unfused_details():
    torch.manual_seed(2)
    x = torch.randn(1, 2, 8, 8)
    # fp32 input, no scale: plain softmax of the masked scores.
    plain = FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, True, attention_mask_func, True, None)
    torch.testing.assert_close(plain(x.clone(), None).double(), _reference(x, 1.0, _causal(8)))
    # A single query (decoding with a KV cache) is not masked.
    one = torch.randn(1, 2, 1, 8)
    torch.testing.assert_close(plain(one.clone(), None).double(), _reference(one, 1.0))
    # Sliding window (left 2, right 0): query i sees keys i-2..i.
    window = FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, True, attention_mask_func, True, None,
                                   window_size=(2, 0))
    i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
    window_mask = (j > i) | (j < i - 2)
    torch.testing.assert_close(window(x.clone(), None).double(), _reference(x, 1.0, window_mask))
    # fp16 scores with softmax_in_fp32=False stay fp16 throughout.
    half = FusedScaleMaskSoftmax(True, False, AttnMaskType.padding, False, attention_mask_func, False, None)
    assert half(x.half(), None).dtype == torch.float16


def test_constructor_and_input_errors():
    with pytest.raises(ValueError, match="input_in_fp16 and input_in_bf16"):
        FusedScaleMaskSoftmax(True, True, AttnMaskType.causal, True, attention_mask_func, True, None)
    with pytest.raises(ValueError, match="softmax_in_fp32"):
        FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, True, attention_mask_func, False, 0.5)
    softmax = FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, True, attention_mask_func, True, None)
    with pytest.raises(ValueError, match=r"\[b, np, sq, sk\]"):
        softmax(torch.randn(2, 8, 8), None)
    with pytest.raises(ValueError, match="sq == sk"):
        softmax(torch.randn(1, 1, 4, 8), None)
