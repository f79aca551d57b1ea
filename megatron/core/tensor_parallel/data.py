"""`broadcast_data`: TP rank 0 reads a batch, every TP rank gets the same tensors."""
from typing import Dict, List

import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import broadcast_tensor, get_pg_backend

_MAX_DATA_DIM = 5


def _comm_device(group) -> torch.device:
    """Device the broadcast buffers live on: CPU for gloo (or without CUDA), else the current GPU."""
    if not torch.cuda.is_available() or group is None:
        return torch.device("cpu")
    if get_pg_backend(group) == "gloo":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _check_data_types(keys: List[str], data: Dict[str, torch.Tensor], target_dtype: torch.dtype) -> None:
    for key in keys:
        if data[key].dtype != target_dtype:
            raise ValueError(f"broadcast_data: {key} has dtype {data[key].dtype}, expected {target_dtype}")


def _build_key_size_numel_dictionaries(keys, data, group, src_rank, device):
    """Broadcast every key's shape from the source rank; return (sizes, numels, total numel)."""
    sizes = [0] * (_MAX_DATA_DIM * len(keys))
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        for index, key in enumerate(keys):
            if data[key].dim() >= _MAX_DATA_DIM:
                raise ValueError(f"broadcast_data: {key} has {data[key].dim()} dims; at most {_MAX_DATA_DIM - 1} allowed")
            for dim, size in enumerate(data[key].size()):
                sizes[index * _MAX_DATA_DIM + dim] = size
    sizes_tensor = torch.tensor(sizes, dtype=torch.long, device=device)
    broadcast_tensor(sizes_tensor, src_rank, group)
    sizes_cpu = sizes_tensor.cpu().tolist()
    key_size, key_numel, total_numel = {}, {}, 0
    for index, key in enumerate(keys):
        shape = []
        for size in sizes_cpu[index * _MAX_DATA_DIM:(index + 1) * _MAX_DATA_DIM]:
            if size <= 0:
                break
            shape.append(size)
        numel = 1
        for size in shape:
            numel *= size
        key_size[key], key_numel[key] = shape, numel
        total_numel += numel
    return key_size, key_numel, total_numel


def broadcast_data(keys: List[str], data: Dict[str, torch.Tensor], datatype: torch.dtype) -> Dict[str, torch.Tensor]:
    """Broadcast `data[key]` for every key from the TP source rank to the whole TP group.

    Only TP rank 0 needs real `data`; the others may pass None or {}. Every tensor must have dtype
    `datatype`. Returns a dict of tensors (views into one flat buffer) on the communication device.
    """
    group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
    src_rank = parallel_state.get_tensor_model_parallel_src_rank() if group is not None else 0
    device = _comm_device(group)
    key_size, key_numel, total_numel = _build_key_size_numel_dictionaries(keys, data, group, src_rank, device)
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        _check_data_types(keys, data, datatype)
        # every key -> [numel] -> one [total_numel] buffer
        flat = torch.cat([data[key].contiguous().view(-1) for key in keys], dim=0).to(device)
    else:
        flat = torch.empty(total_numel, device=device, dtype=datatype)
    broadcast_tensor(flat, src_rank, group)
    output, offset = {}, 0
    for key in keys:
        # [numel] -> original shape
        output[key] = flat.narrow(0, offset, key_numel[key]).view(key_size[key])
        offset += key_numel[key]
    return output
