"""Distributed checkpoints of the training loop: `torch_dist` (save sync or async, load at any layout),
plain `torch_dcp`, and format detection.

Layout (spec §4c): `<save>/iter_{:07d}/` with `common.pt`, `.metadata`, `__{rank}_{k}.distcp` and
`metadata.json` (written last by `megatron.core.dist_checkpointing`). The state dict is Megatron-LM 0.13.1's
`generate_state_dict` with sharded values, key for key: `model` (or `model0`, `model1`, ... per
virtual-pipeline chunk) from `sharded_state_dict()`, `optimizer` from `optimizer.sharded_state_dict(model_sd,
is_loading, metadata=content metadata)`, `rng_state` as a ShardedObject of shape (PP, TP) (plus DP with
--data-parallel-random-init), `rerun_state_machine` (its mode in `common.pt`, the per-rank part as the
ShardedObject `rerun_state_machine_state`), the scheduler, args (an argparse.Namespace of plain values, dtypes
and enums, as Megatron pickles it), iteration, FLOPs and `content_metadata` in `common.pt`.

Design note (publish, then track): every rank writes into `<save>/.tmp_iter_{:07d}/`; after the library's
finalize step has written `metadata.json`, rank 0 renames the directory to `iter_{:07d}` and only then
replaces the tracker. With --async-save that happens in the request's finalize callback, which the
training loop runs (`maybe_finalize_async_save`) once every rank's background write is done. A writer
killed at any point leaves the previous checkpoint and the tracker untouched.

`torch_dcp` (Megatron's FSDP2 format): `torch.distributed.checkpoint.save` of Megatron's state dict with plain
(non-sharded-API) values: `model` from `state_dict_for_save_checkpoint()` (DTensors under FSDP2),
`optimizer.state_dict()`, the scheduler, `rng_state` (the legacy list), args, iteration and FLOPs, all in
`.metadata` + `__{rank}_{k}.distcp` (no `common.pt`, no `metadata.json`). Plain tensors with one key on
several ranks are stored once, so the layout needs TP = PP = EP = 1 and no distributed optimizer; FSDP2's
DTensors are stored by global offsets (an FSDP2 checkpoint loads at another DP size, or into plain DDP).
Published like the other formats: temp dir, rename, tracker last.
"""
import argparse
import copy
import enum
import os
from typing import Any, Callable, Dict, List, Optional

import torch

from megatron.core import dist_checkpointing
from megatron.core import parallel_state as mpu
from megatron.core.dist_checkpointing.dict_utils import extract_matching_values, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.safe_load import MEGATRON_CLASSES
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.dist_checkpointing.strategies import torch_dcp
from megatron.core.dist_checkpointing.strategies.torch import read_dcp_metadata
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from megatron.core.optimizer.sharded_state import DP_ZERO_SHARDING_TYPE, SHARDING_TYPE, SHARDING_TYPE_KEY, ensure_state
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.training.checkpoint_args import args_to_plain_dict, plain_dict_to_args, to_plain
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


