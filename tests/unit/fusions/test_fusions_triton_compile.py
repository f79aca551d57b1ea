"""The fusions' Triton kernels compiled ahead of time for an H100/H200 (sm_90), no GPU needed. Skipped where
Triton is not installed (CPU CI); a development machine with Triton catches a kernel that would not compile
before a GPU job does."""
import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from megatron.core.fusions import _triton_swiglu  # noqa: E402


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_swiglu_backward_kernel_compiles(dtype):
    signature = {"g_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "ffn": "i32",
                 "BLOCK": "constexpr"}
    source = ASTSource(fn=_triton_swiglu._swiglu_back_kernel, signature=signature,
                       constexprs={"BLOCK": _triton_swiglu._BLOCK})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": _triton_swiglu._WARPS}).asm["ptx"]
    assert ".entry" in ptx and "ex2.approx" in ptx  # the sigmoid's exponential
