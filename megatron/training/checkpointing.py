"""Save and load training checkpoints: the sharded `torch_dist` format (default), plain `torch_dcp` and the
legacy `torch` layout.

Legacy layout (Megatron's): `<save>/latest_checkpointed_iteration.txt` holds the iteration; each rank with
expert-data-parallel rank 0 writes `<save>/iter_{:07d}/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt`
and, with the distributed optimizer, `distrib_optim.pt` beside it. The `torch_dist` format (sharded, reshardable
across TP/PP/DP, optionally asynchronous) and `torch_dcp` (plain torch.distributed.checkpoint, Megatron's FSDP2
format) live in `checkpointing_dist.py`; this module picks the format on save (`--ckpt-format`) and detects it
on load.

Design notes:
- Atomic save. Every rank writes into `<save>/.tmp_iter_{:07d}/`; once the data is complete rank 0 renames it
  to `iter_{:07d}` and only then replaces the tracker (temp file + `os.replace`). A crash at any point leaves
  the previous tracker and iteration directory untouched; the temp directory never looks like a checkpoint.
- Megatron-LM's contents, read safely. Files hold what Megatron-LM 0.13.1 writes (args as an argparse
  Namespace, Python's and numpy's native RNG states, the rerun state machine's enums), so checkpoints move
  between the two frameworks in both directions; they are read with the restricted unpickler of
  `megatron.core.dist_checkpointing.safe_load`, which allows exactly those types by name (nothing executes).
"""
import os
import random
import shutil
import sys
from enum import Enum, auto

import numpy as np
import torch

from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.num_microbatches_calculator import update_num_microbatches
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.training import wandb_utils
from megatron.core.dist_checkpointing.safe_load import safe_torch_load
from megatron.training.checkpointing_dist import (
    load_model_chunk,
    args_for_checkpoint,
    checkpoint_args_namespace,
    content_metadata,
    generate_sharded_state_dict,
    get_checkpoint_format,
    is_empty_async_queue,
    load_sharded,
    load_torch_dcp,
    maybe_finalize_async_save,
    read_torch_dcp_args,
    save_sharded,
    save_torch_dcp,
    sharded_rng_state,
    torch_dcp_layout_problems,
)
from megatron.training.checkpointing_local import (
    check_local_layout,
    find_local_checkpoint,
    load_local_optimizer_shards,
    save_local_checkpoint,
)
from megatron.training.global_vars import get_args, get_wandb_writer
from megatron.training.utils import is_last_rank, print_rank_0, unwrap_model

class CheckpointType(Enum):
    """Megatron's kinds of checkpoint: the legacy per-rank `torch` files, node-local non-persistent files, a
    global distributed (`torch_dist`) checkpoint, and plain `torch.distributed.checkpoint` (`torch_dcp`)."""

    LEGACY = auto()
    LOCAL = auto()
    GLOBAL = auto()
    TORCH_DCP = auto()


def checkpoint_type(ckpt_format: str, non_persistent_ckpt_type: str = None) -> CheckpointType:
    """The CheckpointType of a save or load in `ckpt_format` (a local non-persistent one when asked)."""
    if non_persistent_ckpt_type == "local":
        return CheckpointType.LOCAL
    return {"torch_dist": CheckpointType.GLOBAL, "torch_dcp": CheckpointType.TORCH_DCP}.get(
        ckpt_format, CheckpointType.LEGACY)


_CHECKPOINT_VERSION = None
_TRACKER_NAME = "latest_checkpointed_iteration.txt"
_NON_PERSISTENT_SUBDIR = "non_persistent"


def set_checkpoint_version(value):
    """Remember the version of the checkpoint being loaded."""
    global _CHECKPOINT_VERSION
    if _CHECKPOINT_VERSION is not None and _CHECKPOINT_VERSION != value:
        raise ValueError(f"checkpoint versions do not match: {_CHECKPOINT_VERSION} vs {value}")
    _CHECKPOINT_VERSION = value


def get_checkpoint_version():
    """Version of the loaded checkpoint (None before a load)."""
    return _CHECKPOINT_VERSION


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _barrier():
    if _dist_ready():
        torch.distributed.barrier()


def _rank() -> int:
    return torch.distributed.get_rank() if _dist_ready() else 0


def _collective_device():
    if _dist_ready() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def ensure_directory_exists(filename, check_parent=True):
    """Create the directory holding `filename` (or `filename` itself with check_parent=False)."""
    dirname = os.path.dirname(filename) if check_parent else filename
    os.makedirs(dirname, exist_ok=True)


def get_checkpoint_tracker_filename(checkpoints_path):
    """`<checkpoints_path>/latest_checkpointed_iteration.txt`."""
    return os.path.join(checkpoints_path, _TRACKER_NAME)


def _iteration_dir_name(iteration, release=False):
    return "release" if release else "iter_{:07d}".format(iteration)


