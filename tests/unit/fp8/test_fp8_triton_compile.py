"""The FP8 Triton kernels compiled ahead of time for an H100/H200 (sm_90), no GPU needed: they must compile
in every variant, convert with round-to-nearest-even and saturation, clamp with NaN-propagating min/max
and divide exactly. Skipped where Triton is not installed (CPU CI); a development machine with Triton
catches a kernel that would not compile before a GPU job does."""
import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from megatron.core.fp8 import _triton  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def _compile(fn, signature, constexprs, num_warps):
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=TARGET, options={"num_warps": num_warps}).asm["ptx"]


@pytest.mark.parametrize("fp8", ["fp8e4nv", "fp8e5"])
@pytest.mark.parametrize("write_t,amax_out", [(True, True), (True, False), (False, True), (False, False)])
def test_quantize_kernel_compiles_with_exact_rounding(fp8, write_t, amax_out):
    signature = {"x_ptr": "*bf16", "amax_ptr": "*fp32", "amax_len": "i32", "q_ptr": f"*{fp8}", "qt_ptr": f"*{fp8}",
                 "scale_inv_ptr": "*fp32", "partials_ptr": "*fp32", "M": "i32", "N": "i32", "fp8_max": "fp32",
                 "margin_mult": "fp32", "WRITE_T": "constexpr", "AMAX_OUT": "constexpr", "BLOCK_M": "constexpr",
                 "BLOCK_N": "constexpr", "AMAX_BLOCK": "constexpr"}
    for amax_block in (1, 16):  # the amax itself, or the maximum of a history
        ptx = _compile(_triton._quantize_kernel, signature,
                       {"WRITE_T": write_t, "AMAX_OUT": amax_out, "BLOCK_M": _triton._TILE_M,
                        "BLOCK_N": _triton._TILE_N, "AMAX_BLOCK": amax_block}, _triton._TILE_WARPS)
        target_type = "e4m3x2" if fp8 == "fp8e4nv" else "e5m2x2"
        assert f"cvt.rn.satfinite.{target_type}.f32" in ptx
        assert "max.NaN.f32" in ptx and "min.NaN.f32" in ptx and "div.rn.f32" in ptx


@pytest.mark.parametrize("history_block", [1, 4, 1024])
def test_record_amax_kernel_compiles(history_block):
    signature = {"partials_ptr": "*fp32", "n_partials": "i32", "history_ptr": "*fp32", "history_len": "i32",
                 "reference_len": "i32", "BLOCK": "constexpr", "HISTORY_BLOCK": "constexpr"}
    ptx = _compile(_triton._record_amax_kernel, signature,
                   {"BLOCK": _triton._RECORD_BLOCK, "HISTORY_BLOCK": history_block}, _triton._RECORD_WARPS)
    assert "max.NaN.f32" in ptx and "bar.sync" in ptx


@pytest.mark.parametrize("n_type", ["i32", "i64"])
def test_amax_kernel_compiles(n_type):
    ptx = _compile(_triton._amax_kernel, {"x_ptr": "*bf16", "partials_ptr": "*fp32", "n": n_type,
                                          "BLOCK": "constexpr"}, {"BLOCK": _triton._AMAX_BLOCK},
                   _triton._AMAX_WARPS)
    assert "max.NaN.f32" in ptx
