"""The experts' grouped weight gradient accumulated into fp32 main_grad
(`megatron.core.transformer.moe._triton_grouped_wgrad.grouped_wgrad_accumulate_`).

On CPU:
- the launch settings and the operands are validated (no Triton needed);
- the module imports and validates without Triton;
- where Triton is installed (not in CI): the kernel in Triton's interpreter on fp32 inputs (the interpreter's
  bf16 arithmetic is not the GPU's) against an fp64 loop of matmuls, with group sizes that are no multiple of
  any block, an empty group, a group of several row blocks, partial tiles along K and M, every epilogue split
  and a band order with a narrower last band; and the default launches compiled ahead of time for sm_90
  (wgmma for 16-bit inputs, shared memory and registers that let two programs share an SM, no spills; also
  for operands with no 16-element alignment).
On a GPU (`gpu` marker): bf16 at the experts' fc1 and fc2 shapes (balanced and 4:1 skewed groups with an
empty one) against an fp64 reference and against `torch._grouped_mm` + `main_grad.add_`, the path it replaces.
"""
import importlib.util
import os
import re
import subprocess

import pytest
import torch

import megatron.core.utils
from megatron.core.transformer.moe import _triton_grouped_wgrad as wgrad
from tests.harness import load_interpreted

MODULE_PATH = wgrad.__file__
SMALL_LAUNCH = wgrad.WgradLaunch(block_k=32, block_m=32, block_r=16, group_k=2, num_warps=4, num_stages=2)


def grouped_wgrad_reference(x: torch.Tensor, dy: torch.Tensor, offsets_host_list) -> torch.Tensor:
    """[G, K, M] fp64: x[rows_g]^T @ dy[rows_g] per group g, rows_g = offsets[g-1]..offsets[g] (cumulative
    end offsets on the host, as torch._grouped_mm's `offs`)."""
    out = torch.zeros(len(offsets_host_list), x.shape[1], dy.shape[1], dtype=torch.float64, device=x.device)
    start = 0
    for group, end in enumerate(offsets_host_list):
        out[group] = x[start:end].double().t() @ dy[start:end].double()  # [K, n_g] @ [n_g, M] -> [K, M]
        start = end
    return out


def _end_offsets(sizes):
    """Cumulative end offsets of group `sizes`, as a host list."""
    ends, total = [], 0
    for size in sizes:
        total += size
        ends.append(total)
    return ends