def get_checkpoint_name(checkpoints_path, iteration, release=False, pipeline_parallel=None, tensor_rank=None,
                        pipeline_rank=None, expert_parallel=None, expert_rank=None, return_base_dir=False,
                        basename="model_optim_rng.pt"):
    """Path of this rank's legacy checkpoint file (or the iteration directory with return_base_dir)."""
    directory = os.path.join(checkpoints_path, _iteration_dir_name(iteration, release))
    if return_base_dir:
        return directory
    if pipeline_parallel is None:
        pipeline_parallel = mpu.get_pipeline_model_parallel_world_size() > 1
    if tensor_rank is None:
        tensor_rank = mpu.get_tensor_model_parallel_rank()
    if pipeline_rank is None:
        pipeline_rank = mpu.get_pipeline_model_parallel_rank()
    if expert_parallel is None:
        expert_parallel = mpu.get_expert_model_parallel_world_size() > 1
    if expert_rank is None:
        expert_rank = mpu.get_expert_model_parallel_rank()
    rank_dir = "mp_rank_{:02d}".format(tensor_rank)
    if pipeline_parallel:
        rank_dir += "_{:03d}".format(pipeline_rank)
    if expert_parallel:
        rank_dir += "_{:03d}".format(expert_rank)
    return os.path.join(directory, rank_dir, basename)


def get_distributed_optimizer_checkpoint_name(model_checkpoint_name):
    """`distrib_optim.pt` beside `model_checkpoint_name`."""
    return os.path.join(os.path.dirname(model_checkpoint_name), "distrib_optim.pt")


def isfile_(filename) -> bool:
    """Whether `filename` is a file (Megatron's hook for object stores; file systems only here)."""
    return os.path.isfile(filename)


def find_checkpoint_rank_0(checkpoints_path, iteration, release=False):
    """Rank 0's legacy file in any layout (with/without PP, EP), else a torch_dist iteration directory, or None."""
    for pipeline_parallel, expert_parallel in ((False, False), (False, True), (True, False), (True, True)):
        filename = get_checkpoint_name(checkpoints_path, iteration, release, pipeline_parallel=pipeline_parallel,
                                       tensor_rank=0, pipeline_rank=0, expert_parallel=expert_parallel, expert_rank=0)
        if isfile_(filename):
            return filename
    base = get_checkpoint_name(checkpoints_path, iteration, release, return_base_dir=True)
    return base if get_checkpoint_format(base) == "torch_dist" else None


def get_load_checkpoint_path_by_args(args, load_arg="load"):
    """The iteration directory `--load` (or `load_arg`) resolves to: the tracker's iteration, or --ckpt-step."""
    load_dir = getattr(args, load_arg)
    iteration, release = -1, False
    if load_dir is not None and isfile_(get_checkpoint_tracker_filename(load_dir)):
        iteration, release = read_metadata(get_checkpoint_tracker_filename(load_dir))
    if getattr(args, "ckpt_step", None) is not None:
        iteration = args.ckpt_step
    return get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)


def checkpoint_exists(checkpoints_path):
    """True when `checkpoints_path` has a tracker file."""
    if checkpoints_path is None:
        return False
    return os.path.exists(get_checkpoint_tracker_filename(checkpoints_path))


def read_metadata(tracker_filename):
    """(iteration, release) from the tracker; the iteration is MAX-reduced across ranks."""
    with open(tracker_filename) as f:
        text = f.read().strip()
    release = text == "release"
    if release:
        iteration = 0
    else:
        try:
            iteration = int(text)
        except ValueError:
            raise ValueError(
                f"checkpoint tracker {tracker_filename} holds {text!r}, expected an iteration number or "
                f"'release': fix or delete the file, or pass --ckpt-step N."
            ) from None
    if _dist_ready():
        iters = torch.tensor([iteration], dtype=torch.long, device=_collective_device())
        torch.distributed.all_reduce(iters, op=torch.distributed.ReduceOp.MAX)
        if iters[0].item() != iteration:
            print(f"WARNING: on rank {_rank()} found iteration {iteration} in the tracker while the max "
                  f"across ranks is {iters[0].item()}; using the max.", flush=True)
        iteration = iters[0].item()
    return iteration, release


def _writes_model_file() -> bool:
    """One writer per (TP, PP, EP) coordinate: expert-data-parallel rank 0."""
    if not _dist_ready():
        return True
    return mpu.get_expert_data_parallel_rank() == 0


def _np_state_from_plain(state):
    """numpy's own state tuple; this framework's older files stored the key array as a tensor in a list."""
    name, keys, pos, has_gauss, cached = state
    keys = keys.numpy() if torch.is_tensor(keys) else np.asarray(keys)
    return (name, keys.astype(np.uint32), int(pos), int(has_gauss), float(cached))


