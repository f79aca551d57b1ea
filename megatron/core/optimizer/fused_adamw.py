"""The AdamW step of a mixed-precision optimizer fused with the copy of the updated fp32 main params into the
fp16/bf16 model params.

`step_with_model_copy(optimizer, main_params, model_params)` replaces `optimizer.step()` followed by
`torch._foreach_copy_(model_params, main_params)` for a torch `Adam`/`AdamW` with `fused=True` on a CUDA
device: every large main param (at least `FUSED_COPY_MIN_NUMEL` elements) is stepped by one Triton kernel
(`_adamw_triton.py`) that reads param, grad and both moments once and writes param, moments and the model
copy in the same pass; the other params of the optimizer (small ones, fp32 model params, anything the kernel
does not take) go through torch's own fused AdamW, as in `optimizer.step()`. The caller copies the model
params of those. The optimizer state stays torch's (`step` as an fp32 device tensor, `exp_avg`, `exp_avg_sq`,
created lazily as torch does), so checkpoints and state dicts do not change. Hyperparameters are read from
`param_groups` at every step; `optimizer.grad_scale` (the deferred clip, `clip_grads.defer_clip_to_fused_adam`,
or a GradScaler's scale) and `optimizer.found_inf` have torch's meaning.

Dispatch note: the fused path is taken only where it computes torch's AdamW (to fp32 rounding: see
`_adamw_triton`'s arithmetic note): the optimizer is exactly
`torch.optim.Adam`/`AdamW` (no subclass, no patched `step`, no step hooks, not under CUDA-graph capture),
every group has `fused=True` and no amsgrad/maximize/differentiable, L2 (non-decoupled) weight decay is zero,
hyperparameters are Python numbers, grads are dense and real; a param takes the kernel when it, its grad,
its moments and its model copy are contiguous CUDA tensors on the current device, fp32 (model: fp16/bf16) of
the same size. Otherwise `step_with_model_copy` returns None, has done nothing, and the caller runs
`optimizer.step()` and its copy exactly as before.
"""
import functools
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch.optim.adam import adam as torch_adam
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from megatron.core.utils import module_available

# Smaller params stay with torch's multi-tensor kernel (one launch for many tensors) and the foreach copy: a
# kernel launch per tensor would cost more than the pass it saves.
FUSED_COPY_MIN_NUMEL = 1 << 20

_MODEL_DTYPES = (torch.float16, torch.bfloat16)
_GROUP_FLAGS_OFF = ("amsgrad", "maximize", "differentiable")


@functools.lru_cache(maxsize=None)
def _kernels_available() -> bool:
    """Whether Triton is installed (asked once; nothing is imported)."""
    return module_available("triton")


@functools.lru_cache(maxsize=None)
def _triton_kernels():
    """The Triton kernel module, imported at the first launch."""
    from megatron.core.optimizer import _adamw_triton

    return _adamw_triton


def _kernel_device(tensor: torch.Tensor) -> bool:
    """Whether the kernel can run on `tensor`'s device: a CUDA device that is the current one (the launch
    goes to the current device and stream)."""
    return tensor.is_cuda and tensor.device.index == torch.cuda.current_device()


def _launch_step(param, grad, exp_avg, exp_avg_sq, model_param, step, **hyperparameters) -> None:
    """Run the fused kernel on one param (see `_adamw_triton.adamw_step`)."""
    _triton_kernels().adamw_step(param, grad, exp_avg, exp_avg_sq, model_param, step, **hyperparameters)


def _capturing() -> bool:
    """Whether a CUDA graph is being captured (torch's step checks `capturable` then; leave it to torch)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _scalar_tensor_ok(value: Optional[torch.Tensor]) -> bool:
    """None, or a one-element fp32 tensor (what the kernel reads for `grad_scale` / `found_inf`)."""
    return value is None or (torch.is_tensor(value) and value.dtype == torch.float32 and value.numel() == 1)


def _group_supported(group: Dict[str, Any]) -> bool:
    """Whether torch's fused AdamW of this group is the math the kernel implements."""
    if not group.get("fused") or any(group.get(flag) for flag in _GROUP_FLAGS_OFF):
        return False
    beta1, beta2 = group["betas"]
    numbers = (group["lr"], beta1, beta2, group["weight_decay"], group["eps"])
    if not all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in numbers):
        return False
    return bool(group.get("decoupled_weight_decay")) or group["weight_decay"] == 0


def optimizer_supported(optimizer: Any) -> bool:
    """Whether `optimizer.step()` may be replaced by the fused step (the optimizer-level conditions only)."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or "step" in optimizer.__dict__:
        return False
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return False
    if _global_optimizer_pre_hooks or _global_optimizer_post_hooks or _capturing():
        return False
    if not (_scalar_tensor_ok(getattr(optimizer, "grad_scale", None))
            and _scalar_tensor_ok(getattr(optimizer, "found_inf", None))):
        return False
    return all(_group_supported(group) for group in optimizer.param_groups)


def _fp32_like(tensor: Any, param: torch.Tensor) -> bool:
    """A contiguous fp32 tensor of `param`'s shape and device."""
    return (torch.is_tensor(tensor) and tensor.dtype == torch.float32 and tensor.device == param.device
            and tensor.shape == param.shape and tensor.is_contiguous())