def _operands(sizes, k, m, dtype=torch.float32, device="cpu", seed=0):
    """x [N, K], dy [N, M], int32 offsets [G] and a main_grad [G, K, M] with non-zero values."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    x = torch.randn(n, k, generator=gen).to(device, dtype)
    dy = torch.randn(n, m, generator=gen).to(device, dtype)
    offsets = torch.tensor(_end_offsets(sizes), dtype=torch.int32, device=device)
    main_grad = torch.randn(len(sizes), k, m, generator=gen).to(device)
    return x, dy, offsets, main_grad


def _max_rel_error(actual, expected):
    """max |actual - expected| / max |expected|."""
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


# --------------------------------------------------------------------------------------------------
# Validation (no Triton needed)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields,message", [
    (dict(block_k=24), "block_k (24) must be a power of two >= 16"),
    (dict(block_r=8), "block_r (8) must be a power of two >= 16"),
    (dict(epilogue_split=3), "epilogue_split (3) must be 1, 2 or 4"),
    (dict(num_warps=6), "num_warps (6) a power of two"),
])
def test_launch_settings_are_validated(fields, message):
    settings = dict(block_k=32, block_m=32, block_r=16, group_k=2, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match=re.escape(message)):
        wgrad.WgradLaunch(**{**settings, **fields})


def test_operands_are_checked_before_any_launch():
    x, dy, offsets, main_grad = _operands([3, 5], 16, 16)
    cases = [
        ((main_grad, x, dy[:, :8], offsets), "shapes do not match"),
        ((main_grad, x, dy.half(), offsets), "x and dy must share one dtype"),
        ((main_grad.double(), x, dy, offsets), "main_grad must be fp32"),
        ((main_grad, x, dy, offsets.long()), "offsets must be int32"),
        ((main_grad, x[None], dy, offsets), "expected x [N, K]"),
        ((main_grad[:1], x, dy, offsets), "shapes do not match"),
    ]
    for operands, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            wgrad.grouped_wgrad_accumulate_(*operands)
    with pytest.raises(ValueError, match="main_grad must be fp32.*offsets must be int32"):  # all problems at once
        wgrad.grouped_wgrad_accumulate_(main_grad.half(), x, dy, offsets.long())


def test_module_imports_and_validates_without_triton(monkeypatch):
    monkeypatch.setattr(megatron.core.utils, "module_available", lambda name: name != "triton")
    spec = importlib.util.spec_from_file_location("_triton_grouped_wgrad_without_triton", MODULE_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not hasattr(module, "_grouped_wgrad_kernel") and not hasattr(module, "triton")
    assert repr(module.LAUNCH[torch.bfloat16]) == repr(wgrad.LAUNCH[torch.bfloat16])
    x, dy, offsets, main_grad = _operands([3, 5], 16, 16)
    with pytest.raises(ValueError, match="main_grad must be fp32"):
        module.grouped_wgrad_accumulate_(main_grad.double(), x, dy, offsets)


# --------------------------------------------------------------------------------------------------
# The kernel in Triton's interpreter (skipped where Triton is not installed)
# --------------------------------------------------------------------------------------------------

# Messages of interpreter failures that are limits of a Triton version, not bugs of the kernel: Triton 3.6's
# interpreter cannot run loops whose bounds are runtime values (a program id's `__index__` fails on its
# one-element array).
_INTERPRETER_LIMITS = ("0-dimensional",)


@pytest.fixture(scope="module")
def interpreted():
    """A copy of `_triton_grouped_wgrad` whose kernel runs in Triton's interpreter (numpy, on CPU tensors).
    Triton itself is imported compiled first (importorskip), as in any test process that has used it."""
    pytest.importorskip("triton")
    module = load_interpreted(MODULE_PATH, "_triton_grouped_wgrad_interpreted")
    x, dy, offsets, main_grad = _operands([3, 20], 16, 16)
    try:
        module.grouped_wgrad_accumulate_(main_grad, x, dy, offsets, launch=SMALL_LAUNCH)
    except Exception as error:  # the interpreter's own failure, whatever its type
        if any(limit in str(error) for limit in _INTERPRETER_LIMITS):
            pytest.skip(f"this Triton's interpreter cannot run the kernel: {error}")
        raise
    return module


@pytest.mark.parametrize("launch", [
    SMALL_LAUNCH,  # 2 x 3 tiles of 32x32 in one band of 2 k-tiles; partial tiles along K (48) and M (80)
    wgrad.WgradLaunch(block_k=16, block_m=64, block_r=32, group_k=2, num_warps=4, num_stages=2, epilogue_split=4),
    wgrad.WgradLaunch(block_k=16, block_m=32, block_r=16, group_k=2, num_warps=4, num_stages=2, epilogue_split=2),
], ids=["32x32x16", "16x64x32-split4", "16x32x16-split2"])
def test_interpreted_kernel_is_the_reference(interpreted, launch):
    # 70 rows: four full 16-row blocks and a partial one; 37: a partial block at a group edge.
    # The 16-row k-tiles make three bands of two with a narrower last band (48 / 16 = 3 k-tiles).
    sizes = [5, 0, 37, 70]
    x, dy, offsets, main_grad = _operands(sizes, 48, 80)
    main_grad[1, ::2] = -0.0  # adding a zero gradient would turn these into +0.0
    before = main_grad.clone()
    interpreted.grouped_wgrad_accumulate_(main_grad, x, dy, offsets, launch=launch)
    expected = before.double() + grouped_wgrad_reference(x, dy, _end_offsets(sizes))
    assert torch.equal(main_grad[1].view(torch.int32), before[1].view(torch.int32))  # the empty group: untouched
    for group in (0, 2, 3):
        assert _max_rel_error(main_grad[group], expected[group]) < 1e-4, group
        assert not torch.equal(main_grad[group], before[group])


def test_interpreted_kernel_on_views_and_strided_inputs(interpreted):
    """main_grad as a view into a flat buffer (a grad bucket), x a column slice of a wider tensor, dy a
    transposed copy, offsets a view behind a non-zero element: nothing outside the view is written, the
    strides are honoured, the first group starts at row 0."""
    sizes = [6, 0, 21, 18]
    x, dy, _, _ = _operands(sizes, 40, 24)
    offsets = torch.tensor([9] + _end_offsets(sizes), dtype=torch.int32)[1:]  # group 0 must not read before it
    wide = torch.zeros(x.shape[0], 56)
    wide[:, 8:48] = x
    dy_strided = dy.t().contiguous().t()  # [N, M] with strides (1, N)
    bucket = torch.randn(7 + 4 * 40 * 24 + 5)
    bucket_before = bucket.clone()
    main_grad = bucket[7:7 + 4 * 40 * 24].view(4, 40, 24)  # [G, K, M] view
    interpreted.grouped_wgrad_accumulate_(main_grad, wide[:, 8:48], dy_strided, offsets, launch=SMALL_LAUNCH)
    expected = bucket_before[7:7 + 4 * 40 * 24].view(4, 40, 24).double() + grouped_wgrad_reference(
        x, dy, _end_offsets(sizes))
    assert _max_rel_error(main_grad, expected) < 1e-4
    assert torch.equal(bucket[:7], bucket_before[:7]) and torch.equal(bucket[-5:], bucket_before[-5:])
    assert torch.equal(main_grad[1], bucket_before[7 + 40 * 24:7 + 2 * 40 * 24].view(40, 24))


def test_interpreted_kernel_with_every_group_empty(interpreted):
    x, dy = torch.randn(4, 16), torch.randn(4, 32)  # rows past offsets[-1] are not read
    offsets = torch.zeros(3, dtype=torch.int32)
    main_grad = torch.randn(3, 16, 32)
    before = main_grad.clone()
    interpreted.grouped_wgrad_accumulate_(main_grad, x, dy, offsets, launch=SMALL_LAUNCH)
    assert torch.equal(main_grad, before)


# --------------------------------------------------------------------------------------------------
# The default launch compiled for Hopper (ahead of time, no GPU needed)
# --------------------------------------------------------------------------------------------------


def _compile_for_sm90(dtype, launch, aligned=True):
    """The kernel compiled for sm_90 as the launcher specializes it: for contiguous operands whose pointers,
    sizes and row strides are multiples of 16 (`aligned`), or for ones where none is: (ptx, shared bytes,
    cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = wgrad._grouped_wgrad_kernel
    type_name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    signature = {"main_grad_ptr": "*fp32", "x_ptr": f"*{type_name}", "dy_ptr": f"*{type_name}",
                 "offsets_ptr": "*i32"}
    signature.update({name: "i32" for name in ("K", "M", "stride_xn", "stride_dn", "stride_gg", "stride_gk")})
    constexprs = dict(stride_xk=1, stride_dm=1, stride_gm=1, BLOCK_K=launch.block_k, BLOCK_M=launch.block_m,
                      BLOCK_R=launch.block_r, GROUP_K=launch.group_k, EPILOGUE_SPLIT=launch.epilogue_split,
                      INPUT_PRECISION="ieee" if dtype == torch.float32 else "tf32")
    signature.update({name: "constexpr" for name in constexprs})
    divisible = [name for name, kind in signature.items() if kind != "constexpr"] if aligned else []
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    return compiled.asm["ptx"], compiled.metadata.shared, compiled.asm["cubin"]


def _resource_usage(cubin, tmp_path):
    """(registers, stack bytes, local bytes) a thread, from cuobjdump -res-usage; None without cuobjdump."""
    from triton import knobs

    cuobjdump = knobs.nvidia.cuobjdump.path
    if not cuobjdump or not os.path.exists(cuobjdump):
        return None
    path = tmp_path / "kernel.cubin"
    path.write_bytes(cubin)
    report = subprocess.run([cuobjdump, "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", report)
    assert found, report
    return tuple(int(value) for value in found.groups())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_default_launches_fit_two_programs_per_sm90_sm(dtype, tmp_path):
    pytest.importorskip("triton")
    launch = wgrad.LAUNCH[dtype]
    ptx, shared, cubin = _compile_for_sm90(dtype, launch)
    if dtype != torch.float32:
        type_name = "bf16" if dtype == torch.bfloat16 else "f16"
        assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.{type_name}\.{type_name}", ptx)
    assert "cp.async" in ptx  # the row loop is software-pipelined
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx  # the epilogue moves 16 bytes at a time
    # Two programs an SM: H100/H200 have 228 KiB of shared memory (1 KiB of it reserved per program) and
    # 64 Ki registers an SM.
    assert 2 * (shared + 1024) <= 228 * 1024, shared
    usage = _resource_usage(cubin, tmp_path)
    if usage is None:
        pytest.skip("no cuobjdump beside this Triton to read the register count")
    registers, stack, local = usage
    assert stack == 0 and local == 0, (stack, local)  # no spills
    assert 2 * launch.num_warps * 32 * registers <= 64 * 1024, registers


def test_default_launch_compiles_for_unaligned_operands(tmp_path):
    pytest.importorskip("triton")
    ptx, _, cubin = _compile_for_sm90(torch.bfloat16, wgrad.LAUNCH[torch.bfloat16], aligned=False)
    assert "wgmma.mma_async" in ptx
    usage = _resource_usage(cubin, tmp_path)
    assert usage is None or usage[1:] == (0, 0), usage


# --------------------------------------------------------------------------------------------------
# On a GPU
# --------------------------------------------------------------------------------------------------

FC1, FC2 = (2048, 11264), (5632, 2048)  # (K, M) of the experts' fc1 and fc2 weight gradients
BALANCED = [1024] * 8
SKEWED = [2047, 515, 2049, 0, 509, 1537, 1023, 513]  # 4:1 skew, an empty group, no multiple of 64


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [FC1, FC2], ids=["fc1", "fc2"])
@pytest.mark.parametrize("sizes", [BALANCED, SKEWED], ids=["balanced", "skewed"])
def test_bf16_production_shapes_against_fp64_and_grouped_mm(shape, sizes):
    x, dy, offsets, main_grad = _operands(sizes, *shape, dtype=torch.bfloat16, device="cuda")
    before = main_grad.clone()
    wgrad.grouped_wgrad_accumulate_(main_grad, x, dy, offsets)
    gradient = grouped_wgrad_reference(x, dy, _end_offsets(sizes))
    # bf16 products are exact in fp32: only the fp32 sums differ from fp64 (a few fp32 ulps per 16-row step
    # even where the tensor cores truncate); a bf16 rounding anywhere would show as ~1e-3.
    error = (main_grad.double() - before.double() - gradient).norm() / gradient.norm()
    assert error.item() < 2e-5, error.item()
    # The path it replaces: torch._grouped_mm's gradient, rounded to bf16 (that alone is ~1.7e-3 of the
    # gradient's norm for such values), added in fp32.
    torch_path = before + torch._grouped_mm(x.t(), dy, offs=offsets).float()  # [K, N] x [N, M] -> [G, K, M]
    error = (main_grad - torch_path).double().norm() / gradient.norm()
    assert error.item() < 2.5e-3, error.item()
    for group, size in enumerate(sizes):
        if size == 0:
            assert torch.equal(main_grad[group], before[group])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_odd_shapes_and_every_dtype_on_gpu(dtype):
    """K and M no multiple of any tile, a few rows per group, main_grad a view into a flat buffer."""
    sizes = [3, 0, 130, 1, 64, 77]
    x, dy, offsets, _ = _operands(sizes, 200, 328, dtype=dtype, device="cuda")
    bucket = torch.randn(11 + 6 * 200 * 328, device="cuda")
    main_grad = bucket[11:].view(6, 200, 328)  # [G, K, M]
    before = bucket.clone()
    wgrad.grouped_wgrad_accumulate_(main_grad, x, dy, offsets)
    expected = before[11:].view(6, 200, 328).double() + grouped_wgrad_reference(x, dy, _end_offsets(sizes))
    assert _max_rel_error(main_grad, expected) < 1e-4
    assert torch.equal(bucket[:11], before[:11]) and torch.equal(main_grad[1], before[11:].view(6, 200, 328)[1])