def _local_rng_state():
    """This rank's Python, numpy, torch, CUDA and tensor-parallel tracker RNG states, in Megatron's form (the
    generators' own state objects)."""
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def get_rng_state(ckpt_format="torch"):
    """This rank's RNG states as Megatron stores them: a list (one entry per DP rank, gathered over the DP group,
    with --data-parallel-random-init, else this rank's one); for `torch_dist` that list as the ShardedObject
    `rng_state` on the (PP, TP) grid, DP rank 0 writing it."""
    args = get_args()
    state = _local_rng_state()
    states = [state]
    if _dist_ready() and mpu.get_data_parallel_world_size() > 1 and args.data_parallel_random_init:
        states = [None] * mpu.get_data_parallel_world_size()
        torch.distributed.all_gather_object(states, state, group=mpu.get_data_parallel_group())
    if ckpt_format == "torch_dist":
        return sharded_rng_state(args, states)
    return states


def _set_rng_state(state):
    version, internal, gauss = state["random_rng_state"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    np.random.set_state(_np_state_from_plain(state["np_rng_state"]))
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and state.get("cuda_rng_state") is not None:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    if not state.get("rng_tracker_states"):
        raise KeyError("rng_tracker_states")
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _model_state_dict(model_chunk):
    module = unwrap_model(model_chunk)
    to_save = getattr(module, "state_dict_for_save_checkpoint", None)
    return to_save() if to_save is not None else module.state_dict()


def generate_state_dict(args, model, optimizer, opt_param_scheduler, rng_state, iteration=None,
                        optim_sd_kwargs=None, model_sd_kwargs=None, rerun_state=None):
    """The §4c state dict of one rank."""
    state_dict = {"args": args_for_checkpoint(args), "checkpoint_version": 3.0}
    if iteration is not None:
        state_dict["iteration"] = iteration
    if len(model) == 1:
        state_dict["model"] = _model_state_dict(model[0])
    else:
        for i, chunk in enumerate(model):
            state_dict["model%d" % i] = _model_state_dict(chunk)
    if not args.no_save_optim:
        if optimizer is not None and not getattr(optimizer, "is_stub_optimizer", False):
            state_dict["optimizer"] = optimizer.state_dict(**(optim_sd_kwargs or {}))
        if opt_param_scheduler is not None:
            state_dict["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    state_dict["rerun_state_machine"] = rerun_state
    if not args.no_save_rng and rng_state is not None:
        state_dict["rng_state"] = rng_state
    return state_dict


def announce_checkpoint_format(args):
    """At start-up: refuse --ckpt-format torch_dcp with --save for a layout it cannot store (TP/PP/EP > 1, the
    distributed optimizer), before any training time is spent."""
    if args.ckpt_format != "torch_dcp" or not args.save:
        return
    problems = torch_dcp_layout_problems(args, with_optimizer=not args.no_save_optim)
    if problems:
        raise ValueError("--ckpt-format torch_dcp cannot save this run: " + "; ".join(problems)
                         + ". Use --ckpt-format torch_dist (reshardable, any layout) or --ckpt-format torch.")


def _temp_dir(save_dir, iteration):
    return os.path.join(save_dir, ".tmp_" + _iteration_dir_name(iteration))


def _publish(save_dir, iteration):
    """Rank 0: rename the finished temp dir to iter_XXXXXXX, then replace the tracker (last)."""
    final_dir = os.path.join(save_dir, _iteration_dir_name(iteration))
    if os.path.exists(final_dir):
        stale = os.path.join(save_dir, ".old_" + _iteration_dir_name(iteration))
        shutil.rmtree(stale, ignore_errors=True)
        os.rename(final_dir, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.rename(_temp_dir(save_dir, iteration), final_dir)
    tracker = get_checkpoint_tracker_filename(save_dir)
    tmp_tracker = tracker + ".tmp"
    with open(tmp_tracker, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_tracker, tracker)


def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                    checkpointing_context=None, pipeline_rank=None, expert_rank=None, tensor_rank=None,
                    pipeline_parallel=None, expert_parallel=None, non_persistent_ckpt=False,
                    train_data_iterator=None, preprocess_common_state_dict_fn=None):
    """Save model, optimizer, scheduler and RNG state of `iteration` (a collective: every rank calls it)."""
    args = get_args()
    model = model if isinstance(model, list) else [model]
    save_dir = args.save
    ckpt_type = checkpoint_type(args.ckpt_format, args.non_persistent_ckpt_type if non_persistent_ckpt else None)
    if ckpt_type == CheckpointType.LOCAL:
        save_local_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                              generate_state_dict, _local_rng_state())
        return
    if non_persistent_ckpt:
        save_dir, ckpt_type = non_persistent_dir(args, args.save), CheckpointType.GLOBAL
        if _rank() == 0:
            os.makedirs(save_dir, exist_ok=True)
    ckpt_format = {CheckpointType.GLOBAL: "torch_dist", CheckpointType.TORCH_DCP: "torch_dcp"}.get(ckpt_type, "torch")
    maybe_finalize_async_save(blocking=False)
    print_rank_0("saving checkpoint at iteration {:7d} to {} in {} format".format(iteration, save_dir, ckpt_format))
    tmp_dir = _temp_dir(save_dir, iteration)
    if _rank() == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        os.makedirs(tmp_dir, exist_ok=True)
    _barrier()
    if ckpt_type == CheckpointType.GLOBAL:
        _save_torch_dist(args, iteration, model, optimizer, opt_param_scheduler,
                         num_floating_point_operations_so_far, save_dir, non_persistent_ckpt, train_data_iterator)
        return
    rng_state = get_rng_state()
    if ckpt_type == CheckpointType.TORCH_DCP:
        final_dir = get_checkpoint_name(save_dir, iteration, return_base_dir=True)
        save_torch_dcp(args, model, optimizer, opt_param_scheduler, None if args.no_save_rng else rng_state,
                       iteration, num_floating_point_operations_so_far, tmp_dir,
                       lambda: _publish_and_report(save_dir, iteration, final_dir))
        return
    name_args = dict(pipeline_parallel=pipeline_parallel, tensor_rank=tensor_rank, pipeline_rank=pipeline_rank,
                     expert_parallel=expert_parallel, expert_rank=expert_rank)
    final_name = get_checkpoint_name(save_dir, iteration, **name_args)
    tmp_name = os.path.join(tmp_dir, os.path.relpath(final_name, os.path.join(save_dir, _iteration_dir_name(iteration))))
    ensure_directory_exists(tmp_name)
    if args.use_distributed_optimizer and not args.no_save_optim and optimizer is not None:
        optimizer.save_parameter_state(get_distributed_optimizer_checkpoint_name(tmp_name))
    if _writes_model_file():
        rerun_state = get_rerun_state_machine().state_dict(data_iterator=train_data_iterator, ckpt_format="torch")
        state_dict = generate_state_dict(args, model, optimizer, opt_param_scheduler, rng_state,
                                         iteration=iteration, rerun_state=rerun_state)
        state_dict["num_floating_point_operations_so_far"] = float(num_floating_point_operations_so_far)
        torch.save(state_dict, tmp_name)
    _barrier()
    _publish_and_report(save_dir, iteration, final_name)


def _publish_and_report(save_dir, iteration, checkpoint_name):
    """Collective: rank 0 publishes the finished temp dir and the tracker; everyone reports."""
    _barrier()
    if _rank() == 0:
        _publish(save_dir, iteration)
    _barrier()
    print_rank_0("  successfully saved checkpoint from iteration {:7d} to {} [ t {}/{}, p {}/{} ]".format(
        iteration, save_dir, mpu.get_tensor_model_parallel_rank() + 1, mpu.get_tensor_model_parallel_world_size(),
        mpu.get_pipeline_model_parallel_rank() + 1, mpu.get_pipeline_model_parallel_world_size()))
    writer = get_wandb_writer()
    if writer is not None and is_last_rank():
        wandb_utils.on_save_checkpoint_success(checkpoint_name, get_checkpoint_tracker_filename(save_dir), save_dir,
                                               iteration, writer=writer)
    _barrier()


def _save_torch_dist(args, iteration, model, optimizer, opt_param_scheduler, num_flops, save_dir,
                     non_persistent=False, train_data_iterator=None):
    """Sharded save into the temp dir; publishing (rename + tracker) runs once the data is durable.
    A non-persistent save then removes the older non-persistent iterations."""
    rng_state = None if args.no_save_rng else get_rng_state("torch_dist")
    rerun_state = get_rerun_state_machine().state_dict(data_iterator=train_data_iterator, ckpt_format="torch_dist")
    state_dict = generate_sharded_state_dict(args, model, optimizer, opt_param_scheduler, rng_state,
                                             iteration=iteration, include_optimizer=not args.no_save_optim,
                                             num_flops=float(num_flops or 0.0), rerun_state=rerun_state,
                                             optim_sd_kwargs={"metadata": content_metadata(args)})
    final_dir = get_checkpoint_name(save_dir, iteration, return_base_dir=True)

    def publish():
        _publish_and_report(save_dir, iteration, final_dir)
        if non_persistent and _rank() == 0:
            _remove_older_iterations(save_dir, iteration)

    save_sharded(args, state_dict, _temp_dir(save_dir, iteration), publish)
    if args.async_save:
        print_rank_0(f"  scheduled asynchronous save of iteration {iteration}; training continues")


def _load_file(path):
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"checkpoint file {path} is missing: the checkpoint is incomplete or was written with a different "
            f"tensor/pipeline/expert parallel layout; check --load and the parallel sizes."
        )
    try:
        return safe_torch_load(path, map_location="cpu")
    except Exception as exc:
        raise RuntimeError(
            f"checkpoint file {path} is corrupt or not a weights-only checkpoint ({type(exc).__name__}: {exc}); "
            f"load an earlier iteration with --ckpt-step N or re-save the checkpoint."
        ) from exc


