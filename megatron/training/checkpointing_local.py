"""Local non-persistent checkpoints (`--non-persistent-ckpt-type local`).

Every rank writes its own state to node-local storage (`--non-persistent-local-ckpt-dir`) without any
gather: `<dir>/rank_{global rank:05d}/iter_{iteration:07d}.pt`, written under a `.tmp` name, flushed to
disk and renamed, after which the rank's older iterations are removed. The file holds the rank's legacy
state dict (model chunks, optimizer, scheduler, this rank's RNG state, args, iteration) and, with the
distributed optimizer, the rank's own shard of fp32 parameters and Adam moments.

On load (`--load` with the same `--non-persistent-ckpt-type local` and directory), two small all-reduces
decide: when every rank holds the same newest iteration and it is newer than the persistent checkpoint
(and the global non-persistent one), each rank loads its own file. The files are per rank, so the world
size and the parallel layout must be those of the run that wrote them (checked, with a message naming
both). `--non-persistent-local-ckpt-algo` (`fully_parallel` or `atomic`) is accepted; both write each
rank's file atomically as above.
"""
import os
import re
from typing import Optional, Tuple

import torch

from megatron.core import mpu
from megatron.training.global_vars import get_args
from megatron.training.utils import print_rank_0

_FILE_RE = re.compile(r"^iter_(\d{7})\.pt$")


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _rank_dir(args) -> str:
    return os.path.join(args.non_persistent_local_ckpt_dir, f"rank_{_rank():05d}")


def _file(rank_dir: str, iteration: int) -> str:
    return os.path.join(rank_dir, f"iter_{iteration:07d}.pt")


def _layout() -> dict:
    return {"world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
            "rank": _rank(), "tensor_model_parallel_size": mpu.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": mpu.get_pipeline_model_parallel_world_size(),
            "data_parallel_size": mpu.get_data_parallel_world_size()}


def _distributed_optimizers(optimizer):
    chained = getattr(optimizer, "chained_optimizers", None)
    members = chained if chained is not None else [optimizer]
    return [opt for opt in members if hasattr(opt, "get_parameter_state_local")]


def _write_atomically(state, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_local_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_flops, state_dict_fn,
                          rng_state) -> None:
    """Write this rank's local checkpoint of `iteration` (every rank calls it; no communication)."""
    args = get_args()
    rank_dir = _rank_dir(args)
    os.makedirs(rank_dir, exist_ok=True)
    state = state_dict_fn(args, model, optimizer, opt_param_scheduler, [rng_state], iteration=iteration)
    state["num_floating_point_operations_so_far"] = float(num_flops or 0.0)
    state["local_layout"] = _layout()
    if not args.no_save_optim:
        shards = [opt.get_parameter_state_local() for opt in _distributed_optimizers(optimizer)]
        if shards:
            state["distrib_optim_local"] = shards
    path = _file(rank_dir, iteration)
    _write_atomically(state, path)
    for name in os.listdir(rank_dir):
        if name != os.path.basename(path) and (_FILE_RE.match(name) or name.endswith(".pt.tmp")):
            os.remove(os.path.join(rank_dir, name))
    print_rank_0(f"  saved local non-persistent checkpoint of iteration {iteration} under "
                 f"{args.non_persistent_local_ckpt_dir}")


def _newest_local_iteration(rank_dir: str) -> int:
    if not os.path.isdir(rank_dir):
        return -1
    found = [int(m.group(1)) for m in map(_FILE_RE.match, os.listdir(rank_dir)) if m]
    return max(found, default=-1)


def find_local_checkpoint(args, newer_than: int) -> Optional[Tuple[str, int]]:
    """(this rank's file, iteration) when every rank holds the same newest local iteration and it is newer
    than `newer_than`; None otherwise. Collective over the world."""
    if getattr(args, "non_persistent_ckpt_type", None) != "local" or not args.non_persistent_local_ckpt_dir:
        return None
    newest = _newest_local_iteration(_rank_dir(args))
    device = torch.device("cuda", torch.cuda.current_device()) if (
        torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl") else torch.device("cpu")
    bounds = torch.tensor([newest, -newest], dtype=torch.int64, device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(bounds, op=torch.distributed.ReduceOp.MIN)
    lowest, highest = int(bounds[0]), -int(bounds[1])
    if highest < 0:
        return None
    if lowest != highest:
        print_rank_0(f"WARNING: local non-persistent checkpoints under {args.non_persistent_local_ckpt_dir} differ "
                     f"between ranks (iterations {lowest}..{highest}, -1 = none); not loading them")
        return None
    if lowest <= newer_than:
        return None
    print_rank_0(f" the local non-persistent checkpoint (iteration {lowest}) is newer than the others; loading it")
    return _file(_rank_dir(args), lowest), lowest


def check_local_layout(state, path: str) -> None:
    """Raise naming both layouts when the file was written by another rank or parallel layout."""
    saved, current = state.get("local_layout"), _layout()
    if saved != current:
        raise ValueError(
            f"local checkpoint {path} was written with layout {saved} but this rank runs {current}: local "
            f"non-persistent checkpoints load only on the same world size and parallel layout; start from the "
            f"persistent checkpoint instead (remove {os.path.dirname(os.path.dirname(path))} or drop "
            f"--non-persistent-ckpt-type local).")


def load_local_optimizer_shards(optimizer, state) -> None:
    """Restore the distributed optimizers' own shards saved by `save_local_checkpoint`."""
    optimizers = _distributed_optimizers(optimizer)
    shards = state.get("distrib_optim_local", [])
    if len(shards) != len(optimizers):
        raise ValueError(f"the local checkpoint holds {len(shards)} distributed-optimizer shard states, this run "
                         f"has {len(optimizers)} distributed optimizers: --use-distributed-optimizer must match")
    for opt, shard in zip(optimizers, shards):
        opt.load_parameter_state_local(shard)
