"""Global gradient norm, norm clipping and zero counting, reduced over the model-parallel ranks.

Each rank passes only the gradients it owns for the norm (no tied-embedding copy, no tensor-parallel
duplicate; see `param_is_not_shared` / `param_is_not_tensor_parallel_duplicate`), so that the sum
of squares all-reduced over the model-parallel group counts every gradient element exactly once.
Clipping then scales every gradient, duplicates included, by the same coefficient.

Host synchronisation note: the `*_tensor` variants keep the norm, the clip coefficient and the zero
count on the device, so an optimizer step under bf16/fp32 never waits for the GPU; the float-returning
Megatron functions are thin `.item()` wrappers around them for callers that want a number.

Design note: the TP-duplicate check reads `parallel_state` directly instead of importing
`tensor_parallel`, because `core/optimizer` may depend only on configs and `parallel_state`.
"""
import math
from typing import Iterable, List, Optional, Union

import torch
import torch.distributed as dist

from megatron.core import parallel_state


def param_is_not_shared(param: torch.Tensor) -> bool:
    """False for a parameter flagged `shared` (e.g. the last stage's copy of tied embeddings)."""
    return not getattr(param, "shared", False)


def _tensor_model_parallel_rank() -> int:
    if not parallel_state.model_parallel_is_initialized():
        return 0
    return parallel_state.get_tensor_model_parallel_rank()


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor) -> bool:
    """True for TP-split params (`tensor_model_parallel`) and, for replicated params, on TP rank 0 only."""
    return bool(getattr(param, "tensor_model_parallel", False)) or _tensor_model_parallel_rank() == 0


def _as_list(tensors: Union[torch.Tensor, Iterable[torch.Tensor]]) -> List[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    return list(tensors)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (torch FSDP2), the tensor itself otherwise."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _dtensor_group(tensor: torch.Tensor):
    """The data-parallel group a DTensor gradient is sharded over, or None."""
    mesh = getattr(tensor, "device_mesh", None)
    return mesh.get_group() if mesh is not None else None


def _reduction_device(tensors: List[torch.Tensor], group) -> torch.device:
    """Device for the reduction tensor: the grads' device, else what the group's backend needs."""
    if tensors:
        return tensors[0].device
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(tensor: torch.Tensor, op, group) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=op, group=group)