def _resolve_load_dir(args, load_arg):
    """(load_dir, iteration, release) or (load_dir, None, False) when there is nothing to load."""
    load_dir = getattr(args, load_arg)
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if (load_dir is None or not checkpoint_exists(load_dir)) and pretrained is not None and args.ckpt_step is None:
        if checkpoint_exists(pretrained):
            print_rank_0(f"loading the pretrained checkpoint {pretrained} (implies --finetune)")
            args.finetune = True
            load_dir = pretrained
    if load_dir is None:
        return None, None, False
    if args.ckpt_step is not None:
        return load_dir, args.ckpt_step, False
    newer = _newer_non_persistent(args, load_dir)
    if newer is not None:
        return newer
    tracker = get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker):
        if args.exit_on_missing_checkpoint:
            print_rank_0(">> '--exit-on-missing-checkpoint' set ... exiting. <<")
            print_rank_0(f"    no checkpoint tracker {tracker}")
            _barrier()
            sys.exit()
        print_rank_0(f"WARNING: could not find the metadata file {tracker}")
        print_rank_0("    will not load any checkpoints and will start from random")
        return load_dir, None, False
    iteration, release = read_metadata(tracker)
    return load_dir, iteration, release


def non_persistent_dir(args, save_dir):
    """Where global non-persistent checkpoints go: --non-persistent-global-ckpt-dir or <save>/non_persistent."""
    return getattr(args, "non_persistent_global_ckpt_dir", None) or os.path.join(save_dir, _NON_PERSISTENT_SUBDIR)


