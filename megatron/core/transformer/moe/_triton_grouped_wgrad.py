"""Triton kernel for the experts' grouped weight gradient, accumulated straight into an fp32 `main_grad`
(gradient-accumulation fusion): `grouped_wgrad_accumulate_(main_grad, x, dy, offsets)` adds, for every
expert g, x[rows_g]^T @ dy[rows_g] to main_grad[g] in one launch. It replaces a bf16 `torch._grouped_mm`
weight gradient followed by a separate fp32 `main_grad.add_` (that add re-reads and re-writes all of
`main_grad` and reads the bf16 gradient once more).

Kernel design:
- Every program owns one [BLOCK_K, BLOCK_M] tile of one expert's [K, M] gradient: the grid is
  (tiles_k * tiles_m, G). The launch order walks axis 0 first, so the programs of one expert run together
  and its rows of `x` and `dy` stay in L2 while they are read once per tile. Within an expert the tiles go
  in bands of GROUP_K k-tiles walked column by column (`_tile_of_program`), so that programs running at the
  same time share both their `x` columns and their `dy` columns.
- A program reads its expert's row range [offsets[g-1], offsets[g]) from `offsets` and reduces over it in
  steps of BLOCK_R rows, `tl.dot(x_block^T, dy_block)` into an fp32 accumulator. The one partial step at
  the end of the range masks the rows past the expert's end (loaded as zeros, so they add nothing); group
  sizes need not be multiples of any block. Columns past K or M are not masked in the loop: their indices
  wrap around (`% K`, `% M`) so every load stays in bounds, and the epilogue's masks drop those columns.
- Epilogue: the tile of `main_grad` is loaded, the fp32 accumulator added, the sum stored, in
  `epilogue_split` column slices so that only one slice's main_grad values are in registers beside the
  accumulator (with 128x128 tiles and 8 warps: 112 registers a thread in 4 slices, 186 in one, which leaves
  room for one program per SM only). An empty expert's programs skip everything, so its `main_grad[g]` is
  left bit-for-bit unchanged.
- fp32 inputs use IEEE fp32 products (no TF32), as torch's matmul does by default; they are for tests and
  fallbacks, not speed.

The kernels use only Triton's core builtins, not its standard library's `@triton.jit` helpers (`tl.cdiv`,
`tl.zeros`): the CPU test runs a copy of this module in Triton's interpreter beside a compiled import of
Triton, and interpreted code cannot call compiled helpers. The kernel is defined only when Triton is
installed, so importing this module never fails and never imports an optional package on machines without it
(CPU CI walks and imports every module).
"""
from dataclasses import dataclass
from typing import Optional

import torch

from megatron.core.utils import module_available


@dataclass(frozen=True)
class WgradLaunch:
    """One launch setting of the grouped weight-gradient kernel."""

    block_k: int
    """Rows of the output tile (the K dim of x); a power of two >= 16."""
    block_m: int
    """Columns of the output tile (the M dim of dy); a power of two >= 16."""
    block_r: int
    """Rows of x and dy reduced per step; a power of two >= 16."""
    group_k: int
    """k-tiles per band of the tile order: programs running together share x's and dy's columns in L2."""
    num_warps: int
    """Warps per program."""
    num_stages: int
    """Software-pipeline depth of the row loop (shared-memory buffers of x and dy blocks)."""
    epilogue_split: int = 1
    """Column slices (1, 2 or 4) in which the epilogue adds the tile into main_grad (fewer live registers)."""

    def __post_init__(self):
        """Raise one ValueError naming every field the kernel cannot be compiled with."""
        problems = [f"{name} ({value}) must be a power of two >= 16 (tl.dot and tl.arange need it)"
                    for name, value in (("block_k", self.block_k), ("block_m", self.block_m),
                                        ("block_r", self.block_r)) if value < 16 or value & (value - 1)]
        if self.epilogue_split not in (1, 2, 4):
            problems.append(f"epilogue_split ({self.epilogue_split}) must be 1, 2 or 4")
        if self.group_k < 1 or self.num_stages < 1 or self.num_warps not in (1, 2, 4, 8, 16, 32):
            problems.append(f"group_k ({self.group_k}) and num_stages ({self.num_stages}) must be >= 1 and "
                            f"num_warps ({self.num_warps}) a power of two <= 32")
        if problems:
            raise ValueError("WgradLaunch: " + "; ".join(problems) + ".")


