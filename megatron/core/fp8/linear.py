"""`y = x W^T + b` with FP8 GEMMs: the forward, the input-gradient and the weight-gradient GEMM.

Inputs and weights are quantized to E4M3, output gradients to E5M2 ('hybrid') or E4M3, each with one
scale per tensor (`recipe.TensorScaling`). The backward needs W and x in the other orientation; the
quantizing kernel writes those transposed copies in the same pass, and only the FP8 copies (not the
bf16 input, except with `--no-fp8-wgrad`) are kept for the backward. Communication stays outside (the caller wraps this with the TP
mappings), so this file is pure math and runs anywhere: FP8 tensor cores where there are some, an
fp32 emulation of the same numbers elsewhere (`kernels`).
"""
from typing import Callable, Optional

import torch

from megatron.core.fp8 import kernels
from megatron.core.fp8.params import fp8_copy_of
from megatron.core.fp8.recipe import Fp8LinearState


def weight_operand(weight: torch.Tensor, state: Fp8LinearState, transpose: bool, record: bool):
    """(w_q, w_q^T or None, scale_inv) of a linear's weight: its FP8 primary copy as it is (FP8 parameters,
    `fp8.params`), else the weight quantized under the layer's weight scaling."""
    copy = fp8_copy_of(weight)
    if copy is not None:
        return copy.data, copy.transposed() if transpose else None, copy.scale_inv
    return state.weight.quantize(weight.contiguous(), transpose=transpose, record=record)


def fp8_weight_gradient(g_q_t: Optional[torch.Tensor], g_inv: torch.Tensor, grad_2d: Optional[torch.Tensor],
                        kept_input: torch.Tensor, x_inv: torch.Tensor, weight: torch.Tensor, fp8_wgrad: bool,
                        wgrad_sink: Optional[Callable]) -> torch.Tensor:
    """The weight gradient [out, in] of a linear: with `fp8_wgrad` the FP8 GEMM of the transposed output
    gradient g_q_t [out, tokens] and the transposed input kept_input [in, tokens] (fp32 output when the sink
    adds into an fp32 `main_grad`), else grad_2d [tokens, out]^T @ kept_input [tokens, in] in the input's
    precision; handed to `wgrad_sink` when there is one."""
    sink_fp32 = wgrad_sink is not None and getattr(weight, "main_grad", None) is not None \
        and weight.main_grad.dtype == torch.float32
    if fp8_wgrad:
        # [out, tokens] x [in, tokens]^T -> [out, in]
        grad_weight = kernels.scaled_mm(g_q_t, kept_input, g_inv, x_inv, torch.float32 if sink_fp32 else weight.dtype)
    else:
        grad_weight = grad_2d.t().matmul(kept_input)  # [out, tokens] @ [tokens, in] -> [out, in]
    return wgrad_sink(weight, grad_weight) if wgrad_sink is not None else grad_weight


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, state: Fp8LinearState, wgrad_sink: Optional[Callable], grad_enabled: bool):
        # needs_input_grad says what requires grad, not whether autograd records this call (no_grad)
        need_dgrad, need_wgrad = (grad_enabled and needed for needed in ctx.needs_input_grad[:2])
        fp8_wgrad = state.recipe.wgrad
        # [..., in] -> [tokens, in]
        input_2d = input.reshape(-1, input.shape[-1]).contiguous()
        x_q, x_q_t, x_inv = state.input.quantize(input_2d, transpose=need_wgrad and fp8_wgrad, record=grad_enabled)
        w_q, w_q_t, w_inv = weight_operand(weight, state, need_dgrad, grad_enabled)
        out = kernels.scaled_mm(x_q, w_q, x_inv, w_inv, input.dtype, bias=bias, fast_accum=True)
        kept_input = (x_q_t if fp8_wgrad else input_2d) if need_wgrad else None
        ctx.save_for_backward(kept_input, x_inv, w_q_t, w_inv, weight)
        ctx.state, ctx.wgrad_sink, ctx.use_bias = state, wgrad_sink, bias is not None
        ctx.input_shape = input.shape
        # [tokens, out] -> [..., out]
        return out.reshape(*input.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        kept_input, x_inv, w_q_t, w_inv, weight = ctx.saved_tensors
        state = ctx.state
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fp8_wgrad = state.recipe.wgrad
        # [..., out] -> [tokens, out]
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        g_q, g_q_t, g_inv = state.grad_output.quantize(grad_2d, transpose=need_wgrad and fp8_wgrad)
        grad_input = None
        if need_dgrad:
            # [tokens, out] x [out, in] -> [tokens, in] -> [..., in]
            grad_input = kernels.scaled_mm(g_q, w_q_t, g_inv, w_inv, grad_output.dtype).reshape(ctx.input_shape)
        grad_weight = None
        if need_wgrad:
            grad_weight = fp8_weight_gradient(g_q_t, g_inv, grad_2d, kept_input, x_inv, weight, fp8_wgrad,
                                              ctx.wgrad_sink)
        grad_bias = grad_2d.sum(dim=0) if ctx.use_bias else None  # [tokens, out] -> [out]
        return grad_input, grad_weight, grad_bias, None, None, None


@torch.compiler.disable
def fp8_linear(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], state: Fp8LinearState,
               wgrad_sink: Optional[Callable] = None) -> torch.Tensor:
    """[..., in] x [out, in] (+ [out]) -> [..., out] through FP8 GEMMs.

    `wgrad_sink(weight, grad_weight)`, when given, takes the weight gradient (fp32 when `weight.main_grad`
    is fp32) and returns what autograd should get (gradient-accumulation fusion adds it into `main_grad`
    and returns a placeholder). Always runs eagerly: a compiled layer calls it as an opaque step (its
    kernels are Triton's and its scaling state is updated in place). Without autograd recording (no_grad:
    evaluation, the first pass of activation recompute) no transposed copies are made and delayed scaling
    does not add to its amax history.
    """
    return _Fp8Linear.apply(input, weight, bias, state, wgrad_sink, torch.is_grad_enabled())
