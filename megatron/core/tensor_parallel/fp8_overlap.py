"""FP8 GEMMs with `--tp-comm-overlap`: the sequence-parallel all-gather and reduce-scatter pipelined with the
FP8 GEMMs of a tensor-parallel linear (what Transformer Engine's userbuffers do for its FP8 linears).

The pipelines are those of `tensor_parallel.overlap` (one GEMM per sequence chunk, the chunks travelling
around the TP ring while the GEMMs run), with FP8 operands:

- column-parallel (all-gather + GEMM): each rank quantizes its own sequence chunk of the input, with the scale
  of the whole gathered input (the amax reduced over TP), and the FP8 bytes travel (half of bf16's); each
  arrived chunk goes through the FP8 GEMM. The gathered FP8 input is kept for the weight gradient. Backward:
  the input gradient's GEMM + reduce-scatter, chunk by chunk, from the FP8 output gradient;
- row-parallel (GEMM + reduce-scatter): the partial products of the FP8 GEMM per destination chunk travel
  the ring and are summed; backward: the output gradient, quantized chunk-wise with the whole gradient's
  scale, is all-gathered in FP8 with the input-gradient GEMM of each chunk, then the weight gradient.

Quantizing a chunk with the whole tensor's scale gives the same FP8 bytes as quantizing the gathered tensor,
so the results equal the FP8 linear without overlap (`fp8.linear`) up to the GEMMs' row blocking (the partial
sums of the reduce-scatter are added in ring order). FP8 chunks move as uint8 views over the point-to-point
ring of `mappings.ring_exchange_async` (any backend; the copy-engine transport carries bf16 pipelines only).
This module only schedules GEMMs around the transfers.
"""
from typing import Callable, Optional

import torch

from megatron.core.fp8 import kernels
from megatron.core.fp8.linear import fp8_weight_gradient, weight_operand
from megatron.core.fp8.recipe import Fp8LinearState
from megatron.core.tensor_parallel.mappings import _rank, _world_size, all_gather_along_first_dim, ring_exchange_async


def fp8_all_gather_matmul(x_q: torch.Tensor, x_inv: torch.Tensor, w_q: torch.Tensor, w_inv: torch.Tensor,
                          out_dtype: torch.dtype, bias: Optional[torch.Tensor], group, fast_accum: bool = False):
    """x_q [c, b, k] FP8 (this rank's sequence chunk) -> (out [c*tp, b, n], gathered x_q [c*tp, b, k]): the
    all-gathered FP8 input times w_q [n, k]^T, scaled (+ bias), each chunk's GEMM overlapping the next
    chunk's transfer."""
    world_size, rank = _world_size(group), _rank(group)
    chunk, width = x_q.shape[0], x_q.shape[-1]
    # [c, b, k] -> [c*tp, b, k] (uint8 bytes of the FP8 values: every backend moves them)
    gathered = torch.empty((chunk * world_size,) + tuple(x_q.shape[1:]), dtype=torch.uint8, device=x_q.device)
    gathered[rank * chunk:(rank + 1) * chunk].copy_(x_q.view(torch.uint8))
    output = torch.empty((chunk * world_size,) + tuple(x_q.shape[1:-1]) + (w_q.shape[0],), dtype=out_dtype,
                         device=x_q.device)
    current = gathered[rank * chunk:(rank + 1) * chunk]
    for step in range(world_size):
        pending = None
        if step < world_size - 1:
            arriving = (rank - step - 1) % world_size
            pending = ring_exchange_async(current, gathered[arriving * chunk:(arriving + 1) * chunk], group)
        owner = (rank - step) % world_size
        # [c, b, k] -> [c*b, k] @ [n, k]^T -> [c*b, n], written into this chunk's rows of [c*tp, b, n]
        product = kernels.scaled_mm(current.view(x_q.dtype).reshape(-1, width), w_q, x_inv, w_inv, out_dtype,
                                    bias=bias, fast_accum=fast_accum)
        output[owner * chunk:(owner + 1) * chunk].view(-1, w_q.shape[0]).copy_(product)
        if pending is not None:
            current = pending.wait()
    return output, gathered.view(x_q.dtype)


