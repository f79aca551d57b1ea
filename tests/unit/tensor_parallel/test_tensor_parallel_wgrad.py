"""Weight-gradient accumulation into fp32 `main_grad` (one fp32-output GEMM where torch has it) and the
bias fused into the forward GEMM.

The fp32-output `torch.addmm` exists on CUDA only; on CPU the detection is driven through its branches
with stand-ins for the kernel, and every path is compared with the fp32 reference accumulation.
"""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    linear_with_grad_accumulation_and_async_allreduce,
)
from megatron.core.tensor_parallel import wgrad_accumulation as layers
from megatron.core.utils import init_method_normal


def _fp32_output_gemm(main_grad, grad_output_2d, input_2d):
    """Stand-in for the CUDA kernel: half-precision operands, fp32 products and fp32 accumulation."""
    main_grad.add_(grad_output_2d.float().t() @ input_2d.float())


def _wrong_gemm(main_grad, grad_output_2d, input_2d):
    main_grad.add_(1.0)


def _missing_out_dtype(main_grad, grad_output_2d, input_2d):
    raise TypeError("addmm() got an unexpected keyword argument 'out_dtype'")


def test_probe_detects_support_and_falls_back(monkeypatch):
    cpu = torch.device("cpu")
    assert layers._probe_addmm_fp32_out(cpu, torch.bfloat16) is False  # real torch: no CPU kernel
    for stand_in, expected in ((_fp32_output_gemm, True), (_wrong_gemm, False), (_missing_out_dtype, False)):
        monkeypatch.setattr(layers, "_addmm_fp32_out", stand_in)
        assert layers._probe_addmm_fp32_out(cpu, torch.bfloat16) is expected
        assert layers._probe_addmm_fp32_out(cpu, torch.float16) is expected


def test_support_is_probed_once_per_device_and_dtype(monkeypatch):
    calls = []
    monkeypatch.setattr(layers, "_ADDMM_FP32_OUT_SUPPORT", {})
    monkeypatch.setattr(layers, "_probe_addmm_fp32_out", lambda device, dtype: calls.append((device, dtype)) or True)
    cuda0 = torch.device("cuda", 0)
    assert not layers.addmm_fp32_out_supported(torch.device("cpu"), torch.bfloat16)
    assert not layers.addmm_fp32_out_supported(cuda0, torch.float32)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not layers.addmm_fp32_out_supported(cuda0, torch.bfloat16)  # no probing inside a trace
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    for _ in range(3):
        assert layers.addmm_fp32_out_supported(cuda0, torch.bfloat16)
        assert layers.addmm_fp32_out_supported("cuda:0", torch.float16)
    assert calls == [(cuda0, torch.bfloat16), (cuda0, torch.float16)]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert layers.addmm_fp32_out_supported(cuda0, torch.bfloat16)  # a traced backward reuses the answer