def _checkpoint_value(value: Any) -> Any:
    """`value` as it goes into checkpoint args: plain data, torch dtypes and the enums both Megatron-LM and this
    framework know by the same pickled name stay as they are (Megatron reads them back as its own), anything
    else becomes plain data (`checkpoint_args.to_plain`)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    if isinstance(value, enum.Enum) and f"{type(value).__module__}.{type(value).__qualname__}" in MEGATRON_CLASSES:
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_checkpoint_value(v) for v in value)
    if isinstance(value, dict):
        return {k: _checkpoint_value(v) for k, v in value.items()}
    return to_plain(value)


def args_for_checkpoint(args) -> argparse.Namespace:
    """The `args` entry of a checkpoint: an argparse.Namespace, as Megatron-LM stores it (its loaders read the
    args with getattr), of values our restricted unpickler reads (`_checkpoint_value`)."""
    return argparse.Namespace(**{key: _checkpoint_value(value) for key, value in sorted(vars(args).items())})


def checkpoint_args_namespace(stored: Any) -> argparse.Namespace:
    """Args stored in a checkpoint (our plain dict, or Megatron-LM's pickled Namespace) as a Namespace."""
    if isinstance(stored, argparse.Namespace):
        return stored
    if isinstance(stored, dict):
        return plain_dict_to_args(stored)
    raise ValueError(f"checkpoint args have type {type(stored).__name__}, expected a dict or an argparse.Namespace")


def sharded_rng_state(args, states: List[Dict], stored: Optional[set] = None) -> ShardedObject:
    """The RNG state list (`checkpointing.get_rng_state`) as Megatron's ShardedObject `rng_state`: grid (PP, TP),
    replica id = DP rank. `stored` (the keys of a checkpoint being loaded) selects the (PP, TP, DP) grid that this
    framework's older files used with --data-parallel-random-init, one state per shard."""
    pp_rank, pp_size = mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size()
    tp_rank, tp_size = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    dp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)
    grid = ShardedObject("rng_state", states, (pp_size, tp_size), (pp_rank, tp_rank), replica_id=dp_rank)
    if stored is None or grid.unique_key in stored or not args.data_parallel_random_init:
        return grid
    dp_size = mpu.get_data_parallel_world_size(with_context_parallel=True)
    return ShardedObject("rng_state", states[:1], (pp_size, tp_size, dp_size), (pp_rank, tp_rank, dp_rank),
                         replica_id=0)


