"""Distributed (`torch_dist`) checkpoints of the training loop: save (sync or async), load, format detection.

Layout (spec §4c): `<save>/iter_{:07d}/` with `common.pt`, `.metadata`, `__{rank}_{k}.distcp` and
`metadata.json` (written last by `megatron.core.dist_checkpointing`). The state dict is Megatron's
`generate_state_dict` with sharded values: `model` (or `model0`, `model1`, ... per virtual-pipeline chunk)
from `sharded_state_dict()`, `optimizer` from `optimizer.sharded_state_dict(model_sd, is_loading)`
(model-space keys, reshardable), `rng_state` as a ShardedObject of shape (PP, TP) (plus DP with
--data-parallel-random-init), the scheduler, args as plain data, iteration and FLOPs in `common.pt`.

Design note (publish, then track): every rank writes into `<save>/.tmp_iter_{:07d}/`; after the library's
finalize step has written `metadata.json`, rank 0 renames the directory to `iter_{:07d}` and only then
replaces the tracker. With --async-save that happens in the request's finalize callback, which the
training loop runs (`maybe_finalize_async_save`) once every rank's background write is done. A writer
killed at any point leaves the previous checkpoint and the tracker untouched.
"""
import argparse
import os
from typing import Any, Callable, Dict, Optional

import torch

from megatron.core import dist_checkpointing
from megatron.core import parallel_state as mpu
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from megatron.core.optimizer.sharded_state import SHARDING_TYPE
from megatron.training.checkpoint_args import args_to_plain_dict, plain_dict_to_args
from megatron.training.utils import print_rank_0, unwrap_model

_ASYNC_QUEUE: Optional[AsyncCallsQueue] = None


def get_checkpoint_format(checkpoint_dir: str) -> Optional[str]:
    """'torch_dist' (a valid metadata.json), 'torch' (an mp_rank_0* entry), 'torch_dcp' (.metadata only), or None."""
    if not os.path.isdir(checkpoint_dir):
        return None
    if dist_checkpointing.check_is_distributed_checkpoint(checkpoint_dir):
        return "torch_dist"
    entries = os.listdir(checkpoint_dir)
    if any(name.startswith("mp_rank_0") for name in entries):
        return "torch"
    if ".metadata" in entries and "common.pt" not in entries:
        return "torch_dcp"
    return None


def checkpoint_args_namespace(stored: Any) -> argparse.Namespace:
    """Args stored in a checkpoint (our plain dict, or Megatron-LM's pickled Namespace) as a Namespace."""
    if isinstance(stored, argparse.Namespace):
        return stored
    if isinstance(stored, dict):
        return plain_dict_to_args(stored)
    raise ValueError(f"checkpoint args have type {type(stored).__name__}, expected a dict or an argparse.Namespace")


def sharded_rng_state(args, local_state: Dict) -> ShardedObject:
    """This rank's RNG state as Megatron's ShardedObject `rng_state`: grid (PP, TP), or (PP, TP, DP)."""
    pp_rank, pp_size = mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size()
    tp_rank, tp_size = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    dp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)
    if args.data_parallel_random_init:
        dp_size = mpu.get_data_parallel_world_size(with_context_parallel=True)
        return ShardedObject("rng_state", [local_state], (pp_size, tp_size, dp_size), (pp_rank, tp_rank, dp_rank),
                             replica_id=0)
    return ShardedObject("rng_state", [local_state], (pp_size, tp_size), (pp_rank, tp_rank), replica_id=dp_rank)