def test_fp32_output_wgrad_op_traces_with_fake_tensors():
    """The compiler traces the wgrad accumulation as one opaque in-place op (no decomposition of
    `addmm(out_dtype=)`, which fails on fake tensors and made compiled layers fall back to eager)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    def accumulate(main_grad, grad_output, inputs):
        layers._addmm_fp32_out(main_grad, grad_output, inputs)
        return main_grad

    def trace(fn):  # with the compiler's decompositions, as inductor traces a layer's backward
        return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(
            torch.zeros(4, 6), torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(8, 6, dtype=torch.bfloat16))

    graph = trace(accumulate)
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert targets == ["megatron_core.accumulate_wgrad_fp32_.default"], targets


def _accumulate_twice(monkeypatch, supported):
    monkeypatch.setattr(layers, "addmm_fp32_out_supported", lambda device, dtype: supported)
    monkeypatch.setattr(layers, "_addmm_fp32_out", _fp32_output_gemm)
    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 5, generator=gen).bfloat16())
    weight.main_grad = torch.randn(6, 5, generator=gen)
    weight.grad_added_to_main_grad = False
    start = weight.main_grad.clone()
    inputs = [torch.randn(4, 3, 5, generator=gen).bfloat16() for _ in range(2)]
    for x in inputs:
        linear_with_grad_accumulation_and_async_allreduce(x, weight, None, True, False, False).float().sum().backward()
    # fp32 reference: d(sum y)/dW = ones[out, s*b] @ x[s*b, in], added twice
    expected = start + sum(torch.ones(6, 12) @ x.float().reshape(12, 5) for x in inputs)  # [s, b, in] -> [s*b, in]
    assert weight.grad_added_to_main_grad and weight.main_grad.dtype == torch.float32
    return weight.main_grad, expected


def test_half_precision_wgrad_into_fp32_main_grad_both_paths(monkeypatch):
    fused, expected = _accumulate_twice(monkeypatch, supported=True)
    assert torch.allclose(fused, expected, rtol=1e-6, atol=1e-5)  # fp32 products: no bf16 rounding
    fallback, expected_again = _accumulate_twice(monkeypatch, supported=False)
    assert torch.equal(expected, expected_again)
    assert torch.allclose(fallback, expected, rtol=2e-2, atol=5e-2)  # bf16-rounded partial products
    assert not torch.equal(fallback, fused)  # the two paths really differ: the switch is taken


def test_fp32_wgrad_uses_in_place_addmm(monkeypatch):
    def fail(*args):
        raise AssertionError("fp32 grads must not take the mixed-precision path")

    monkeypatch.setattr(layers, "_addmm_fp32_out", fail)
    monkeypatch.setattr(layers, "addmm_fp32_out_supported", lambda device, dtype: True)
    x, w = torch.randn(5, 2, 3), torch.randn(4, 3, requires_grad=True)
    w.main_grad = torch.ones(4, 3)
    linear_with_grad_accumulation_and_async_allreduce(x, w, None, True, False, False).sum().backward()
    assert torch.allclose(w.main_grad, 1 + torch.ones(4, 10) @ x.reshape(10, 3))  # [s, b, in] -> [s*b, in]


def test_forward_fuses_the_bias_and_keeps_skip_bias_semantics():
    torch.manual_seed(0)
    x = torch.randn(3, 2, 6, requires_grad=True)
    w, b = torch.randn(4, 6, requires_grad=True), torch.randn(4, requires_grad=True)
    y = linear_with_grad_accumulation_and_async_allreduce(x, w, b, False, False, False)
    assert torch.allclose(y, x @ w.t() + b, rtol=1e-6, atol=1e-6)
    y.square().sum().backward()
    ref_x, ref_w, ref_b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    F.linear(ref_x, ref_w, ref_b).square().sum().backward()
    for got, ref in ((x, ref_x), (w, ref_w), (b, ref_b)):
        assert torch.allclose(got.grad, ref.grad, rtol=1e-5, atol=1e-6)
    cfg = ModelParallelConfig(use_cpu_initialization=True)
    col = ColumnParallelLinear(6, 4, config=cfg, init_method=init_method_normal(0.3), bias=True, skip_bias_add=True)
    with torch.no_grad():
        col.bias.copy_(torch.arange(4.0))
    out, out_bias = col(x)
    assert out_bias is col.bias and torch.allclose(out, F.linear(x, col.weight), atol=1e-6)
    row = RowParallelLinear(4, 6, config=cfg, init_method=init_method_normal(0.3), bias=True, input_is_parallel=True,
                            skip_bias_add=False)
    with torch.no_grad():
        row.bias.copy_(torch.arange(6.0))
    out, out_bias = row(out)
    assert out_bias is None and torch.allclose(out, F.linear(F.linear(x, col.weight), row.weight, row.bias), atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_fp32_output_gemm_matches_reference():
    device = torch.device("cuda", torch.cuda.current_device())
    supported = layers.addmm_fp32_out_supported(device, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    grad_output = torch.randn(64, 32, generator=gen).to(device, torch.bfloat16)
    inputs = torch.randn(64, 48, generator=gen).to(device, torch.bfloat16)
    weight = torch.nn.Parameter(torch.zeros(32, 48, device=device, dtype=torch.bfloat16))
    weight.main_grad = torch.randn(32, 48, generator=gen).to(device)
    expected = weight.main_grad + grad_output.float().t() @ inputs.float()
    layers._accumulate_weight_grad(weight, grad_output, inputs)
    tolerance = 1e-4 if supported else 5e-2
    assert torch.allclose(weight.main_grad, expected, rtol=tolerance, atol=tolerance)
