"""`check_param_hashes_across_dp_replicas` (exported by `megatron.core.utils`, as in Megatron): do the data-parallel
replicas of a model hold identical weights? (`--check-weight-hash-across-dp-replicas-interval`.)

Every parameter is hashed with SHA-1 over its fp32 bytes on the host; the hashes are all-gathered over the
data-parallel group (expert parameters, `allreduce=False`, over the expert data-parallel group) and compared with
replica 0's (or with every replica's with `cross_check`). It copies every parameter to the host: a debugging
check for occasional use.
"""
import hashlib
import logging
from typing import List

import torch

from megatron.core import parallel_state
from megatron.core.fp8.params import weight_values

logger = logging.getLogger(__name__)


def _param_hash(param: torch.Tensor) -> torch.Tensor:
    """SHA-1 of the parameter's values as fp32 (an FP8-primary weight's dequantized FP8 values), as a uint8
    tensor [20]."""
    values = weight_values(param, torch.float32).to("cpu").contiguous().numpy()
    return torch.frombuffer(bytearray(hashlib.sha1(values).digest()), dtype=torch.uint8)


def _gather_device(group) -> torch.device:
    if torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _hashes_match(params, local_hashes: List[torch.Tensor], group, cross_check: bool) -> bool:
    """Compare this rank's hashes with the group's (logging the parameters that differ from replica 0's)."""
    local = torch.stack(local_hashes).to(_gather_device(group))  # n x [20] -> [n, 20]
    gathered = [torch.zeros_like(local) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(gathered, local, group=group)
    match_first = torch.equal(local, gathered[0])
    if not match_first:
        for i, (chunk_id, name, _) in enumerate(params):
            if not torch.equal(local[i], gathered[0][i]):
                logger.info("[Rank %d] Hash not matching for %s in model chunk%d", torch.distributed.get_rank(),
                            name, chunk_id)
    if cross_check:
        return all(torch.equal(local, other) for other in gathered)
    return match_first


def check_param_hashes_across_dp_replicas(model: List[torch.nn.Module], cross_check: bool = False) -> bool:
    """True when every parameter of the model chunks `model` equals DP replica 0's (with `cross_check`: every
    replica's). Collective over the data-parallel (and expert data-parallel) group."""
    dense, expert = [], []
    dense_hashes, expert_hashes = [], []
    for chunk_id, chunk in enumerate(model):
        for name, param in chunk.named_parameters():
            target, hashes = (dense, dense_hashes) if getattr(param, "allreduce", True) else (expert, expert_hashes)
            target.append((chunk_id, name, param))
            hashes.append(_param_hash(param))
    all_match = True
    for params, hashes, group in ((dense, dense_hashes, parallel_state.get_data_parallel_group()),
                                  (expert, expert_hashes, parallel_state.get_expert_data_parallel_group())):
        if params:
            all_match &= _hashes_match(params, hashes, group, cross_check)
    return all_match


__all__ = ["check_param_hashes_across_dp_replicas"]