def _model_sharded_state_dicts(model) -> Dict[str, Dict]:
    chunks = unwrap_model(model)
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {"model%d" % i: chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def generate_sharded_state_dict(args, model, optimizer, opt_param_scheduler, rng_state: Optional[ShardedObject],
                                iteration: Optional[int] = None, is_loading: bool = False,
                                include_optimizer: bool = True, num_flops: float = 0.0) -> Dict[str, Any]:
    """Megatron's `generate_state_dict` for torch_dist (sharded model and optimizer state)."""
    state_dict: Dict[str, Any] = {"args": args_to_plain_dict(args), "checkpoint_version": 3.0,
                                  "num_floating_point_operations_so_far": float(num_flops)}
    if iteration is not None:
        state_dict["iteration"] = iteration
    model_sds = _model_sharded_state_dicts(model)
    state_dict.update(model_sds)
    if include_optimizer:
        if optimizer is not None and not getattr(optimizer, "is_stub_optimizer", False):
            state_dict["optimizer"] = optimizer.sharded_state_dict(model_sds, is_loading)
        if opt_param_scheduler is not None:
            state_dict["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if rng_state is not None:
        state_dict["rng_state"] = rng_state
    return state_dict


def content_metadata(args) -> Dict[str, Any]:
    """Megatron's `_build_sharded_state_dict_metadata`."""
    return {"distrib_optim_sharding_type": SHARDING_TYPE}


def _save_strategy(args):
    base = get_default_save_sharded_strategy()
    if getattr(args, "ckpt_fully_parallel_save", True) and torch.distributed.is_initialized():
        return FullyParallelSaveStrategyWrapper(base, mpu.get_data_parallel_group(with_context_parallel=True))
    return base


def get_async_queue() -> AsyncCallsQueue:
    """The process-wide queue of pending asynchronous checkpoint saves."""
    global _ASYNC_QUEUE
    if _ASYNC_QUEUE is None:
        _ASYNC_QUEUE = AsyncCallsQueue()
    return _ASYNC_QUEUE


def maybe_finalize_async_save(blocking: bool = False, terminate: bool = False) -> None:
    """Finalize finished async saves (writes metadata.json, publishes, updates the tracker). Collective."""
    global _ASYNC_QUEUE
    if _ASYNC_QUEUE is None:
        return
    if blocking and _ASYNC_QUEUE.get_num_unfinalized_calls() > 0:
        print_rank_0("waiting for the asynchronous checkpoint save to finish ...")
    _ASYNC_QUEUE.maybe_finalize_async_calls(blocking=blocking)
    if terminate:
        _ASYNC_QUEUE.close()
        _ASYNC_QUEUE = None


def is_empty_async_queue() -> bool:
    """True when no asynchronous save is pending."""
    return _ASYNC_QUEUE is None or _ASYNC_QUEUE.get_num_unfinalized_calls() == 0


def save_sharded(args, state_dict: Dict[str, Any], checkpoint_dir: str, publish_fn: Callable[[], None]) -> None:
    """Write `state_dict` into `checkpoint_dir`; `publish_fn` runs on every rank once the data is durable."""
    request = dist_checkpointing.save(state_dict, checkpoint_dir, sharded_strategy=_save_strategy(args),
                                      async_sharded_save=bool(args.async_save),
                                      content_metadata=content_metadata(args))
    if request is None:
        publish_fn()
        return
    request.add_finalize_fn(publish_fn)
    get_async_queue().schedule_async_request(request)


def checkpoint_tp_pp(common: Dict[str, Any]):
    """(TP, PP) sizes the checkpoint was saved with (None when the args are missing)."""
    if "args" not in common:
        return None
    ckpt_args = checkpoint_args_namespace(common["args"])
    return (getattr(ckpt_args, "tensor_model_parallel_size", None),
            getattr(ckpt_args, "pipeline_model_parallel_size", None))


def load_sharded(args, model, optimizer, opt_param_scheduler, checkpoint_dir: str, load_optim: bool,
                 load_rng: bool, local_rng_state: Dict, strict: bool = True):
    """Load a torch_dist checkpoint into `model` (and optimizer, RNG when asked). Returns the loaded dict."""
    common = dist_checkpointing.load_common_state_dict(checkpoint_dir)
    same_layout = checkpoint_tp_pp(common) == (mpu.get_tensor_model_parallel_world_size(),
                                               mpu.get_pipeline_model_parallel_world_size())
    if load_rng and not same_layout:
        print_rank_0(f"  the checkpoint was saved with TP/PP {checkpoint_tp_pp(common)}; not loading the RNG state")
        load_rng = False
    stored = dist_checkpointing.load_sharded_metadata(checkpoint_dir) if load_rng else {}
    if load_rng and not any(key.startswith("rng_state/") for key in stored):
        print_rank_0(f"  {checkpoint_dir} has no RNG state (saved with --no-save-rng); not loading it")
        load_rng = False
    if load_optim and "optimizer" not in common:
        raise RuntimeError(f"checkpoint {checkpoint_dir} has no optimizer state: pass --no-load-optim or --finetune "
                           f"to load only the weights.")
    rng = sharded_rng_state(args, local_rng_state) if load_rng else None
    request = generate_sharded_state_dict(args, model, optimizer, opt_param_scheduler, rng, is_loading=True,
                                          include_optimizer=load_optim)
    for name in ("args", "checkpoint_version", "num_floating_point_operations_so_far", "opt_param_scheduler"):
        request.pop(name, None)
    loaded = dist_checkpointing.load(request, checkpoint_dir, strict=args.dist_ckpt_strictness)
    if isinstance(loaded, tuple):
        loaded = loaded[0]
    chunks = unwrap_model(model)
    names = ["model"] if len(chunks) == 1 else ["model%d" % i for i in range(len(chunks))]
    for name, chunk in zip(names, chunks):
        chunk.load_state_dict(loaded[name], strict=strict)
    if load_optim and optimizer is not None and not getattr(optimizer, "is_stub_optimizer", False):
        optimizer.load_state_dict(loaded["optimizer"])
    if load_optim and opt_param_scheduler is not None and "opt_param_scheduler" in common:
        opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])
    if not load_rng:
        loaded.pop("rng_state", None)
    return loaded


def read_checkpoint_args(checkpoint_dir: str) -> Optional[argparse.Namespace]:
    """Args stored in a torch_dist checkpoint's common.pt (safe loader)."""
    common = dist_checkpointing.load_common_state_dict(checkpoint_dir)
    return checkpoint_args_namespace(common["args"]) if "args" in common else None


__all__ = [
    "get_checkpoint_format", "checkpoint_args_namespace", "sharded_rng_state", "generate_sharded_state_dict",
    "content_metadata", "get_async_queue", "maybe_finalize_async_save", "is_empty_async_queue", "save_sharded",
    "load_sharded", "read_checkpoint_args", "checkpoint_tp_pp",
]