def _takes_kernel(param: torch.Tensor, model_param: Optional[torch.Tensor], state: Optional[Dict]) -> bool:
    """Whether this param (with a grad) is stepped by the kernel; else by torch's fused AdamW."""
    if model_param is None or param.numel() < FUSED_COPY_MIN_NUMEL or not _kernel_device(param):
        return False
    if not (_fp32_like(param, param) and _fp32_like(param.grad, param)):
        return False
    if not (model_param.dtype in _MODEL_DTYPES and model_param.device == param.device
            and model_param.numel() == param.numel() and model_param.is_contiguous()):
        return False
    if not state:
        return True
    step = state.get("step")
    return (_fp32_like(state.get("exp_avg"), param) and _fp32_like(state.get("exp_avg_sq"), param)
            and torch.is_tensor(step) and step.dtype == torch.float32 and step.numel() == 1
            and step.device == param.device)


def _adam_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The param's Adam state, created as torch's `Adam._init_group` creates it for fused=True."""
    state = optimizer.state[param]
    if len(state) == 0:
        state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


def _torch_fused_step(optimizer: torch.optim.Optimizer, group: Dict[str, Any], params: List[torch.Tensor]) -> None:
    """What `optimizer.step()` does for these params of `group` (torch's fused kernel)."""
    if not params:
        return
    states = [_adam_state(optimizer, param) for param in params]
    beta1, beta2 = group["betas"]
    torch_adam(
        params, [param.grad for param in params], [state["exp_avg"] for state in states],
        [state["exp_avg_sq"] for state in states], [], [state["step"] for state in states],
        foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
        fused=group["fused"], grad_scale=getattr(optimizer, "grad_scale", None),
        found_inf=getattr(optimizer, "found_inf", None), has_complex=False,
        decoupled_weight_decay=group.get("decoupled_weight_decay", False), amsgrad=group["amsgrad"],
        beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
        maximize=group["maximize"])


def _kernel_step(optimizer: torch.optim.Optimizer, group: Dict[str, Any], params: List[torch.Tensor],
                 model_params: List[torch.Tensor]) -> None:
    """Step `params` of `group` with the kernel, writing `model_params`; the step counters move as in torch's
    `_fused_adam` (incremented before the update, `found_inf` subtracted after it)."""
    if not params:
        return
    states = [_adam_state(optimizer, param) for param in params]
    device = params[0].device
    grad_scale = getattr(optimizer, "grad_scale", None)
    found_inf = getattr(optimizer, "found_inf", None)
    grad_scale = grad_scale.to(device, non_blocking=True) if grad_scale is not None else None
    found_inf = found_inf.to(device, non_blocking=True) if found_inf is not None else None
    steps = [state["step"] for state in states]
    torch._foreach_add_(steps, 1)
    beta1, beta2 = group["betas"]
    for param, model_param, state in zip(params, model_params, states):
        _launch_step(param, param.grad, state["exp_avg"], state["exp_avg_sq"], model_param, state["step"],
                     lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                     grad_scale=grad_scale, found_inf=found_inf)
    if found_inf is not None:
        torch._foreach_sub_(steps, [found_inf] * len(steps))


@torch.no_grad()
def step_with_model_copy(optimizer: Any, main_params: Sequence[torch.Tensor],
                         model_params: Sequence[torch.Tensor]) -> Optional[List[torch.Tensor]]:
    """`optimizer.step()` that also writes `model_params[i]` (fp16/bf16) from the updated `main_params[i]` (the
    optimizer's own fp32 param objects) where the fused kernel applies.

    Returns the main params whose model copy was written (the caller copies the others), or None when the fused
    path does not apply: then nothing was done and the caller runs `optimizer.step()` and the full copy.
    """
    if not main_params or not _kernels_available() or not optimizer_supported(optimizer):
        return None
    model_of = {id(main): model for main, model in zip(main_params, model_params)}
    plans = []
    for group in optimizer.param_groups:
        kernel, rest = [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse or torch.is_complex(param):
                return None
            takes = _takes_kernel(param, model_of.get(id(param)), optimizer.state.get(param))
            (kernel if takes else rest).append(param)
        plans.append((group, kernel, rest))
    if not any(kernel for _, kernel, _ in plans):
        return None
    written = []
    for group, kernel, rest in plans:
        _torch_fused_step(optimizer, group, rest)
        _kernel_step(optimizer, group, kernel, [model_of[id(param)] for param in kernel])
        written.extend(kernel)
    return written
