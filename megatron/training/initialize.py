"""Start a run: parse and validate the CLI, set globals, start torch.distributed, build the groups, seed.

Environment (torchrun): `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` are read here
and nowhere else. A plain `python pretrain_gpt.py ...` without them runs as a world of one process
(a 1-rank group on a free local port). The backend is nccl on a GPU and gloo on CPU; an explicit
`--distributed-backend gloo` is honored on a GPU, and the CLI default `nccl` on a machine without a GPU
becomes gloo with one info line.
"""
import logging
import os
import random
import socket
from datetime import timedelta

import numpy as np
import torch

from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.rerun_state_machine import (
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    initialize_rerun_state_machine,
)
from megatron.training import arguments as arguments_mod
from megatron.training.checkpointing import load_args_from_checkpoint
from megatron.core.datasets.utils import compile_helpers
from megatron.training.global_vars import get_args, set_global_variables
from megatron.training.log_handler import setup_logging
from megatron.training.training_log import write_args_to_tensorboard as _write_args
from megatron.training.utils import print_rank_0

logger = logging.getLogger(__name__)


def _env_int(name, default):
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def _set_launch_env(args):
    """Fill rank/world_size/local_rank from the launcher's environment (torchrun) or a 1-process world."""
    args.rank = _env_int("RANK", 0)
    args.world_size = _env_int("WORLD_SIZE", 1)
    args.local_rank = _env_int("LOCAL_RANK", getattr(args, "local_rank", 0) or 0)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        args.rank = torch.distributed.get_rank()
        args.world_size = torch.distributed.get_world_size()


def _parse_and_validate(extra_args_provider, args_defaults, ignore_unknown_args, parsed_args):
    """parse -> (checkpoint args) -> validate; a bad command line exits 2 listing every problem."""
    try:
        args = parsed_args if parsed_args is not None else arguments_mod.parse_args(
            extra_args_provider, ignore_unknown_args)
        _set_launch_env(args)
        if getattr(args, "use_checkpoint_args", False) or args_defaults.get("use_checkpoint_args", False):
            if args.load is None:
                raise arguments_mod.ArgumentsError(["--use-checkpoint-args needs --load <dir>: add --load."])
            load_args_from_checkpoint(args)
        args = arguments_mod.validate_args(args, args_defaults)
    except arguments_mod.ArgumentsError as exc:
        arguments_mod.exit_on_arguments_error(exc)
    return args


def initialize_megatron(extra_args_provider=None, args_defaults={}, ignore_unknown_args=False, allow_no_cuda=False,
                        skip_mpu_initialization=False, get_embedding_ranks=None, get_position_embedding_ranks=None,
                        parsed_args=None, store=None):
    """Set up everything a training script needs before building the model (Megatron's entry)."""
    args = _parse_and_validate(extra_args_provider, args_defaults, ignore_unknown_args, parsed_args)
    set_global_variables(args)
    setup_logging(getattr(args, "logging_level", None))
    _initialize_rerun_state_machine(args)
    if skip_mpu_initialization:
        return None

    def finish_mpu_init():
        _initialize_distributed(get_embedding_ranks, get_position_embedding_ranks, store)
        if args.rank == 0:
            print("> setting random seeds to {} ...".format(args.seed), flush=True)
        _set_random_seed(args.seed, args.data_parallel_random_init,
                         te_rng_tracker=getattr(args, "te_rng_tracker", False))

    if getattr(args, "lazy_mpu_init", False):
        args.use_cpu_initialization = True
        return finish_mpu_init
    finish_mpu_init()
    _compile_dependencies()
    if getattr(args, "tp_comm_overlap", False):
        _initialize_tp_communicators()
    return None


def _compile_dependencies():
    """Megatron compiles its C++ dataset helpers and loads Apex/TorchScript fused kernels here. The dataset
    helpers are NumPy and the fused ops PyTorch in this framework (`compile_helpers` is a no-op), so there is
    nothing to build or load."""
    compile_helpers()


def _initialize_tp_communicators():
    """Megatron creates Transformer Engine's userbuffers communicators for `--tp-comm-overlap` here. The native
    overlap (`megatron/core/tensor_parallel/overlap.py`) exchanges its chunks over the TP group itself (copy
    engines or NCCL/gloo point-to-point), so no communicator is created; `--tp-comm-overlap-cfg` is not read."""
    logger.info("--tp-comm-overlap: the native pipelines use the tensor-parallel group; no userbuffers "
                "communicators to create")


def write_args_to_tensorboard():
    """Every argument as a TensorBoard text entry (on the last rank, which holds the writer)."""
    _write_args(get_args())