def _newer_non_persistent(args, load_dir):
    """(dir, iteration, False) of a global non-persistent checkpoint newer than the persistent one, else None."""
    np_dir = non_persistent_dir(args, load_dir)
    np_tracker = get_checkpoint_tracker_filename(np_dir)
    if not os.path.isfile(np_tracker):
        return None
    np_iteration, _ = read_metadata(np_tracker)
    tracker = get_checkpoint_tracker_filename(load_dir)
    persistent = read_metadata(tracker)[0] if os.path.isfile(tracker) else -1
    if np_iteration <= persistent:
        return None
    print_rank_0(f" the non-persistent checkpoint {np_dir} (iteration {np_iteration}) is newer than the "
                 f"persistent one; loading it")
    return np_dir, np_iteration, False


def _remove_older_iterations(save_dir, iteration):
    """Rank 0: keep only the newest non-persistent checkpoint."""
    for name in os.listdir(save_dir):
        if name.startswith("iter_") and name != _iteration_dir_name(iteration):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


def _load_base_checkpoint(load_dir, args, iteration, release):
    """Read this rank's legacy file."""
    checkpoint_name = get_checkpoint_name(load_dir, iteration, release)
    print_rank_0(f" loading checkpoint from {load_dir} at iteration {iteration}")
    return _load_file(checkpoint_name), checkpoint_name


def _detect_format(args, base_dir):
    """The format of `base_dir` (spec §4c "Load"); names the directory when it holds no checkpoint."""
    if not os.path.isdir(base_dir):
        parent, name = os.path.split(os.path.normpath(base_dir))
        interrupted = os.path.join(parent, ".tmp_" + name)
        note = (f" ({interrupted} holds an interrupted save, which is never loaded)" if os.path.isdir(interrupted)
                else "")
        raise FileNotFoundError(f"checkpoint directory {base_dir} does not exist{note}; load an earlier iteration "
                                f"with --ckpt-step N or drop --ckpt-step to load the tracker's iteration.")
    ckpt_format = get_checkpoint_format(base_dir)
    if ckpt_format is None and os.path.isfile(os.path.join(base_dir, "common.pt")):
        raise FileNotFoundError(
            f"{base_dir} is not a complete checkpoint: its metadata.json is missing (the torch_dist save was "
            f"interrupted or the file was removed); load an earlier iteration with --ckpt-step N.")
    if ckpt_format is None:
        raise FileNotFoundError(
            f"{base_dir} is not a checkpoint: it has no metadata.json (torch_dist, maybe an interrupted save), "
            f"no mp_rank_* directory (torch) and no .metadata (torch_dcp); load an earlier iteration with "
            f"--ckpt-step N.")
    if ckpt_format != args.ckpt_format and not args.auto_detect_ckpt_format:
        print_rank_0(f"INFO: {base_dir} is a {ckpt_format} checkpoint (--ckpt-format is {args.ckpt_format}); "
                     f"loading it as {ckpt_format}.")
    return ckpt_format