def fp8_matmul_reduce_scatter(x_q: torch.Tensor, x_inv: torch.Tensor, w_q: torch.Tensor, w_inv: torch.Tensor,
                              out_dtype: torch.dtype, group, fast_accum: bool = False) -> torch.Tensor:
    """x_q [s, b, k] FP8 -> [s/tp, b, n]: (x_q w_q^T) scaled, summed over the TP ranks, this rank's sequence
    chunk; at step j rank r computes its partial product for chunk (r - j - 1) mod tp, adds the running sum
    received from the previous rank and passes it on."""
    world_size, rank = _world_size(group), _rank(group)
    if x_q.shape[0] % world_size != 0:
        raise ValueError(f"FP8 GEMM + reduce-scatter: sequence length {x_q.shape[0]} is not divisible by the TP "
                         f"size {world_size}")
    chunk, width = x_q.shape[0] // world_size, x_q.shape[-1]
    shape = (chunk,) + tuple(x_q.shape[1:-1]) + (w_q.shape[0],)
    pending = sent = None
    for step in range(world_size):
        target = (rank - step - 1) % world_size
        # [c, b, k] -> [c*b, k] @ [n, k]^T -> [c*b, n] -> [c, b, n]
        rows = x_q[target * chunk:(target + 1) * chunk].reshape(-1, width)
        partial = kernels.scaled_mm(rows, w_q, x_inv, w_inv, out_dtype, fast_accum=fast_accum).view(shape)
        if pending is not None:
            partial.add_(pending.wait())
            del sent  # the previous send is complete once its exchange has been waited for
        if step < world_size - 1:
            sent = partial
            pending = ring_exchange_async(sent, torch.empty_like(partial), group)
    return partial


def _needs(ctx, grad_enabled):
    # needs_input_grad says what requires grad, not whether autograd records this call (no_grad)
    return tuple(grad_enabled and needed for needed in ctx.needs_input_grad[:2])


class _Fp8AllGatherLinear(torch.autograd.Function):
    """Column-parallel FP8 linear under sequence parallelism with the input's all-gather pipelined."""

    @staticmethod
    def forward(ctx, input, weight, bias, state: Fp8LinearState, wgrad_sink, grad_enabled, group):
        need_dgrad, need_wgrad = _needs(ctx, grad_enabled)
        fp8_wgrad = state.recipe.wgrad
        # [s/tp, b, in] -> [s/tp*b, in]
        local_2d = input.reshape(-1, input.shape[-1]).contiguous()
        x_q, _, x_inv = state.input.quantize(local_2d, transpose=False, record=grad_enabled)
        w_q, w_q_t, w_inv = weight_operand(weight, state, need_dgrad, grad_enabled)
        out, gathered = fp8_all_gather_matmul(x_q.view(input.shape), x_inv, w_q, w_inv, input.dtype, bias, group,
                                              fast_accum=True)
        kept = None
        if need_wgrad:
            # [s, b, in] -> [in, s*b] (FP8) for the weight-gradient GEMM, or the bf16 gathered input
            kept = (gathered.reshape(-1, gathered.shape[-1]).t().contiguous() if fp8_wgrad
                    else all_gather_along_first_dim(input, group).reshape(-1, input.shape[-1]))
        ctx.save_for_backward(kept, x_inv, w_q_t, w_inv, weight)
        ctx.state, ctx.wgrad_sink, ctx.use_bias, ctx.group = state, wgrad_sink, bias is not None, group
        return out

    @staticmethod
    def backward(ctx, grad_output):
        kept, x_inv, w_q_t, w_inv, weight = ctx.saved_tensors
        state = ctx.state
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # [s, b, out/tp] -> [s*b, out/tp]
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        g_q, g_q_t, g_inv = state.grad_output.quantize(grad_2d, transpose=need_wgrad and state.recipe.wgrad)
        grad_input = None
        if need_dgrad:
            # [s, b, out/tp] x [in, out/tp]^T -> [s, b, in], reduce-scattered along s: [s/tp, b, in]
            grad_input = fp8_matmul_reduce_scatter(g_q.view(grad_output.shape), g_inv, w_q_t, w_inv,
                                                   grad_output.dtype, ctx.group)
        grad_weight = None
        if need_wgrad:
            grad_weight = fp8_weight_gradient(g_q_t, g_inv, grad_2d, kept, x_inv, weight, state.recipe.wgrad,
                                              ctx.wgrad_sink)
        grad_bias = grad_2d.sum(dim=0) if ctx.use_bias else None  # [s*b, out/tp] -> [out/tp]
        return grad_input, grad_weight, grad_bias, None, None, None, None