def _save_rng_tracker_state():
    """Extra state a re-run of the iteration restores: the model-parallel RNG tracker's states."""
    return {"rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _restore_rng_tracker_state(state_dict):
    if state_dict["rng_tracker_states"]:
        tensor_parallel.get_cuda_rng_tracker().set_states(state_dict["rng_tracker_states"])


def _initialize_rerun_state_machine(args) -> None:
    """The rerun state machine of `--rerun-mode`, injecting errors per `--error-injection-rate/-type` and
    appending rejections to `--result-rejected-tracker-filename` (Megatron's wiring)."""
    initialize_rerun_state_machine(
        state_save_func=_save_rng_tracker_state,
        state_restore_func=_restore_rng_tracker_state,
        mode=RerunMode(getattr(args, "rerun_mode", "disabled") or "disabled"),
        error_injector=RerunErrorInjector(
            error_injection_rate=getattr(args, "error_injection_rate", 0) or 0,
            error_injection_type=RerunDiagnostic(getattr(args, "error_injection_type", "transient_error")),
        ),
        result_rejected_tracker_filename=getattr(args, "result_rejected_tracker_filename", None),
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _choose_backend(args) -> str:
    requested = args.distributed_backend
    if torch.cuda.is_available():
        return requested
    if requested == "nccl":
        if args.rank == 0:
            print("INFO: no CUDA device is available, so torch.distributed uses the gloo backend "
                  "(--distributed-backend nccl needs GPUs).", flush=True)
        return "gloo"
    return requested


def _init_method(args):
    """torchrun's env:// when MASTER_ADDR is set; a free local port for a single plain process."""
    if os.environ.get("MASTER_ADDR"):
        return "env://"
    if args.world_size > 1:
        raise RuntimeError(
            f"WORLD_SIZE is {args.world_size} but MASTER_ADDR/MASTER_PORT are not set: launch with torchrun "
            f"(e.g. torchrun --nproc-per-node {args.world_size} pretrain_gpt.py ...)."
        )
    return f"tcp://127.0.0.1:{_free_port()}"


def _initialize_distributed(get_embedding_ranks, get_position_embedding_ranks, store):
    """Start torch.distributed (unless a test already did) and build the parallel groups."""
    args = get_args()
    device_count = torch.cuda.device_count()
    if device_count > 0:
        if args.local_rank >= device_count:
            raise RuntimeError(f"LOCAL_RANK {args.local_rank} is not a valid device (this node has {device_count}).")
        torch.cuda.set_device(args.local_rank)
    if torch.distributed.is_initialized():
        if args.rank == 0:
            print("torch distributed is already initialized, skipping initialization ...", flush=True)
        args.rank = torch.distributed.get_rank()
        args.world_size = torch.distributed.get_world_size()
    else:
        if args.rank == 0:
            print("> initializing torch distributed ...", flush=True)
        kwargs = {
            "backend": _choose_backend(args),
            "world_size": args.world_size,
            "rank": args.rank,
            "timeout": timedelta(minutes=args.distributed_timeout_minutes),
        }
        if store is not None:
            kwargs["store"] = store
        else:
            kwargs["init_method"] = _init_method(args)
        if device_count > 0 and kwargs["backend"] == "nccl":
            kwargs["device_id"] = torch.device(f"cuda:{args.local_rank}")
        torch.distributed.init_process_group(**kwargs)
    if mpu.model_parallel_is_initialized():
        print_rank_0("model parallel is already initialized")
        return
    mpu.initialize_model_parallel(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size,
        args.pipeline_model_parallel_split_rank,
        pipeline_model_parallel_comm_backend=getattr(args, "pipeline_model_parallel_comm_backend", None),
        context_parallel_size=args.context_parallel_size,
        hierarchical_context_parallel_sizes=getattr(args, "hierarchical_context_parallel_sizes", None),
        expert_model_parallel_size=args.expert_model_parallel_size,
        num_distributed_optimizer_instances=getattr(args, "num_distributed_optimizer_instances", 1),
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        nccl_communicator_config_path=getattr(args, "nccl_communicator_config_path", None),
        order="tp-cp-ep-dp-pp" if not getattr(args, "use_tp_pp_dp_mapping", False) else "tp-cp-ep-pp-dp",
        get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
        create_gloo_process_groups=getattr(args, "enable_gloo_process_groups", True),
    )
    if args.rank == 0:
        print(f"> initialized tensor model parallel with size {mpu.get_tensor_model_parallel_world_size()}")
        print(f"> initialized pipeline model parallel with size {mpu.get_pipeline_model_parallel_world_size()}",
              flush=True)


def _set_random_seed(seed_, data_parallel_random_init=False, te_rng_tracker=False, inference_rng_tracker=False,
                     use_cudagraphable_rng=False):
    """Seed python/numpy/torch with seed + 100*pp_rank (+ 10*dp_rank), then the TP RNG tracker."""
    if seed_ is None or seed_ <= 0:
        raise ValueError(f"--seed ({seed_}) must be a positive integer: pass e.g. --seed 1234.")
    seed = seed_ + 100 * mpu.get_pipeline_model_parallel_rank()
    if data_parallel_random_init:
        seed = seed + 10 * mpu.get_data_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if te_rng_tracker or inference_rng_tracker or use_cudagraphable_rng:
        tensor_parallel.model_parallel_cuda_manual_seed(seed, te_rng_tracker, inference_rng_tracker,
                                                        use_cudagraphable_rng)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def set_jit_fusion_options():
    """Megatron sets TorchScript fuser options and warms its fusions up here; the fused ops here are plain
    PyTorch (compiled per input signature on first use), so there are no options to set."""
    _warmup_jit_function()


def _warmup_jit_function():
    """Megatron runs its TorchScript fusions (bias-GeLU/SwiGLU, bias-dropout-add) a few times so that they are
    compiled before training. The fused ops here compile per input signature when first called with it, inside
    training, so warming them up with other shapes would only add compilations: nothing to run."""
    return None



def shutdown_distributed():
    """End an entry script's run in order: every rank reaches a barrier, then the default process group is
    destroyed before the interpreter exits (a gloo group torn down by interpreter shutdown while a peer is still
    closing its connections can abort the process after the run has finished)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