def check_checkpoint_args(checkpoint_args, compare_parallel_sizes=True):
    """Raise one ValueError listing every model-shape arg that differs between the checkpoint and the CLI
    (TP/PP sizes too for legacy checkpoints, which cannot be resharded)."""
    args = get_args()
    problems = []

    def _compare(name, default=None):
        stored = getattr(checkpoint_args, name, default)
        current = getattr(args, name, default)
        if stored != current:
            flag = "--" + name.replace("_", "-")
            problems.append(f"{flag} is {current!r} but the checkpoint was saved with {stored!r}")

    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        _compare(name)
    _compare("add_position_embedding", default=True)
    if getattr(args, "vocab_file", None):
        for name in ("max_position_embeddings", "make_vocab_size_divisible_by", "padded_vocab_size",
                     "tokenizer_type"):
            _compare(name)
    if args.data_parallel_random_init:
        _compare("data_parallel_random_init")
    if compare_parallel_sizes:
        _compare("tensor_model_parallel_size")
        _compare("pipeline_model_parallel_size")
    if problems:
        raise ValueError(
            "the checkpoint does not match the command line (legacy torch checkpoints need the same model shape "
            "and TP/PP sizes; torch_dist checkpoints the same model shape):\n  " + "\n  ".join(problems)
            + "\nuse the checkpoint's values on the command line."
        )


def _rank_zero_checkpoint_file(load_dir, iteration, release):
    """TP/PP/EP rank 0's file, found without parallel state (the layout may differ from the CLI's)."""
    found = find_checkpoint_rank_0(load_dir, iteration, release)
    if found is not None and found.endswith(".pt"):
        return found
    return get_checkpoint_name(load_dir, iteration, release, pipeline_parallel=False, tensor_rank=0, pipeline_rank=0,
                               expert_parallel=False)


_CHECKPOINT_MODEL_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads", "num_query_groups",
    "group_query_attention", "kv_channels", "max_position_embeddings", "position_embedding_type",
    "add_position_embedding", "use_rotary_position_embeddings", "rotary_base", "rotary_percent",
    "rotary_interleaved", "swiglu", "squared_relu", "untie_embeddings_and_output_weights", "apply_layernorm_1p",
    "normalization", "add_bias_linear", "add_qkv_bias", "qk_layernorm", "make_vocab_size_divisible_by",
    "padded_vocab_size", "tokenizer_type",
)
_CHECKPOINT_MP_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                       "virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage")


def _read_args_and_iteration(load_dir, iteration, release):
    """(checkpoint args Namespace, iteration, format) of either format, read without unsafe unpickling."""
    base = get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
    ckpt_format = get_checkpoint_format(base)
    if ckpt_format == "torch_dist":
        common = safe_torch_load(os.path.join(base, "common.pt"), map_location="cpu")
        if "args" not in common:
            raise RuntimeError(f"{base}/common.pt has no 'args' entry: --use-checkpoint-args cannot use it.")
        return checkpoint_args_namespace(common["args"]), common.get("iteration", 0), "torch_dist"
    if ckpt_format == "torch_dcp":
        return (*read_torch_dcp_args(base), "torch_dcp")
    state_dict = _load_file(_rank_zero_checkpoint_file(load_dir, iteration, release))
    return checkpoint_args_namespace(state_dict["args"]), state_dict.get("iteration", 0), "torch"


def load_args_from_checkpoint(args, load_arg="load", checkpointing_context=None):
    """Return (args, checkpoint_args) with model-shape args copied from the checkpoint (--use-checkpoint-args).

    With --use-mp-args-from-checkpoint-args also the TP/PP/VP sizes (always for legacy checkpoints, which
    cannot be resharded)."""
    load_dir, iteration, release = _resolve_load_dir(args, load_arg)
    if iteration is None:
        print_rank_0("No checkpoint found, not loading args from it.")
        return args, args
    checkpoint_args, args.iteration, ckpt_format = _read_args_and_iteration(load_dir, iteration, release)
    names = list(_CHECKPOINT_MODEL_ARGS)
    if getattr(args, "use_mp_args_from_checkpoint_args", False) or ckpt_format == "torch":
        names += _CHECKPOINT_MP_ARGS
    for name in names:
        if hasattr(checkpoint_args, name):
            setattr(args, name, getattr(checkpoint_args, name))
    return args, checkpoint_args


def _restore_args_state(args, state_dict, compare_parallel_sizes=True):
    if "args" in state_dict and not args.finetune:
        checkpoint_args = checkpoint_args_namespace(state_dict["args"])
        check_checkpoint_args(checkpoint_args, compare_parallel_sizes)
        args.consumed_train_samples = getattr(checkpoint_args, "consumed_train_samples", 0)
        args.skipped_train_samples = getattr(checkpoint_args, "skipped_train_samples", 0)
        update_num_microbatches(consumed_samples=args.consumed_train_samples, verbose=True)
        args.consumed_valid_samples = getattr(checkpoint_args, "consumed_valid_samples", 0)
    elif "args" not in state_dict:
        print_rank_0("could not find arguments in the checkpoint ...")