def _l2_norm_squared(grads: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of all elements, accumulated in fp32."""
    if not grads:
        return torch.zeros((), dtype=torch.float, device=device)
    same_dtype = all(g.dtype == torch.float32 for g in grads)
    if same_dtype and len({g.device for g in grads}) == 1:
        norms = torch._foreach_norm(grads, 2.0)
    else:
        norms = [torch.linalg.vector_norm(g, 2.0, dtype=torch.float32) for g in grads]
    per_tensor = torch.stack([n.to(device=device, dtype=torch.float32) for n in norms])
    return torch.sum(per_tensor * per_tensor)


def get_grad_norm_fp32_tensor(
    grads_for_norm: Union[List[torch.Tensor], torch.Tensor],
    norm_type: Union[int, float] = 2,
    grad_stats_parallel_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """`get_grad_norm_fp32` as a 0-dim float64 tensor on the reduction device: no host synchronisation.

    The per-rank sum (or max) is accumulated in fp32 and all-reduced; the p-th root is taken in
    float64, which is what Megatron's `total.item() ** (1 / p)` computes on the host.
    """
    grads = _as_list(grads_for_norm)
    data_parallel_group = None
    for grad in grads:
        data_parallel_group = _dtensor_group(grad) or data_parallel_group
    grads = [_local(grad) for grad in grads]
    norm_type = float(norm_type)
    device = _reduction_device(grads, grad_stats_parallel_group)
    if norm_type == math.inf:
        total = torch.zeros(1, dtype=torch.float, device=device)
        if grads:
            maxes = torch.stack([g.detach().abs().max().to(device=device, dtype=torch.float) for g in grads])
            total = torch.max(maxes).reshape(1)  # [] -> [1]
        op = dist.ReduceOp.MAX
    elif norm_type == 2.0:
        total = _l2_norm_squared([g.detach() for g in grads], device).reshape(1)  # [] -> [1]
        op = dist.ReduceOp.SUM
    else:
        total = torch.zeros(1, dtype=torch.float, device=device)
        for grad in grads:
            norm = torch.linalg.vector_norm(grad.detach(), norm_type, dtype=torch.float32)
            total += norm.to(device) ** norm_type
        op = dist.ReduceOp.SUM
    if data_parallel_group is not None:
        _all_reduce(total, op, data_parallel_group)
    _all_reduce(total, op, grad_stats_parallel_group)
    total = total[0].double()
    if norm_type == math.inf:
        return total
    if norm_type == 2.0:
        return total.sqrt()
    return total.pow(1.0 / norm_type)


def get_grad_norm_fp32(
    grads_for_norm: Union[List[torch.Tensor], torch.Tensor],
    norm_type: Union[int, float] = 2,
    grad_stats_parallel_group: Optional[dist.ProcessGroup] = None,
) -> float:
    """Norm of `grads_for_norm` over all ranks of `grad_stats_parallel_group`, computed in fp32.

    `norm_type` may be `inf` (max-abs, MAX-reduced) or any p (sum of |g|^p, SUM-reduced, then the p-th
    root). Gradients that are DTensors are additionally reduced over their data-parallel group.
    Returns a Python float (one host sync); the optimizers use `get_grad_norm_fp32_tensor`.
    """
    return get_grad_norm_fp32_tensor(grads_for_norm, norm_type, grad_stats_parallel_group).item()


def _scale_by_device_coefficient(grads: List[torch.Tensor], coefficient: torch.Tensor) -> None:
    """`grad *= coefficient` for every grad, grouped by (device, dtype) so that each foreach call gets a
    scalar tensor of its own device and dtype; fp32 grads see the fp32-rounded coefficient, as the
    host-side Megatron path does."""
    groups = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, dtype), group in groups.items():
        torch._foreach_mul_(group, coefficient.to(device=device, dtype=dtype))


def clip_grad_by_total_norm_fp32(
    parameters: Union[List[torch.Tensor], torch.Tensor],
    max_norm: Union[int, float],
    total_norm: Union[float, torch.Tensor],
    use_decoupled_grad: bool = False,
) -> None:
    """Scale every gradient of `parameters` by `max_norm / (total_norm + 1e-6)` when that is < 1.

    With `total_norm` a device tensor (from `get_grad_norm_fp32_tensor`) the coefficient is
    `clamp(max_norm / (total_norm + 1e-6), max=1)` computed on the device and always applied: no host
    branch, and a coefficient of exactly 1.0 leaves every value bit-identical.
    """
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = []
    for param in _as_list(parameters):
        grad = getattr(param, attr, None)
        if grad is not None:
            grads.append(_local(grad).detach())
    if not grads:
        return
    if isinstance(total_norm, torch.Tensor):
        coefficient = torch.clamp(max_norm / (total_norm.detach().double() + 1.0e-6), max=1.0)
        _scale_by_device_coefficient(grads, coefficient)
        return
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


def defer_clip_to_fused_adam(optimizer, max_norm: float, total_norm: torch.Tensor,
                             use_decoupled_grad: bool = False) -> bool:
    """Leave Megatron's clipping (`clip_grad_by_total_norm_fp32`) to the next step of a fused torch Adam /
    AdamW: its kernel divides every grad by the tensor `optimizer.grad_scale` while it reads it (the hook
    torch's GradScaler uses), so the clip costs no pass of its own over the grads. The divisor is
    `1 / clamp(max_norm / (total_norm + 1e-6), max=1)`, exactly 1.0 when nothing is clipped; the kernel
    writes the clipped grads back. Returns False (nothing set) when the optimizer cannot take it; whoever
    steps must drop the attribute afterwards (`optimizer.__dict__.pop("grad_scale", None)`)."""
    groups = optimizer.param_groups if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) else []
    fused = bool(groups) and all(group.get("fused") for group in groups)
    if not fused or use_decoupled_grad or not isinstance(total_norm, torch.Tensor):
        return False
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        return False  # somebody else (a GradScaler) drives these
    coefficient = torch.clamp(max_norm / (total_norm.detach().double() + 1.0e-6), max=1.0)
    optimizer.grad_scale = (1.0 / coefficient).float()
    return True


def count_zeros_fp32_tensor(
    parameters: Union[List[torch.Tensor], torch.Tensor],
    grad_stats_parallel_group: Optional[dist.ProcessGroup] = None,
    use_decoupled_grad: bool = False,
) -> torch.Tensor:
    """`count_zeros_fp32` as a 0-dim fp32 tensor on the reduction device: no host synchronisation."""
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    owned = []
    data_parallel_group = None
    for param in _as_list(parameters):
        grad = getattr(param, attr, None)
        if grad is not None and param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param):
            data_parallel_group = _dtensor_group(grad) or data_parallel_group
            owned.append(_local(grad).detach())
    device = _reduction_device(owned, grad_stats_parallel_group)
    total = torch.zeros(1, dtype=torch.float, device=device)
    for grad in owned:
        total += grad.numel() - torch.count_nonzero(grad).to(device)
    if data_parallel_group is not None:
        _all_reduce(total, dist.ReduceOp.SUM, data_parallel_group)
    _all_reduce(total, dist.ReduceOp.SUM, grad_stats_parallel_group)
    return total[0]


def count_zeros_fp32(
    parameters: Union[List[torch.Tensor], torch.Tensor],
    grad_stats_parallel_group: Optional[dist.ProcessGroup] = None,
    use_decoupled_grad: bool = False,
) -> float:
    """Number of zero gradient entries over owned (non-shared, non-TP-duplicate) params of all ranks."""
    return count_zeros_fp32_tensor(parameters, grad_stats_parallel_group, use_decoupled_grad).item()
