"""Weight-gradient accumulation of the tensor-parallel linears (gradient-accumulation fusion).

Megatron needs Apex's `fused_weight_gradient_mlp_cuda` for `gradient_accumulation_fusion`; here the weight
gradient is accumulated straight into `weight.main_grad` in the linear backward: same dtype with one in-place
`addmm_`, bf16/fp16 into an fp32 `main_grad` with one fp32-output GEMM on CUDA where torch has it (probed once,
`addmm_fp32_out_supported`), else a half-precision matmul, a cast and an add. Without a `main_grad` (no DDP
wrapper) the weight gradient is returned to autograd as usual. Split out of `tensor_parallel.layers`, which
re-exports these names.
"""
import torch

from megatron.core.fusions.fused_grad_accumulation import accumulate_grad_

# (device, input dtype) -> whether `torch.addmm(..., out_dtype=torch.float32, out=main_grad)` works and
# matches the reference there; filled by `_probe_addmm_fp32_out` on first use.
_ADDMM_FP32_OUT_SUPPORT = {}


@torch.library.custom_op("megatron_core::accumulate_wgrad_fp32_", mutates_args=("main_grad",))
def accumulate_wgrad_fp32_(main_grad: torch.Tensor, grad_output_2d: torch.Tensor, input_2d: torch.Tensor) -> None:
    """main_grad [out, in] (fp32) += grad_output^T [out, s*b] @ input [s*b, in] (half precision), one
    GEMM with an fp32 output (CUDA only: torch has no CPU kernel for it).

    A custom op, so that `torch.compile` treats it as one opaque in-place call: tracing torch's
    `addmm(..., out_dtype=)` directly fails in the compiler's fake-tensor decomposition (torch 2.11),
    which made every compiled layer fall back to eager.
    """
    torch.addmm(main_grad, grad_output_2d.t(), input_2d, out_dtype=torch.float32, out=main_grad)


@accumulate_wgrad_fp32_.register_fake
def _accumulate_wgrad_fp32_fake(main_grad, grad_output_2d, input_2d) -> None:
    return None


def _addmm_fp32_out(main_grad, grad_output_2d, input_2d) -> None:
    """main_grad [out, in] += grad_output^T [out, s*b] @ input [s*b, in], one GEMM with an fp32 output."""
    accumulate_wgrad_fp32_(main_grad, grad_output_2d, input_2d)


def _probe_addmm_fp32_out(device: torch.device, dtype: torch.dtype) -> bool:
    """Try the fp32-output addmm on tiny tensors of `device`/`dtype` and compare with the reference
    (half-precision matmul in fp32, then add); any error or mismatch means 'not supported'."""
    generator = torch.Generator().manual_seed(0)
    grad_output = torch.randn(8, 4, generator=generator).to(device=device, dtype=dtype)
    inputs = torch.randn(8, 6, generator=generator).to(device=device, dtype=dtype)
    accumulator = torch.randn(4, 6, generator=generator).to(device=device)
    expected = accumulator + grad_output.float().t() @ inputs.float()
    try:
        _addmm_fp32_out(accumulator, grad_output, inputs)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return accumulator.dtype == torch.float32 and bool(torch.allclose(accumulator, expected, rtol=1e-2, atol=1e-2))


def addmm_fp32_out_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a `dtype` weight gradient can be accumulated into an fp32 `main_grad` on `device` by one
    fp32-output GEMM. CUDA only (CPU has no such kernel); probed once per (device, dtype) outside of
    compilation (a traced backward uses the answer an eager call or layer construction recorded)."""
    device = torch.device(device)
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    key = (device, dtype)
    if key not in _ADDMM_FP32_OUT_SUPPORT:
        if torch.compiler.is_compiling():
            return False
        _ADDMM_FP32_OUT_SUPPORT[key] = _probe_addmm_fp32_out(device, dtype)
    return _ADDMM_FP32_OUT_SUPPORT[key]


def _accumulate_weight_grad(weight, grad_output_2d, input_2d):
    """Add the weight gradient into `weight.main_grad`; return the placeholder grad Megatron's DDP expects.

    Eager only. Traced by `torch.compile` (a layer's `trace_when_compiled`, `--compile-linears on`), the
    linears return the weight gradient to autograd instead and DDP's hook adds it into `main_grad`: the flag
    set here is an attribute change torch.compile cannot keep inside an autograd.Function (dynamo would give
    up on the function and run it eagerly).

    Same dtype: one in-place addmm. bf16/fp16 into fp32 on CUDA: one GEMM with an fp32 output where
    the installed torch has it (`addmm_fp32_out_supported`), else a half-precision matmul, a cast and
    an add (three passes over the gradient).
    """
    main_grad = weight.main_grad
    # main_grad [out, in] += grad_output^T [out, s*b] @ input [s*b, in]
    if main_grad.dtype == grad_output_2d.dtype:
        main_grad.addmm_(grad_output_2d.t(), input_2d)
    elif main_grad.dtype == torch.float32 and addmm_fp32_out_supported(main_grad.device, grad_output_2d.dtype):
        _addmm_fp32_out(main_grad, grad_output_2d, input_2d)
    else:
        main_grad.add_(torch.matmul(grad_output_2d.t(), input_2d).to(main_grad.dtype))
    return _main_grad_placeholder(weight)


def _main_grad_placeholder(weight):
    """What a fused linear hands autograd once its weight gradient is in `main_grad`: under Megatron's DDP
    a placeholder its grad hook skips (the hook only runs when a grad reaches the param), else None."""
    if hasattr(weight, "grad_added_to_main_grad"):
        make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
        placeholder = make(weight.main_grad.shape, dtype=weight.dtype, device=weight.device, requires_grad=False)
        weight.grad_added_to_main_grad = True
        return placeholder
    return None


def add_weight_grad_to_main_grad(weight, grad_weight):
    """Gradient-accumulation fusion for a weight gradient computed elsewhere (the FP8 linears): add it into
    `weight.main_grad` and return the placeholder; without `main_grad`, return the gradient itself."""
    if getattr(weight, "main_grad", None) is None:
        return grad_weight.to(weight.dtype)
    accumulate_grad_(weight.main_grad, grad_weight)
    return _main_grad_placeholder(weight)


def _weight_grad(ctx, weight, grad_output_2d, input_2d):
    """A linear's weight gradient from grad_output [s*b, out] and input [s*b, in]: added into `main_grad` (the
    placeholder returned) when fused and eager, else returned as [out, in]."""
    if ctx.gradient_accumulation_fusion and hasattr(weight, "main_grad") and not torch.compiler.is_compiling():
        return _accumulate_weight_grad(weight, grad_output_2d, input_2d)
    return grad_output_2d.t().matmul(input_2d)  # [out, s*b] @ [s*b, in] -> [out, in]