class _Fp8ReduceScatterLinear(torch.autograd.Function):
    """Row-parallel FP8 linear under sequence parallelism with the output's reduce-scatter pipelined."""

    @staticmethod
    def forward(ctx, input, weight, state: Fp8LinearState, wgrad_sink, grad_enabled, group):
        need_dgrad, need_wgrad = _needs(ctx, grad_enabled)
        fp8_wgrad = state.recipe.wgrad
        # [s, b, in/tp] -> [s*b, in/tp]
        input_2d = input.reshape(-1, input.shape[-1]).contiguous()
        x_q, x_q_t, x_inv = state.input.quantize(input_2d, transpose=need_wgrad and fp8_wgrad, record=grad_enabled)
        w_q, w_q_t, w_inv = weight_operand(weight, state, need_dgrad, grad_enabled)
        out = fp8_matmul_reduce_scatter(x_q.view(input.shape), x_inv, w_q, w_inv, input.dtype, group,
                                        fast_accum=True)
        kept = (x_q_t if fp8_wgrad else input_2d) if need_wgrad else None
        ctx.save_for_backward(kept, x_inv, w_q_t, w_inv, weight)
        ctx.state, ctx.wgrad_sink, ctx.group = state, wgrad_sink, group
        return out

    @staticmethod
    def backward(ctx, grad_output):
        kept, x_inv, w_q_t, w_inv, weight = ctx.saved_tensors
        state = ctx.state
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # [s/tp, b, out] -> [s/tp*b, out], quantized with the whole gradient's scale (amax reduced over TP)
        local_2d = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        g_q, _, g_inv = state.grad_output.quantize(local_2d, transpose=False)
        gathered_g = None
        grad_input = None
        if need_dgrad:
            # [s/tp, b, out] -> (all-gathered [s, b, out]) x [in/tp, out]^T -> [s, b, in/tp]
            grad_input, gathered_g = fp8_all_gather_matmul(g_q.view(grad_output.shape), g_inv, w_q_t, w_inv,
                                                           grad_output.dtype, None, ctx.group)
        grad_weight = None
        if need_wgrad:
            if gathered_g is None:
                # [s/tp, b, out] -> [s, b, out] (uint8 bytes of the FP8 values)
                gathered_g = all_gather_along_first_dim(g_q.view(torch.uint8).view(grad_output.shape),
                                                        ctx.group).view(g_q.dtype)
            # [s, b, out] -> [s*b, out]
            gathered_2d = gathered_g.reshape(-1, gathered_g.shape[-1])
            # --no-fp8-wgrad: the bf16 output gradient, all-gathered [s*b, out]
            grad_2d = None if state.recipe.wgrad else all_gather_along_first_dim(
                grad_output.contiguous(), ctx.group).reshape(-1, grad_output.shape[-1])
            g_q_t = gathered_2d.t().contiguous() if state.recipe.wgrad else None  # [out, s*b]
            grad_weight = fp8_weight_gradient(g_q_t, g_inv, grad_2d, kept, x_inv, weight, state.recipe.wgrad,
                                              ctx.wgrad_sink)
        return grad_input, grad_weight, None, None, None, None


@torch.compiler.disable
def fp8_linear_all_gather_overlap(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                  state: Fp8LinearState, group, wgrad_sink: Optional[Callable] = None):
    """[s/tp, b, in] (this rank's sequence chunk) x [out/tp, in] (+ [out/tp]) -> [s, b, out/tp]: the
    column-parallel FP8 linear with the sequence all-gather pipelined (`state.input` must reduce its amax over
    `group`); `wgrad_sink` as in `fp8.linear.fp8_linear`."""
    return _Fp8AllGatherLinear.apply(input, weight, bias, state, wgrad_sink, torch.is_grad_enabled(), group)


@torch.compiler.disable
def fp8_linear_reduce_scatter_overlap(input: torch.Tensor, weight: torch.Tensor, state: Fp8LinearState, group,
                                      wgrad_sink: Optional[Callable] = None) -> torch.Tensor:
    """[s, b, in/tp] x [out, in/tp] -> [s/tp, b, out]: the row-parallel FP8 linear with the sequence
    reduce-scatter pipelined (`state.grad_output` must reduce its amax over `group`); no bias (the layer adds
    it after the reduction)."""
    return _Fp8ReduceScatterLinear.apply(input, weight, state, wgrad_sink, torch.is_grad_enabled(), group)


__all__ = ["fp8_all_gather_matmul", "fp8_matmul_reduce_scatter", "fp8_linear_all_gather_overlap",
           "fp8_linear_reduce_scatter_overlap"]
