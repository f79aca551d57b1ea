"""The few collectives a checkpoint save/load needs; every one is a no-op without a process group."""
from typing import Any, List, Optional

import torch
import torch.distributed as dist


def is_distributed(process_group: Optional[dist.ProcessGroup] = None) -> bool:
    """True when a default process group exists (and `process_group` is not a single-rank group)."""
    return dist.is_available() and dist.is_initialized()


def get_rank(process_group: Optional[dist.ProcessGroup] = None) -> int:
    """Rank in `process_group` (0 without a process group)."""
    return dist.get_rank(process_group) if is_distributed() else 0


def get_world_size(process_group: Optional[dist.ProcessGroup] = None) -> int:
    """Size of `process_group` (1 without a process group)."""
    return dist.get_world_size(process_group) if is_distributed() else 1


def all_gather_object(obj: Any, process_group: Optional[dist.ProcessGroup] = None) -> List[Any]:
    """Every rank's `obj`, in rank order."""
    if not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(out, obj, group=process_group)
    return out


def barrier(process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Wait for every rank of `process_group`."""
    if is_distributed():
        dist.barrier(group=process_group)


def all_true(flag: bool, process_group: Optional[dist.ProcessGroup] = None) -> bool:
    """True when `flag` holds on every rank."""
    if not is_distributed():
        return flag
    device = torch.device("cpu")
    if dist.get_backend(process_group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=process_group)
    return bool(value.item())
