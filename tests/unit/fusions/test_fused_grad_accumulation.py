"""`accumulate_grad_` (fp32 main_grad += half-precision grad): the fallback on CPU, the Triton kernel in Triton's
interpreter (fp16: the interpreter has no bf16), and on CUDA bit-identical to torch's `add_` for bf16 and fp16."""

import pytest
import torch

from megatron.core.fusions import fused_grad_accumulation
from megatron.core.fusions.fused_grad_accumulation import accumulate_grad_
from tests.harness import load_interpreted


def _pair(numel, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    main_grad = torch.randn(numel, generator=gen).to(device)
    grad = (torch.randn(numel, generator=gen) * 1e-3).to(device=device, dtype=dtype)
    return main_grad, grad


def test_cpu_tensors_take_torch_add():
    main_grad, grad = _pair(1000, torch.bfloat16)
    expected = main_grad.clone().add_(grad)
    assert accumulate_grad_(main_grad, grad) is main_grad
    assert torch.equal(main_grad, expected)


def test_interpreted_kernel_matches_torch_add_in_fp16():
    pytest.importorskip("triton")
    module = load_interpreted(fused_grad_accumulation.__file__, "fused_grad_accumulation_interpreted")
    for numel in (1, module._BLOCK - 1, 2 * module._BLOCK + 5):
        main_grad, grad = _pair(numel, torch.float16, seed=numel)
        expected = main_grad.clone().add_(grad)
        grid = ((numel + module._BLOCK - 1) // module._BLOCK,)
        module._accumulate_kernel[grid](main_grad, grad, numel, BLOCK=module._BLOCK)
        assert torch.equal(main_grad, expected), numel


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernel_is_bit_identical_to_torch_add(dtype):
    if not fused_grad_accumulation._HAS_TRITON:
        pytest.skip("needs Triton")
    for numel in (1, 4097, 3 * 1024 * 1024 + 7):
        main_grad, grad = _pair(numel, dtype, device="cuda", seed=numel)
        expected = main_grad.clone().add_(grad)
        assert fused_grad_accumulation._uses_kernel(main_grad, grad)
        accumulate_grad_(main_grad, grad)
        assert torch.equal(main_grad, expected), (dtype, numel)
    # a non-contiguous gradient takes torch's add
    main_grad, grad = _pair(64 * 64, dtype, device="cuda")
    grad_t = grad.view(64, 64).t()
    assert not fused_grad_accumulation._uses_kernel(main_grad.view(64, 64), grad_t)
    expected = main_grad.view(64, 64).clone().add_(grad_t)
    assert torch.equal(accumulate_grad_(main_grad.view(64, 64), grad_t), expected)