def _load_model(model, state_dict, strict, where="the checkpoint"):
    unwrapped = unwrap_model(model)
    if len(unwrapped) == 1:
        load_model_chunk(unwrapped[0], state_dict["model"], strict, where)
        return
    for i, chunk in enumerate(unwrapped):
        key = "model%d" % i
        if key not in state_dict:
            raise KeyError(f"the checkpoint has no {key!r} entry for virtual pipeline chunk {i}")
        load_model_chunk(chunk, state_dict[key], strict, where)


def _load_optimizer(args, optimizer, opt_param_scheduler, state_dict, checkpoint_name, release):
    if release or args.finetune or args.no_load_optim:
        if (args.fp16 or args.bf16) and optimizer is not None and hasattr(optimizer, "reload_model_params"):
            optimizer.reload_model_params()
        return
    try:
        if optimizer is not None and not getattr(optimizer, "is_stub_optimizer", False):
            optimizer.load_state_dict(state_dict["optimizer"])
            if args.use_distributed_optimizer:
                optimizer.load_parameter_state(get_distributed_optimizer_checkpoint_name(checkpoint_name))
        if opt_param_scheduler is not None:
            key = "lr_scheduler" if "lr_scheduler" in state_dict else "opt_param_scheduler"
            opt_param_scheduler.load_state_dict(state_dict[key])
    except KeyError as exc:
        raise RuntimeError(
            f"unable to load the optimizer state from checkpoint {checkpoint_name} (missing {exc}): pass "
            f"--no-load-optim or --finetune to skip loading the optimizer state."
        ) from exc


def _load_rng(args, state_dict, checkpoint_name, release):
    if release or args.finetune or args.no_load_rng:
        return
    if "rng_state" not in state_dict:
        raise RuntimeError(f"checkpoint {checkpoint_name} has no rng_state: pass --no-load-rng or --finetune.")
    states = state_dict["rng_state"]
    index = mpu.get_data_parallel_rank() if args.data_parallel_random_init and len(states) > 1 else 0
    try:
        _set_rng_state(states[index])
    except KeyError as exc:
        raise RuntimeError(
            f"unable to load the RNG state from checkpoint {checkpoint_name} (missing {exc}): pass "
            f"--no-load-rng or --finetune to skip it."
        ) from exc


def load_checkpoint(model, optimizer, opt_param_scheduler, load_arg="load", strict=True, checkpointing_context=None,
                    skip_load_to_model_and_opt=False):
    """Load the checkpoint named by `args.<load_arg>`; returns (iteration, num_floating_point_operations_so_far)."""
    args = get_args()
    model = model if isinstance(model, list) else [model]
    load_dir, iteration, release = _resolve_load_dir(args, load_arg)
    if args.ckpt_step is None and not args.finetune:
        local = find_local_checkpoint(args, -1 if iteration is None or release else iteration)
        if local is not None:
            return _load_local(args, model, optimizer, opt_param_scheduler, local[0], strict)
    if iteration is None:
        return 0, 0
    base_dir = get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
    ckpt_format = _detect_format(args, base_dir)
    if checkpoint_type(ckpt_format) != CheckpointType.LEGACY:
        return _load_distributed(ckpt_format, args, model, optimizer, opt_param_scheduler, load_dir, base_dir,
                                 iteration, release, strict)
    state_dict, checkpoint_name = _load_base_checkpoint(load_dir, args, iteration, release)
    set_checkpoint_version(state_dict.get("checkpoint_version", 0))
    if args.finetune or release:
        iteration = 0
    else:
        iteration = state_dict.get("iteration", state_dict.get("total_iters"))
        if iteration is None:
            raise RuntimeError(f"checkpoint {checkpoint_name} has no 'iteration' entry; pass --finetune to "
                               f"load only the weights.")
    num_flops = state_dict.get("num_floating_point_operations_so_far", 0)
    _restore_args_state(args, state_dict)
    if not skip_load_to_model_and_opt:
        _load_model(model, state_dict, strict, checkpoint_name)
    _load_optimizer(args, optimizer, opt_param_scheduler, state_dict, checkpoint_name, release)
    _load_rng(args, state_dict, checkpoint_name, release)
    if not (release or args.finetune) and isinstance(state_dict.get("rerun_state_machine"), dict):
        get_rerun_state_machine().load_state_dict(state_dict["rerun_state_machine"])
    _barrier()
    _report_loaded(load_dir, iteration)
    return iteration, num_flops


