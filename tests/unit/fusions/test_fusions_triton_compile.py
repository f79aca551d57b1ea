"""The fusions' Triton kernels compiled ahead of time for an H100/H200 (sm_90), no GPU needed. Skipped where
Triton is not installed (CPU CI); a development machine with Triton catches a kernel that would not compile
before a GPU job does."""
import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from megatron.core.fusions import _triton_qkv_rope, _triton_swiglu  # noqa: E402


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_swiglu_backward_kernel_compiles(dtype):
    signature = {"g_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "ffn": "i32",
                 "BLOCK": "constexpr"}
    source = ASTSource(fn=_triton_swiglu._swiglu_back_kernel, signature=signature,
                       constexprs={"BLOCK": _triton_swiglu._BLOCK})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": _triton_swiglu._WARPS}).asm["ptx"]
    assert ".entry" in ptx and "ex2.approx" in ptx  # the sigmoid's exponential


@pytest.mark.parametrize("rot", [128, 64], ids=["full-rotation", "half-rotation"])
def test_qkv_rope_kernels_compile(rot):
    constants = _triton_qkv_rope._constants(heads_per_group=2, head_dim=128, rot=rot)
    num_warps = constants.pop("num_warps")
    for kernel, pointers, ints in (
            (_triton_qkv_rope._qkv_rope_forward_kernel, ["qkv_ptr", "cos_ptr", "sin_ptr", "q_ptr", "k_ptr", "v_ptr"],
             ["tokens", "batch", "groups"]),
            (_triton_qkv_rope._qkv_rope_backward_kernel, ["dq_ptr", "dk_ptr", "dv_ptr", "cos_ptr", "sin_ptr", "out_ptr"],
             ["tokens", "batch", "groups"] + [f"{g}_{d}" for g in ("dq", "dk", "dv") for d in ("s", "b", "h")])):
        signature = {**{name: "*bf16" for name in pointers}, **{name: "i32" for name in ints},
                     **{name: "constexpr" for name in constants}}
        source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]
        assert ".entry" in ptx and "ld.global" in ptx and "st.global" in ptx


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_weighted_swiglu_backward_kernel_compiles(dtype):
    signature = {"g_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", "w_ptr": "*fp32", "out_ptr": f"*{dtype}",
                 "dw_ptr": "*fp32", "ffn": "i32", "BLOCK": "constexpr"}
    source = ASTSource(fn=_triton_swiglu._weighted_swiglu_back_kernel, signature=signature,
                       constexprs={"BLOCK": _triton_swiglu._BLOCK})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": _triton_swiglu._WARPS}).asm["ptx"]
    assert ".entry" in ptx and "ex2.approx" in ptx