# Launch settings per input dtype. 16-bit inputs: 128x128 output tiles with 64-row steps, 8 warps (two
# warpgroups of Hopper's wgmma.m64n128k16, 64 accumulator registers a thread), 3 stages (96 KiB of shared
# memory) and the epilogue in 4 slices (112 registers a thread, compiled for sm_90 with Triton 3.9): two
# programs fit on one SM, so one's epilogue (an fp32 read-modify-write of its 64 KiB main_grad tile, which
# takes a time comparable to its row loop at ~1024 rows per expert) overlaps the other's row loop. A 128x256 tile needs
# 144 KiB and 200 registers (one program per SM, its epilogue exposed); 4 stages need 128 KiB (one per SM).
# fp32 inputs take 32-row steps (FMA products, 64 KiB). benchmarks/gpu/grouped_wgrad_bench.py --sweep times
# other settings on a GPU.
_HALF = WgradLaunch(block_k=128, block_m=128, block_r=64, group_k=8, num_warps=8, num_stages=3, epilogue_split=4)
LAUNCH = {
    torch.bfloat16: _HALF,
    torch.float16: _HALF,
    torch.float32: WgradLaunch(block_k=128, block_m=128, block_r=32, group_k=8, num_warps=8, num_stages=3,
                               epilogue_split=4),
}