def _load_local(args, model, optimizer, opt_param_scheduler, path, strict):
    """Load this rank's local non-persistent checkpoint file (see checkpointing_local)."""
    state_dict = _load_file(path)
    check_local_layout(state_dict, path)
    set_checkpoint_version(state_dict.get("checkpoint_version", 0))
    _restore_args_state(args, state_dict)
    _load_model(model, state_dict, strict)
    if args.use_distributed_optimizer and not args.no_load_optim and optimizer is not None:
        optimizer.load_state_dict(state_dict["optimizer"])
        load_local_optimizer_shards(optimizer, state_dict)
        if opt_param_scheduler is not None:
            opt_param_scheduler.load_state_dict(state_dict["opt_param_scheduler"])
    else:
        _load_optimizer(args, optimizer, opt_param_scheduler, state_dict, path, False)
    _load_rng(args, state_dict, path, False)
    _barrier()
    iteration = state_dict["iteration"]
    _report_loaded(os.path.dirname(os.path.dirname(path)), iteration)
    return iteration, state_dict.get("num_floating_point_operations_so_far", 0)


def _report_loaded(load_dir, iteration):
    print_rank_0(f"  successfully loaded checkpoint from {load_dir} "
                 f"[ t {mpu.get_tensor_model_parallel_rank() + 1}/{mpu.get_tensor_model_parallel_world_size()}, "
                 f"p {mpu.get_pipeline_model_parallel_rank() + 1}/{mpu.get_pipeline_model_parallel_world_size()} ] "
                 f"at iteration {iteration}")


def _load_distributed(ckpt_format, args, model, optimizer, opt_param_scheduler, load_dir, base_dir, iteration,
                      release, strict):
    """Load a torch_dist checkpoint (at any TP/PP/DP layout) or a torch_dcp one (model, optimizer, scheduler,
    RNG)."""
    print_rank_0(f" loading {ckpt_format} checkpoint from {load_dir} at iteration {iteration}")
    load_optim = not (release or args.finetune or args.no_load_optim)
    load_rng = not (release or args.finetune or args.no_load_rng)
    if ckpt_format == "torch_dist":
        state_dict = load_sharded(args, model, optimizer, opt_param_scheduler, base_dir, load_optim, load_rng,
                                  _local_rng_state(), strict, load_rerun=not (release or args.finetune))
    else:
        state_dict = load_torch_dcp(args, model, optimizer, opt_param_scheduler, base_dir, load_optim, load_rng,
                                    _local_rng_state(), strict)
    set_checkpoint_version(state_dict.get("checkpoint_version", 0))
    if args.finetune or release:
        iteration = 0
    elif "iteration" not in state_dict:
        raise RuntimeError(f"checkpoint {base_dir} has no 'iteration' entry; pass --finetune to load only the weights.")
    else:
        iteration = state_dict["iteration"]
    _restore_args_state(args, state_dict, compare_parallel_sizes=ckpt_format == "torch_dcp")
    if not load_optim and (args.fp16 or args.bf16) and optimizer is not None:
        optimizer.reload_model_params()
    if "rng_state" in state_dict:
        states = state_dict["rng_state"]
        # torch_dist files this framework wrote before ShardedObjects were stored as Megatron's `[data]`.
        states = [states] if isinstance(states, dict) else states
        _set_rng_state(states[mpu.get_data_parallel_rank() if args.data_parallel_random_init and len(states) > 1
                              else 0])
    _barrier()
    _report_loaded(load_dir, iteration)
    return iteration, state_dict.get("num_floating_point_operations_so_far", 0)


def maybe_convert_checkpoint_and_exit(model, optimizer, opt_param_scheduler):
    """--ckpt-convert-format: re-save the loaded checkpoint under <ckpt-convert-save>/<format>, then exit."""
    args = get_args()
    if args.ckpt_convert_format is None:
        return
    source_format = args.ckpt_format
    args.ckpt_format = args.ckpt_convert_format
    args.save = os.path.join(args.ckpt_convert_save, args.ckpt_convert_format)
    args.async_save = False
    save_checkpoint(args.iteration, model, optimizer, opt_param_scheduler,
                    args.num_floating_point_operations_so_far)
    print_rank_0(f"> converted checkpoint: {source_format} -> {args.ckpt_format} (saved to {args.save})")
    _barrier()
    sys.exit(0)


__all__ = [
    "CheckpointType", "checkpoint_type", "save_checkpoint", "load_checkpoint", "load_args_from_checkpoint", "get_checkpoint_name",
    "get_checkpoint_tracker_filename", "read_metadata", "checkpoint_exists", "get_rng_state", "generate_state_dict",
    "maybe_finalize_async_save", "is_empty_async_queue", "maybe_convert_checkpoint_and_exit", "get_checkpoint_format",
    "isfile_", "find_checkpoint_rank_0", "get_load_checkpoint_path_by_args",
]