def _model_sharded_state_dicts(model) -> Dict[str, Dict]:
    chunks = unwrap_model(model)
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {"model%d" % i: chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def generate_sharded_state_dict(args, model, optimizer, opt_param_scheduler, rng_state: Optional[ShardedObject],
                                iteration: Optional[int] = None, is_loading: bool = False,
                                include_optimizer: bool = True, num_flops: float = 0.0,
                                optim_sd_kwargs: Optional[Dict[str, Any]] = None,
                                rerun_state: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Megatron's `generate_state_dict` for torch_dist (sharded model and optimizer state)."""
    state_dict: Dict[str, Any] = {"args": args_for_checkpoint(args), "checkpoint_version": 3.0,
                                  "num_floating_point_operations_so_far": float(num_flops)}
    if iteration is not None:
        state_dict["iteration"] = iteration
    model_sds = _model_sharded_state_dicts(model)
    state_dict.update(model_sds)
    if include_optimizer:
        if optimizer is not None and not getattr(optimizer, "is_stub_optimizer", False):
            state_dict["optimizer"] = optimizer.sharded_state_dict(model_sds, is_loading, **(optim_sd_kwargs or {}))
        if opt_param_scheduler is not None:
            state_dict["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if rng_state is not None:
        state_dict["rng_state"] = rng_state
    if rerun_state is not None:
        state_dict["rerun_state_machine"] = rerun_state
    return state_dict


def content_metadata(args) -> Dict[str, Any]:
    """Megatron's `_build_sharded_state_dict_metadata`: the distributed optimizer's layout, nothing otherwise."""
    if not getattr(args, "use_distributed_optimizer", False):
        return {}
    fully_parallel = getattr(args, "ckpt_fully_parallel_save", True)
    return {"distrib_optim_sharding_type": SHARDING_TYPE if fully_parallel else DP_ZERO_SHARDING_TYPE}


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


def optimizer_sharding_type(common: Dict[str, Any]) -> str:
    """The layout of the optimizer state in a torch_dist checkpoint: `content_metadata` first, then the
    `param_state_sharding_type` Megatron stores beside the optimizer's common state."""
    stored = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    optimizer_common = common.get("optimizer")
    if stored is None and isinstance(optimizer_common, dict):
        stored = optimizer_common.get(SHARDING_TYPE_KEY)
    return stored or SHARDING_TYPE


def check_optimizer_layout(args, common: Dict[str, Any], checkpoint_dir: str, run_tp_pp) -> Dict[str, Any]:
    """The `optimizer.sharded_state_dict` arguments that read the optimizer state of a torch_dist checkpoint
    whose `common.pt` is `common`, for a run at (TP, PP) `run_tp_pp`; raises RuntimeError naming the layout
    and the fix when this run cannot read it.

    Megatron's `fully_sharded_model_space` state (model-shaped, or N-D flattened by its distributed
    optimizer) loads at any layout into any optimizer; `dp_zero_gather_scatter` only at the saved TP/PP into
    the distributed optimizer."""
    sharding_type = optimizer_sharding_type(common)
    if sharding_type == SHARDING_TYPE:
        return {"metadata": {"distrib_optim_sharding_type": SHARDING_TYPE}}
    if sharding_type != DP_ZERO_SHARDING_TYPE:
        raise RuntimeError(f"checkpoint {checkpoint_dir} holds distributed-optimizer state in the {sharding_type!r} "
                           f"layout, which this framework does not read: pass --no-load-optim to load the weights "
                           f"only.")
    fix = (f"load it with the TP/PP sizes it was saved with ({checkpoint_tp_pp(common)}) and "
           f"--use-distributed-optimizer, then re-save with --ckpt-fully-parallel-save (the default, layout "
           f"'{SHARDING_TYPE}', reshardable); or pass --no-load-optim to load the weights only")
    if checkpoint_tp_pp(common) != tuple(run_tp_pp):
        raise RuntimeError(
            f"checkpoint {checkpoint_dir} holds distributed-optimizer state in Megatron's '{DP_ZERO_SHARDING_TYPE}' "
            f"layout (saved with --no-ckpt-fully-parallel-save), which cannot be resharded from TP/PP "
            f"{checkpoint_tp_pp(common)} to {tuple(run_tp_pp)}: {fix}.")
    if not args.use_distributed_optimizer:
        raise RuntimeError(
            f"checkpoint {checkpoint_dir} holds distributed-optimizer state in Megatron's '{DP_ZERO_SHARDING_TYPE}' "
            f"layout, which only the distributed optimizer reads: {fix}.")
    return {"metadata": {"distrib_optim_sharding_type": DP_ZERO_SHARDING_TYPE}}


def load_model_chunk(chunk, state_dict: Dict[str, Any], strict: bool, where: str) -> None:
    """`chunk.load_state_dict`, tolerating absent `_extra_state` entries as Megatron does (its torch_dist
    checkpoints never hold the output layer's, and local layers have none to restore)."""
    result = chunk.load_state_dict(state_dict, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    unexpected = [k for k in result.unexpected_keys if not k.endswith("_extra_state")]
    if strict and (missing or unexpected):
        raise RuntimeError(f"the model does not match checkpoint {where}: missing keys {missing}, unexpected keys "
                           f"{unexpected} (different model configuration?)")


def _drop_absent_extra_states(request: Dict[str, Any], stored: set) -> None:
    """Remove from the model part of `request` the `_extra_state` objects the checkpoint lacks (a local-spec
    checkpoint has no `core_attention._extra_state` for a TE-spec model): those modules keep their own."""
    for name in [k for k in request if k == "model" or (k.startswith("model") and k[5:].isdigit())]:
        request[name], _ = extract_matching_values(
            request[name], lambda v: not (isinstance(v, ShardedObject) and v.key.endswith("._extra_state")
                                          and v.unique_key not in stored))


def _stored_keys(checkpoint_dir: str) -> set:
    return set(read_dcp_metadata(checkpoint_dir).state_dict_metadata)


def _rerun_request(load_rerun: bool, common: Dict[str, Any], stored: set) -> Optional[Dict[str, Any]]:
    """The rerun state machine's entry to load (as Megatron: at the saved TP/PP only), or None."""
    machine = get_rerun_state_machine()
    if not load_rerun or "rerun_state_machine" not in common:
        return None
    request = machine.state_dict(data_iterator=None, ckpt_format="torch_dist")
    return request if request["sharded"].unique_key in stored else None


def _optimizer_chain_length(keys) -> int:
    """How many chained optimizers wrote `keys` (Megatron prefixes each one's keys with `chained_<i>.` when
    there are several, e.g. dense and expert params at expert-parallel sizes > 1; one when unprefixed)."""
    indices = {key.split(".", 1)[0][len("chained_"):] for key in keys if key.startswith("chained_")}
    return max(len(indices), 1)


def check_optimizer_chain(args, request_keys, stored: set, checkpoint_dir: str) -> None:
    """RuntimeError naming the layouts and the fix when this run's optimizer is split into another number of
    chained optimizers than the checkpoint's (Megatron cannot load those either: the keys differ)."""
    stored_optim = [k for k in stored if k.startswith("chained_") or k.startswith("optimizer.")]
    wanted_optim = [k for k in request_keys if k.startswith("chained_") or k.startswith("optimizer.")]
    if not stored_optim or not wanted_optim:
        return
    saved, wanted = _optimizer_chain_length(stored_optim), _optimizer_chain_length(wanted_optim)
    if saved == wanted:
        return
    raise RuntimeError(
        f"checkpoint {checkpoint_dir} holds the state of {saved} chained optimizer(s) but this run builds {wanted} "
        f"(--expert-model-parallel-size {getattr(args, 'expert_model_parallel_size', 1)}): dense and expert "
        f"params get separate optimizers when the expert data-parallel group differs from the data-parallel "
        f"group, so this optimizer state cannot be resharded to this layout. Load it at the expert-parallel "
        f"layout it was saved with, or pass --no-load-optim to load the weights only (they reshard across EP "
        f"and ETP).")


def load_sharded(args, model, optimizer, opt_param_scheduler, checkpoint_dir: str, load_optim: bool,
                 load_rng: bool, local_rng_state: Dict, strict: bool = True, load_rerun: bool = True):
    """Load a torch_dist checkpoint into `model` (and optimizer, RNG and rerun state when asked; RNG and rerun
    state only at the saved TP/PP). Returns the loaded dict."""
    common = dist_checkpointing.load_common_state_dict(checkpoint_dir)
    run_tp_pp = (mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size())
    same_layout = checkpoint_tp_pp(common) == run_tp_pp
    load_rerun = load_rerun and same_layout
    if load_rng and not same_layout:
        print_rank_0(f"  the checkpoint was saved with TP/PP {checkpoint_tp_pp(common)}; not loading the RNG state")
        load_rng = False
    stored = _stored_keys(checkpoint_dir)
    if load_rng and not any(key.startswith("rng_state/") for key in stored):
        print_rank_0(f"  {checkpoint_dir} has no RNG state (saved with --no-save-rng); not loading it")
        load_rng = False
    if load_optim and "optimizer" not in common:
        raise RuntimeError(f"checkpoint {checkpoint_dir} has no optimizer state: pass --no-load-optim or --finetune "
                           f"to load only the weights.")
    optim_sd_kwargs = None
    if load_optim and _with_optimizer(optimizer):
        optim_sd_kwargs = check_optimizer_layout(args, common, checkpoint_dir, run_tp_pp)
    rng = sharded_rng_state(args, [local_rng_state], stored) if load_rng else None
    request = generate_sharded_state_dict(args, model, optimizer, opt_param_scheduler, rng, is_loading=True,
                                          include_optimizer=load_optim, optim_sd_kwargs=optim_sd_kwargs,
                                          rerun_state=_rerun_request(load_rerun, common, stored))
    for name in ("args", "checkpoint_version", "num_floating_point_operations_so_far", "opt_param_scheduler"):
        request.pop(name, None)
    _drop_absent_extra_states(request, stored)
    if load_optim and "optimizer" in request:
        optimizer_keys = [sh.key for sh in nested_values(request["optimizer"]) if hasattr(sh, "key")]
        check_optimizer_chain(args, optimizer_keys, stored, checkpoint_dir)
    loaded = dist_checkpointing.load(request, checkpoint_dir, strict=args.dist_ckpt_strictness)
    if isinstance(loaded, tuple):
        loaded = loaded[0]
    chunks = unwrap_model(model)
    names = ["model"] if len(chunks) == 1 else ["model%d" % i for i in range(len(chunks))]
    for name, chunk in zip(names, chunks):
        load_model_chunk(chunk, loaded[name], strict, checkpoint_dir)
    if load_optim and optimizer is not None and not getattr(optimizer, "is_stub_optimizer", False):
        optimizer.load_state_dict(loaded["optimizer"])
    if load_optim and opt_param_scheduler is not None and "opt_param_scheduler" in common:
        opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])
    if not load_rng:
        loaded.pop("rng_state", None)
    if load_rerun and isinstance(loaded.get("rerun_state_machine", {}).get("sharded"), dict):
        get_rerun_state_machine().load_state_dict(loaded["rerun_state_machine"])
    return loaded


def read_checkpoint_args(checkpoint_dir: str) -> Optional[argparse.Namespace]:
    """Args stored in a torch_dist checkpoint's common.pt (safe loader)."""
    common = dist_checkpointing.load_common_state_dict(checkpoint_dir)
    return checkpoint_args_namespace(common["args"]) if "args" in common else None


def torch_dcp_layout_problems(args, with_optimizer: bool) -> list:
    """Why this run's layout cannot be stored as plain `torch_dcp` (empty when it can)."""
    problems = []
    for flag, name in (("--tensor-model-parallel-size", "tensor_model_parallel_size"),
                       ("--pipeline-model-parallel-size", "pipeline_model_parallel_size"),
                       ("--expert-model-parallel-size", "expert_model_parallel_size")):
        value = getattr(args, name, 1) or 1
        if value > 1:
            problems.append(f"{flag} is {value}: torch_dcp stores each rank's plain state dict, whose keys repeat "
                            f"on every model-parallel rank")
    if with_optimizer and getattr(args, "use_distributed_optimizer", False):
        problems.append("--use-distributed-optimizer: its optimizer state lives outside optimizer.state_dict(), "
                        "which is what torch_dcp stores")
    return problems


def _check_torch_dcp_layout(args, with_optimizer: bool, action: str) -> None:
    problems = torch_dcp_layout_problems(args, with_optimizer)
    if problems:
        raise ValueError(f"--ckpt-format torch_dcp cannot {action} this run: " + "; ".join(problems)
                         + ". Use --ckpt-format torch_dist (reshardable, any layout) or --ckpt-format torch.")


def _plain_model_state(chunk) -> Dict[str, Any]:
    to_save = getattr(chunk, "state_dict_for_save_checkpoint", None)
    return to_save() if to_save is not None else chunk.state_dict()


def _with_optimizer(optimizer) -> bool:
    return optimizer is not None and not getattr(optimizer, "is_stub_optimizer", False)


def _init_optimizer_state(optimizer) -> None:
    """Zero state for every param without state, so a request has every tensor the checkpoint holds."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not getattr(opt, "is_stub_optimizer", False) and getattr(opt, "optimizer", None) is not None:
            ensure_state(opt.optimizer, getattr(opt, "init_state_fn", None), getattr(opt, "config", None))


def save_torch_dcp(args, model, optimizer, opt_param_scheduler, rng_state: Optional[list], iteration: int,
                   num_flops: float, checkpoint_dir: str, publish_fn: Callable[[], None]) -> None:
    """Write Megatron's torch_dcp state dict into `checkpoint_dir` (collective), then `publish_fn()`."""
    include_optimizer = not args.no_save_optim
    _check_torch_dcp_layout(args, include_optimizer and _with_optimizer(optimizer), "save")
    chunks = unwrap_model(model)
    state_dict: Dict[str, Any] = {"args": args_to_plain_dict(args), "checkpoint_version": 3.0, "iteration": iteration,
                                  "num_floating_point_operations_so_far": float(num_flops or 0.0),
                                  "model": _plain_model_state(chunks[0])}
    if include_optimizer:
        if _with_optimizer(optimizer):
            state_dict["optimizer"] = optimizer.state_dict()
        if opt_param_scheduler is not None:
            state_dict["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if rng_state is not None:
        state_dict["rng_state"] = rng_state
    torch_dcp.save_state_dict(state_dict, checkpoint_dir)
    publish_fn()


def _has_prefix(keys, prefix: str) -> bool:
    return any(key == prefix or key.startswith(prefix + ".") for key in keys)


def _placeholders(keys, name: str) -> Any:
    """A request for the stored entry `name`: None for one bytes item (Megatron's pickled Namespace), or
    nested dicts of None mirroring the flattened keys `name.a.b` (our args stored as a plain dict)."""
    if name in keys:
        return None
    request: Dict[str, Any] = {}
    for key in sorted(k for k in keys if k.startswith(name + ".")):
        node = request
        *parents, leaf = key[len(name) + 1:].split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = None
    return request


def load_torch_dcp(args, model, optimizer, opt_param_scheduler, checkpoint_dir: str, load_optim: bool,
                   load_rng: bool, local_rng_state: Dict, strict: bool = True) -> Dict[str, Any]:
    """Load a plain torch_dcp checkpoint into `model` (and optimizer, scheduler when asked). Returns the
    loaded state dict (`args`, `iteration`, ..., `rng_state` only when it is to be restored)."""
    load_optim = load_optim and _with_optimizer(optimizer)
    _check_torch_dcp_layout(args, load_optim, "load")
    keys = torch_dcp.stored_keys(checkpoint_dir)
    request: Dict[str, Any] = {name: _placeholders(keys, name) for name in (
        "args", "checkpoint_version", "iteration", "num_floating_point_operations_so_far") if _has_prefix(keys, name)}
    chunks = unwrap_model(model)
    request["model"] = _plain_model_state(chunks[0])
    if load_optim:
        if not _has_prefix(keys, "optimizer"):
            raise RuntimeError(f"checkpoint {checkpoint_dir} has no optimizer state: pass --no-load-optim or "
                               f"--finetune to load only the weights.")
        _init_optimizer_state(optimizer)
        request["optimizer"] = optimizer.state_dict()
        if opt_param_scheduler is not None and _has_prefix(keys, "opt_param_scheduler"):
            request["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    num_rng = len({key.split(".")[1] for key in keys if key.startswith("rng_state.")})
    if load_rng and num_rng == 0:
        print_rank_0(f"  {checkpoint_dir} has no RNG state (saved with --no-save-rng); not loading it")
    elif load_rng:
        request["rng_state"] = [copy.deepcopy(local_rng_state) for _ in range(num_rng)]
    torch_dcp.load_state_dict(request, checkpoint_dir)
    chunks[0].load_state_dict(request["model"], strict=strict)
    if "optimizer" in request:
        optimizer.load_state_dict(request["optimizer"])
    if "opt_param_scheduler" in request:
        opt_param_scheduler.load_state_dict(request["opt_param_scheduler"])
    return request


def read_torch_dcp_args(checkpoint_dir: str):
    """(args Namespace, iteration) of a torch_dcp checkpoint, read in this process alone (no collectives)."""
    keys = torch_dcp.stored_keys(checkpoint_dir)
    request = {name: _placeholders(keys, name) for name in ("args", "iteration") if _has_prefix(keys, name)}
    if "args" not in request:
        raise RuntimeError(f"{checkpoint_dir} has no 'args' entry: --use-checkpoint-args cannot use it.")
    torch_dcp.load_state_dict(request, checkpoint_dir, no_dist=True)
    return checkpoint_args_namespace(request["args"]), request.get("iteration", 0)


__all__ = [
    "torch_dcp_layout_problems", "save_torch_dcp", "load_torch_dcp", "read_torch_dcp_args",
    "get_checkpoint_format", "checkpoint_args_namespace", "sharded_rng_state", "generate_sharded_state_dict",
    "content_metadata", "optimizer_sharding_type", "check_optimizer_layout", "args_for_checkpoint", "get_async_queue",
    "maybe_finalize_async_save", "is_empty_async_queue", "save_sharded",
    "load_sharded", "read_checkpoint_args", "checkpoint_tp_pp",
]