if module_available("triton"):
    import triton
    import triton.language as tl

    @triton.jit
    def _tile_of_program(pid, tiles_k, tiles_m, GROUP_K: tl.constexpr):
        """(k tile, m tile) of an expert's `pid`-th tile: bands of GROUP_K k-tiles, each walked m-column by
        m-column, k fastest (the last band may be narrower)."""
        tiles_per_band = GROUP_K * tiles_m
        first_k = (pid // tiles_per_band) * GROUP_K
        band_k = tl.minimum(tiles_k - first_k, GROUP_K)
        in_band = pid % tiles_per_band
        return first_k + in_band % band_k, in_band // band_k

    @triton.jit
    def _reduce_rows(acc, x_ptr, dy_ptr, start, end, k_load, m_load, stride_xn, stride_xk, stride_dn, stride_dm,
                     BLOCK_R: tl.constexpr, INPUT_PRECISION: tl.constexpr):
        """acc [BLOCK_K, BLOCK_M] fp32 + x[start:end, k_load]^T @ dy[start:end, m_load]."""
        rows = tl.arange(0, BLOCK_R)
        first = start.to(tl.int64)  # row offsets in int64: x and dy may hold 2**31 elements and more
        x_ptrs = x_ptr + first * stride_xn + rows[:, None] * stride_xn + k_load[None, :] * stride_xk  # [R, BK]
        dy_ptrs = dy_ptr + first * stride_dn + rows[:, None] * stride_dn + m_load[None, :] * stride_dm  # [R, BM]
        for row in tl.range(start, end, BLOCK_R):
            in_group = (row + rows < end)[:, None]  # [R, 1]: rows past the expert's end load as zeros
            x_block = tl.load(x_ptrs, mask=in_group, other=0.0)
            dy_block = tl.load(dy_ptrs, mask=in_group, other=0.0)
            # [R, BK]^T @ [R, BM] -> [BK, BM]
            acc = tl.dot(tl.trans(x_block), dy_block, acc, input_precision=INPUT_PRECISION)
            x_ptrs += BLOCK_R * stride_xn
            dy_ptrs += BLOCK_R * stride_dn
        return acc

    @triton.jit
    def _column_halves(tile):
        """The left and right column halves of `tile` [R, C] -> two [R, C / 2]."""
        rows: tl.constexpr = tile.shape[0]
        half: tl.constexpr = tile.shape[1] // 2
        # [R, C] -> [R, 2, C / 2] -> [R, C / 2, 2] -> 2 x [R, C / 2]
        return tl.split(tl.permute(tl.reshape(tile, (rows, 2, half)), (0, 2, 1)))

    @triton.jit
    def _add_columns(tile_ptr, part, ks, first_m, K, M, stride_gk, stride_gm):
        """main_grad[ks, first_m:first_m + n] += part [BK, n], where inside [K, M]."""
        ms = first_m + tl.arange(0, part.shape[1])
        ptrs = tile_ptr + ks[:, None] * stride_gk + ms[None, :] * stride_gm  # [BK, n]
        in_bounds = (ks[:, None] < K) & (ms[None, :] < M)
        tl.store(ptrs, tl.load(ptrs, mask=in_bounds) + part, mask=in_bounds)

    @triton.jit
    def _add_tile(tile_ptr, acc, ks, first_m, K, M, stride_gk, stride_gm, EPILOGUE_SPLIT: tl.constexpr):
        """main_grad[ks, first_m:first_m + BM] += acc [BK, BM] in EPILOGUE_SPLIT column slices (1, 2 or 4):
        a slice's main_grad values need registers only while it is added."""
        if EPILOGUE_SPLIT == 1:
            _add_columns(tile_ptr, acc, ks, first_m, K, M, stride_gk, stride_gm)
        else:
            left, right = _column_halves(acc)
            width: tl.constexpr = left.shape[1]
            if EPILOGUE_SPLIT == 2:
                _add_columns(tile_ptr, left, ks, first_m, K, M, stride_gk, stride_gm)
                _add_columns(tile_ptr, right, ks, first_m + width, K, M, stride_gk, stride_gm)
            else:
                tl.static_assert(EPILOGUE_SPLIT == 4, "EPILOGUE_SPLIT must be 1, 2 or 4")
                quarter: tl.constexpr = width // 2
                first, second = _column_halves(left)
                _add_columns(tile_ptr, first, ks, first_m, K, M, stride_gk, stride_gm)
                _add_columns(tile_ptr, second, ks, first_m + quarter, K, M, stride_gk, stride_gm)
                third, fourth = _column_halves(right)
                _add_columns(tile_ptr, third, ks, first_m + width, K, M, stride_gk, stride_gm)
                _add_columns(tile_ptr, fourth, ks, first_m + width + quarter, K, M, stride_gk, stride_gm)

    @triton.jit
    def _grouped_wgrad_kernel(main_grad_ptr, x_ptr, dy_ptr, offsets_ptr, K, M, stride_xn, stride_xk, stride_dn,
                              stride_dm, stride_gg, stride_gk, stride_gm, BLOCK_K: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_K: tl.constexpr,
                              EPILOGUE_SPLIT: tl.constexpr, INPUT_PRECISION: tl.constexpr):
        """main_grad[g, tile] += x[rows_g, tile's k]^T @ dy[rows_g, tile's m]; program (tile, g)."""
        group = tl.program_id(1)
        start = tl.load(offsets_ptr + group - 1, mask=group > 0, other=0)
        end = tl.load(offsets_ptr + group)
        if start < end:
            tiles_k = (K + BLOCK_K - 1) // BLOCK_K
            tiles_m = (M + BLOCK_M - 1) // BLOCK_M
            tile_k, tile_m = _tile_of_program(tl.program_id(0), tiles_k, tiles_m, GROUP_K)
            ks = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
            first_m = tile_m * BLOCK_M
            # Wrapped indices keep the loop's loads in bounds without masks; the epilogue drops those columns.
            acc = _reduce_rows(tl.full((BLOCK_K, BLOCK_M), 0.0, dtype=tl.float32), x_ptr, dy_ptr, start, end,
                               ks % K, (first_m + tl.arange(0, BLOCK_M)) % M, stride_xn, stride_xk, stride_dn,
                               stride_dm, BLOCK_R, INPUT_PRECISION)
            _add_tile(main_grad_ptr + group.to(tl.int64) * stride_gg, acc, ks, first_m, K, M, stride_gk, stride_gm,
                      EPILOGUE_SPLIT)


_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_operands(main_grad: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor) -> None:
    """Raise one ValueError listing every way the operands do not fit the kernel's contract."""
    problems = []
    if x.dim() != 2 or dy.dim() != 2 or main_grad.dim() != 3 or offsets.dim() != 1:
        problems.append(f"expected x [N, K], dy [N, M], main_grad [G, K, M] and offsets [G], got shapes "
                        f"{tuple(x.shape)}, {tuple(dy.shape)}, {tuple(main_grad.shape)} and {tuple(offsets.shape)}")
    elif (x.shape[0] != dy.shape[0] or tuple(main_grad.shape) != (offsets.shape[0], x.shape[1], dy.shape[1])):
        problems.append(f"shapes do not match: x {tuple(x.shape)}, dy {tuple(dy.shape)}, main_grad "
                        f"{tuple(main_grad.shape)}, offsets {tuple(offsets.shape)} (want main_grad [G, K, M] with "
                        f"G = len(offsets), K = x.shape[1], M = dy.shape[1])")
    if x.dtype != dy.dtype or x.dtype not in _INPUT_DTYPES:
        problems.append(f"x and dy must share one dtype of {_INPUT_DTYPES}, got {x.dtype} and {dy.dtype}")
    if main_grad.dtype != torch.float32:
        problems.append(f"main_grad must be fp32, got {main_grad.dtype}")
    if offsets.dtype != torch.int32:
        problems.append(f"offsets must be int32 cumulative end offsets (torch._grouped_mm's `offs`), got "
                        f"{offsets.dtype}")
    devices = {t.device for t in (main_grad, x, dy, offsets)}
    if len(devices) != 1:
        problems.append(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    if problems:
        raise ValueError("grouped_wgrad_accumulate_: " + "; ".join(problems) + ".")


def grouped_wgrad_accumulate_(main_grad: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor,
                              *, launch: Optional[WgradLaunch] = None) -> None:
    """main_grad[g] += x[rows_g]^T @ dy[rows_g] for every expert g, in place, products summed in fp32.

    x [N, K] and dy [N, M]: bf16, fp16 or fp32 (both the same), rows grouped by expert (any strides).
    offsets [G] int32 on the same device: cumulative END offsets, expert g owns rows offsets[g-1]..offsets[g]
    (offsets[-1] = N; rows past it are not read), as `torch._grouped_mm` takes them as `offs`; group sizes
    are arbitrary, empty ones included (their main_grad[g] is not touched). main_grad [G, K, M] fp32 (any
    strides, e.g. a view of a flat grad buffer). `launch` overrides the dtype's entry of LAUNCH. Needs
    Triton (a CUDA device, or CPU tensors under TRITON_INTERPRET=1)."""
    _check_operands(main_grad, x, dy, offsets)
    _launch(main_grad, x, dy, offsets, launch or LAUNCH[x.dtype])


def _launch(main_grad: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, launch: WgradLaunch):
    """Launch the kernel on checked operands; return Triton's compiled kernel (its `n_regs`, `n_spills` and
    `metadata.shared` are what benchmarks/gpu/grouped_wgrad_bench.py reports), None where nothing is to do."""
    groups, k, m = main_grad.shape
    if groups == 0 or k == 0 or m == 0 or x.shape[0] == 0:
        return None
    # Axis 0: an expert's tiles (in `_tile_of_program`'s order); axis 1: the experts.
    grid = (triton.cdiv(k, launch.block_k) * triton.cdiv(m, launch.block_m), groups)
    return _grouped_wgrad_kernel[grid](
        main_grad, x, dy, offsets, k, m, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1),
        main_grad.stride(0), main_grad.stride(1), main_grad.stride(2), BLOCK_K=launch.block_k,
        BLOCK_M=launch.block_m, BLOCK_R=launch.block_r, GROUP_K=launch.group_k,
        EPILOGUE_SPLIT=launch.epilogue_split, INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=launch.num_warps, num_stages=launch.num_stages)


__all__ = ["LAUNCH", "WgradLaunch", "grouped_wgrad_accumulate_"]
