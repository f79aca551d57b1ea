"""The training framework: `pretrain` and the pieces it is built from (Megatron's `training.py`).

`pretrain` initializes Megatron, builds model chunks (`get_model`), the optimizer and LR scheduler,
loads a checkpoint, builds data iterators that resume at the consumed sample counts, runs `train`, and
evaluates. The iteration itself lives in `train_step.py`, the log line and FLOPs in `training_log.py`,
evaluation in `evaluation.py`.
"""
import argparse
import copy
import os
import sys
import time
from datetime import datetime

import torch

from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core import distributed as core_distributed
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.enums import ModelType
from megatron.core.num_microbatches_calculator import (
    get_current_global_batch_size,
    get_current_running_global_batch_size,
    get_num_microbatches,
    update_num_microbatches,
)
from megatron.core.optimization_plan.apply import apply_optimization_plan, device_facts_of
from megatron.core.optimization_plan.resolve import PlanError, format_plan, resolve_plan
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.deferred_checks import get_deferred_checks
from megatron.core.rerun_state_machine import RerunDataIterator, RerunStateMachine, get_rerun_state_machine
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config
from megatron.training import arguments as arguments_mod
from megatron.training import global_vars
from megatron.training.checkpointing import (announce_checkpoint_format, checkpoint_exists, load_checkpoint,
                                             maybe_convert_checkpoint_and_exit, maybe_finalize_async_save,
                                             save_checkpoint)
from megatron.training.datasets.data_samplers import build_pretraining_data_loader
from megatron.training.evaluation import evaluate, evaluate_and_print_results
from megatron.training.global_vars import get_args, get_signal_handler, get_tensorboard_writer, get_timers
from megatron.training.global_vars import get_wandb_writer
from megatron.training.initialize import initialize_megatron, set_jit_fusion_options
from megatron.training.train_step import TrainStepResult, train_step
from megatron.training.training_hooks import TrainingHooks
from megatron.training.training_monitors import TrainingMonitors
from megatron.training.training_log import num_floating_point_operations, training_log, write_args_to_tensorboard
from megatron.training.utils import (
    append_to_progress_log,
    calc_params_l2_norm,
    print_datetime,
    print_line,
    print_rank_0,
    unwrap_model,
)

__all__ = [
    "pretrain", "get_model", "setup_model_and_optimizer", "get_optimizer_param_scheduler", "train", "train_step",
    "TrainStepResult", "training_log", "evaluate", "evaluate_and_print_results", "num_floating_point_operations",
    "build_train_valid_test_data_iterators", "save_checkpoint_and_time", "checkpoint_and_decide_exit",
]


def _device():
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _collective_device():
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _build_model_chunks(model_provider_func, model_type, args):
    if mpu.get_pipeline_model_parallel_world_size() > 1 and args.virtual_pipeline_model_parallel_size is not None:
        chunks = []
        for i in range(args.virtual_pipeline_model_parallel_size):
            chunk = model_provider_func(
                pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=i),
                post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=i),
                vp_stage=i,
            )
            chunk.model_type = model_type
            chunk.vp_stage = i
            chunks.append(chunk)
        return chunks
    chunk = model_provider_func(pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage())
    chunk.model_type = model_type
    return [chunk]


def _wrap_data_parallel(model, args, num_parameters):
    config = get_model_config(model[0])
    if getattr(args, "use_torch_fsdp2", False):
        return [core_distributed.TorchFullyShardedDataParallel(config=config, ddp_config=arguments_mod.ddp_config_from_args(args),
                                              module=chunk) for chunk in model]
    ddp_config = arguments_mod.ddp_config_from_args(
        args, num_parameters=num_parameters,
        data_parallel_size=mpu.get_data_parallel_world_size(with_context_parallel=True))
    wrapped = [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                disable_bucketing=(i > 0) or args.overlap_param_gather_with_optimizer_step)
        for i, chunk in enumerate(model)
    ]
    if args.data_parallel_random_init:
        for chunk in wrapped:
            chunk.broadcast_params()
    return wrapped


def _apply_optimization_plan(model, args) -> None:
    """Resolve the optimisation plan for the built chunks, print it (rank 0), keep it in the args (so that it
    is saved with every checkpoint as `args.optimization_plan`) and apply it. Settings the plan cannot carry
    out end the run like a bad command line (every problem listed, exit status 2)."""
    try:
        plan = resolve_plan(get_model_config(model[0]), device_facts_of(model))
    except PlanError as error:
        arguments_mod.exit_on_arguments_error(arguments_mod.ArgumentsError(error.problems))
    print_rank_0(format_plan(plan))
    args.optimization_plan = plan.as_dict()
    apply_optimization_plan(model, plan)


def get_model(model_provider_func, model_type=ModelType.encoder_or_decoder, wrap_with_ddp=True):
    """Build this rank's model chunks (one per virtual stage), move to GPU, apply the optimisation plan, wrap
    for fp16/bf16 and DDP."""
    args = get_args()
    args.model_type = model_type
    if args.init_model_with_meta_device:
        with torch.device("meta"):
            model = _build_model_chunks(model_provider_func, model_type, args)
    else:
        model = _build_model_chunks(model_provider_func, model_type, args)
    for chunk in model:
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    num_parameters = sum(sum(p.nelement() for p in chunk.parameters()) for chunk in model)
    if mpu.get_data_parallel_rank() == 0 and mpu.get_context_parallel_rank() == 0:
        print_line(" > number of parameters on (tensor, pipeline) model parallel rank ({}, {}): {}".format(
            mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank(), num_parameters))
    if torch.cuda.is_available() and not args.init_model_with_meta_device and not (
            getattr(args, "use_torch_fsdp2", False) and args.use_cpu_initialization):
        for chunk in model:
            chunk.cuda(torch.cuda.current_device())
    _apply_optimization_plan(model, args)
    if args.fp16 or args.bf16:
        config = get_model_config(model[0])
        model = [Float16Module(config, chunk) for chunk in model]
    if wrap_with_ddp:
        model = _wrap_data_parallel(model, args, num_parameters)
    return model


def update_train_iters(args):
    """Sample-based training: derive train_iters from --train-samples (walking the batch ramp-up)."""
    if args.train_iters:
        return
    if args.rampup_batch_size is None:
        args.train_iters = args.train_samples // args.global_batch_size
    else:
        iterations, consumed = 0, 0
        while consumed <= int(args.rampup_batch_size[2]) and consumed <= args.train_samples:
            update_num_microbatches(consumed, consistency_check=False)
            consumed += get_current_global_batch_size()
            iterations += 1
        update_num_microbatches(0, consistency_check=False)
        if args.train_samples > consumed:
            iterations += (args.train_samples - consumed) // args.global_batch_size
        args.train_iters = iterations
    print_rank_0(f"setting training iterations to {args.train_iters}")


def get_optimizer_param_scheduler(optimizer):
    """The LR/WD scheduler; its steps are samples (iterations × global batch size in iteration mode)."""
    args = get_args()
    if args.train_iters:
        if args.lr_decay_iters is None:
            args.lr_decay_iters = args.train_iters
        lr_decay_steps = args.lr_decay_iters * args.global_batch_size
        wd_incr_steps = args.train_iters * args.global_batch_size
        wsd_decay_steps = None
        if args.lr_wsd_decay_iters is not None:
            wsd_decay_steps = args.lr_wsd_decay_iters * args.global_batch_size
        if args.lr_warmup_fraction is not None:
            lr_warmup_steps = args.lr_warmup_fraction * lr_decay_steps
        else:
            lr_warmup_steps = args.lr_warmup_iters * args.global_batch_size
    elif args.train_samples:
        update_train_iters(args)
        if args.lr_decay_samples is None:
            args.lr_decay_samples = args.train_samples
        lr_decay_steps = args.lr_decay_samples
        wd_incr_steps = args.train_samples
        wsd_decay_steps = args.lr_wsd_decay_samples
        if args.lr_warmup_fraction is not None:
            lr_warmup_steps = args.lr_warmup_fraction * lr_decay_steps
        else:
            lr_warmup_steps = args.lr_warmup_samples
    else:
        raise ValueError("neither --train-iters nor --train-samples is set: give one of them.")
    start_wd = args.weight_decay if args.start_weight_decay is None else args.start_weight_decay
    end_wd = args.weight_decay if args.end_weight_decay is None else args.end_weight_decay
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=lr_warmup_steps,
        lr_decay_steps=lr_decay_steps, lr_decay_style=args.lr_decay_style, start_wd=start_wd, end_wd=end_wd, wd_incr_steps=wd_incr_steps, wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler, wsd_decay_steps=wsd_decay_steps,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )


def _upcycle_dense_checkpoint(args, model, optimizer, model_provider_func, model_type):
    """--moe-use-upcycling (Megatron 0.13.1): load the dense checkpoint of --load into a dense twin (no experts,
    FFN = --ffn-hidden-size x granularity), convert it into `model`, save it as iteration 1 to --save."""
    from megatron.core.transformer.moe.upcycling_utils import load_and_upcycle_model

    torch.distributed.barrier()
    if checkpoint_exists(args.save):
        raise RuntimeError(f"--moe-use-upcycling: the destination {args.save} already holds a checkpoint. Upcycling "
                           f"converts a dense checkpoint once, on the first run; drop --moe-use-upcycling (and "
                           f"load {args.save}) for every later run.")
    saved = (args.num_experts, args.expert_model_parallel_size, args.ffn_hidden_size)
    args.num_experts, args.expert_model_parallel_size = None, 1
    args.ffn_hidden_size = saved[2] * args.moe_upcycling_granularity
    try:
        dense_model = get_model(model_provider_func, model_type, wrap_with_ddp=False)
    finally:
        args.num_experts, args.expert_model_parallel_size, args.ffn_hidden_size = saved
    _, args.num_floating_point_operations_so_far = load_and_upcycle_model(
        load_checkpoint, unwrap_model(model), unwrap_model(dense_model),
        granularity=args.moe_upcycling_granularity,
        load_kwargs={"model": dense_model, "optimizer": None, "opt_param_scheduler": None})
    args.iteration = 1
    save_checkpoint(args.iteration, model, None, None, args.num_floating_point_operations_so_far)
    torch.distributed.barrier()
    del dense_model
    if (args.fp16 or args.bf16) and optimizer is not None:
        optimizer.reload_model_params()
    print_rank_0(f"Upcycled checkpoint saved to {args.save}")


def setup_model_and_optimizer(model_provider_func, model_type, no_wd_decay_cond=None, scale_lr_cond=None,
                              lr_mult=1.0, checkpointing_context=None):
    """Model chunks, the Megatron optimizer and the scheduler; loads --load / --pretrained-checkpoint."""
    args = get_args()
    timers = get_timers()
    model = get_model(model_provider_func, model_type)
    announce_checkpoint_format(args)
    config = arguments_mod.optimizer_config_from_args(args)
    config.timers = timers
    optimizer = get_megatron_optimizer(config, model, no_wd_decay_cond, scale_lr_cond, lr_mult,
                                       use_gloo_process_groups=args.enable_gloo_process_groups)
    opt_param_scheduler = get_optimizer_param_scheduler(optimizer)
    if args.moe_use_upcycling:
        _upcycle_dense_checkpoint(args, model, optimizer, model_provider_func, model_type)
    elif args.load is not None or args.pretrained_checkpoint is not None:
        timers("load-checkpoint", log_level=0).start(barrier=True)
        args.iteration, args.num_floating_point_operations_so_far = load_checkpoint(
            model, optimizer, opt_param_scheduler, checkpointing_context=checkpointing_context)
        timers("load-checkpoint").stop(barrier=True)
        timers.log(["load-checkpoint"])
    else:
        args.iteration = 0
        args.num_floating_point_operations_so_far = 0
    return model, optimizer, opt_param_scheduler


def get_train_valid_test_num_samples():
    """[train, valid, test] dataset sizes in samples (valid covers every evaluation of the run)."""
    args = get_args()
    train_samples = args.train_samples if args.train_samples else args.train_iters * args.global_batch_size
    eval_iters = (args.train_iters // args.eval_interval + 1) * args.eval_iters
    return train_samples, eval_iters * args.global_batch_size, args.eval_iters * args.global_batch_size


def build_train_valid_test_datasets(build_train_valid_test_datasets_provider, train_valid_test_num_samples=None):
    """Call the provider with the target sizes."""
    if train_valid_test_num_samples is None:
        train_valid_test_num_samples = get_train_valid_test_num_samples()
    print_rank_0(" > datasets target sizes (minimum size):")
    print_rank_0("    train:      {}".format(train_valid_test_num_samples[0]))
    print_rank_0("    validation: {}".format(train_valid_test_num_samples[1]))
    print_rank_0("    test:       {}".format(train_valid_test_num_samples[2]))
    return build_train_valid_test_datasets_provider(train_valid_test_num_samples)


def build_train_valid_test_data_loaders(build_train_valid_test_datasets_provider):
    """Loaders resuming at consumed_train_samples / consumed_valid_samples; sets args.do_train/valid/test."""
    args = get_args()
    train_dl, valid_dl, test_dl = None, None, None
    print_rank_0("> building train, validation, and test datasets ...")
    if args.iteration > 0 and args.consumed_train_samples == 0:
        if args.train_samples is not None:
            raise ValueError("a checkpoint without consumed_train_samples can only resume iteration-based training "
                             "(--train-iters), not --train-samples.")
        args.consumed_train_samples = args.iteration * args.global_batch_size
    if args.iteration > 0 and args.consumed_valid_samples == 0 and args.train_samples is None:
        args.consumed_valid_samples = (args.iteration // args.eval_interval) * args.eval_iters * args.global_batch_size
    is_distributed = getattr(build_train_valid_test_datasets_provider, "is_distributed", False)
    if is_distributed or mpu.get_tensor_model_parallel_rank() == 0:
        train_ds, valid_ds, test_ds = build_train_valid_test_datasets(build_train_valid_test_datasets_provider)
        train_dl = build_pretraining_data_loader(train_ds, args.consumed_train_samples)
        valid_dl = build_pretraining_data_loader(valid_ds, 0 if args.skip_train else args.consumed_valid_samples)
        test_dl = build_pretraining_data_loader(test_ds, 0)
        flags = [int(train_dl is not None and args.train_iters > 0), int(valid_dl is not None and args.eval_iters > 0),
                 int(test_dl is not None and args.eval_iters > 0)]
    else:
        flags = [0, 0, 0]
    flags = torch.tensor(flags, dtype=torch.long, device=_collective_device())
    torch.distributed.broadcast(flags, 0)
    # ints, as Megatron stores them (its checkpoints hold do_train=1)
    args.do_train = getattr(args, "do_train", False) or flags[0].item()
    args.do_valid = getattr(args, "do_valid", False) or flags[1].item()
    args.do_test = getattr(args, "do_test", False) or flags[2].item()
    return train_dl, valid_dl, test_dl


def cyclic_iter(iterable):
    """Repeat an iterable forever."""
    while True:
        for x in iterable:
            yield x


def _get_iterator(dataloader_type, dataloader):
    if dataloader is None:
        return None
    if dataloader_type == "single":
        return RerunDataIterator(iter(dataloader))
    if dataloader_type == "cyclic":
        return RerunDataIterator(iter(cyclic_iter(dataloader)))
    if dataloader_type == "external":
        if isinstance(dataloader, list):
            return [RerunDataIterator(d) for d in dataloader]
        return RerunDataIterator(dataloader)
    raise ValueError(f"--dataloader-type ({dataloader_type!r}) must be single, cyclic or external.")


def build_train_valid_test_data_iterators(build_train_valid_test_datasets_provider):
    """(train, valid, test) iterators over the loaders of `build_train_valid_test_data_loaders`."""
    args = get_args()
    loaders = build_train_valid_test_data_loaders(build_train_valid_test_datasets_provider)
    return tuple(_get_iterator(args.dataloader_type, loader) for loader in loaders)


def should_disable_forward_pre_hook(args):
    """The distributed optimizer's overlapped param all-gather runs in forward pre-hooks."""
    return not getattr(args, "use_custom_fsdp", False) and args.use_distributed_optimizer \
        and args.overlap_param_gather


def _set_forward_pre_hook(model, enable, param_sync=True):
    for chunk in model:
        if enable:
            chunk.enable_forward_pre_hook()
        else:
            chunk.disable_forward_pre_hook(param_sync=param_sync)


def enable_forward_pre_hook(model_chunks):
    """Turn DDP's parameter-gather forward pre-hooks on (--overlap-param-gather) on every model chunk."""
    _set_forward_pre_hook(model_chunks, enable=True)


def disable_forward_pre_hook(model_chunks, param_sync=True):
    """Turn the pre-hooks off on every model chunk; `param_sync` first finishes the pending parameter gathers."""
    _set_forward_pre_hook(model_chunks, enable=False, param_sync=param_sync)


def preprocess_common_state_dict(common_state_dict):
    """A copy of a checkpoint's common state for the cross-rank consistency check: args as a dict without the
    entries that differ between ranks (`rank`, `local_rank`)."""
    preprocessed = copy.deepcopy(common_state_dict)
    args = preprocessed["args"]
    preprocessed["args"] = dict(vars(args)) if isinstance(args, argparse.Namespace) else dict(args)
    preprocessed["args"].pop("local_rank", None)
    preprocessed["args"].pop("rank", None)
    return preprocessed


def get_start_time_from_progress_log():
    """(start datetime, FLOPs done then) of the earliest "Starting job" line in <save>/progress.txt of the
    latest run of jobs with this world size; the FLOPs come from the last "Saved checkpoint" line before it."""
    args = get_args()
    if args.save is None:
        raise ValueError("get_start_time_from_progress_log reads <save>/progress.txt: --save is not set.")
    start_time = start_flops = None
    latest_flops = 0.0
    with open(os.path.join(args.save, "progress.txt")) as f:
        for line in f:
            tokens = line.strip().split("\t")
            if tokens[3] == "Saved checkpoint":
                latest_flops = float(tokens[7].split(": ")[1])
            if int(tokens[2].split(": ")[1]) != args.world_size:
                start_time = start_flops = None  # another world size: the search starts again
                continue
            if tokens[3] == "Starting job" and start_time is None:
                start_time, start_flops = tokens[0], latest_flops
    if start_time is None:
        raise RuntimeError(f"{os.path.join(args.save, 'progress.txt')} has no 'Starting job' line of a job with "
                           f"world size {args.world_size} (written with --log-progress)")
    return datetime.strptime(start_time, "%Y-%m-%d %H:%M:%S"), start_flops


def compute_throughputs_and_append_to_progress_log(iteration, num_floating_point_operations_so_far):
    """Append `Saved checkpoint` with job and cumulative throughput to <save>/progress.txt."""
    args = get_args()
    if args.save is None:
        return
    start_time, start_flops = global_vars.get_train_start()
    elapsed = max(time.time() - start_time, 1e-9)
    job_flops = num_floating_point_operations_so_far - start_flops
    job_throughput = job_flops / (elapsed * 10 ** 12 * args.world_size)
    first_start, first_flops = get_start_time_from_progress_log()
    cumulative_elapsed = max((datetime.now() - first_start).total_seconds(), 1e-9)
    cumulative = (num_floating_point_operations_so_far - first_flops) / (cumulative_elapsed * 10 ** 12 * args.world_size)
    tokens = args.consumed_train_samples * args.seq_length / 1e9
    append_to_progress_log(
        f"Saved checkpoint\tIteration: {iteration}\tJob throughput: {job_throughput:.1f} TFLOP/s/GPU\t"
        f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\t"
        f"Floating-point operations: {num_floating_point_operations_so_far:.2e}\tTokens (in billions): {tokens:.2f}"
    )


def save_checkpoint_and_time(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                             checkpointing_context, non_persistent_ckpt=False, train_data_iterator=None):
    """Save with the interval timer paused, so that elapsed time per iteration excludes checkpointing."""
    args = get_args()
    timers = get_timers()
    timers("interval-time").stop()
    timer_key = "save-checkpoint-non-persistent" if non_persistent_ckpt else "save-checkpoint"
    get_deferred_checks().flush()
    timers(timer_key, log_level=0).start(barrier=True)
    if should_disable_forward_pre_hook(args):
        for chunk in model:
            chunk.start_param_sync(force_sync=True)
    save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                    checkpointing_context, non_persistent_ckpt=non_persistent_ckpt,
                    train_data_iterator=train_data_iterator)
    timers(timer_key).stop(barrier=True)
    timers.log([timer_key])
    if args.log_progress and not non_persistent_ckpt:
        compute_throughputs_and_append_to_progress_log(iteration, num_floating_point_operations_so_far)
    timers("interval-time", log_level=0).start(barrier=True)


def _max_across_ranks(flag: bool) -> bool:
    value = torch.tensor([int(flag)], dtype=torch.int, device=_collective_device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


def checkpoint_and_decide_exit(model, optimizer, opt_param_scheduler, iteration, num_floating_point_operations_so_far,
                               checkpointing_context, train_data_iterator):
    """Save on --save-interval; save and return True on SIGTERM, --exit-duration-in-mins or --exit-interval."""
    args = get_args()
    save_args = (iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                 checkpointing_context)
    if args.exit_signal_handler and any(get_signal_handler().signals_received()):
        if args.save:
            save_checkpoint_and_time(*save_args, train_data_iterator=train_data_iterator)
        print_datetime("exiting program after receiving SIGTERM.")
        return True
    saved = False
    if args.save and args.save_interval and iteration % args.save_interval == 0:
        save_checkpoint_and_time(*save_args, train_data_iterator=train_data_iterator)
        saved = True
    elif args.save and args.non_persistent_save_interval and iteration % args.non_persistent_save_interval == 0:
        save_checkpoint_and_time(*save_args, non_persistent_ckpt=True, train_data_iterator=train_data_iterator)
    if args.exit_duration_in_mins:
        train_time = (time.time() - global_vars.get_train_start()[0]) / 60.0
        if _max_across_ranks(train_time > args.exit_duration_in_mins):
            if args.save and not saved:
                save_checkpoint_and_time(*save_args, train_data_iterator=train_data_iterator)
            print_datetime(f"exiting program after {train_time} minutes")
            return True
    if args.exit_interval and iteration % args.exit_interval == 0:
        if args.save and not saved:
            save_checkpoint_and_time(*save_args, train_data_iterator=train_data_iterator)
        torch.distributed.barrier()
        print_datetime(f"exiting program at iteration {iteration}")
        return True
    return False


def _configure_grad_sync(config, model, optimizer, args):
    config.grad_scale_func = optimizer.scale_loss
    config.timers = get_timers()
    if isinstance(model[0], DistributedDataParallel) and args.overlap_grad_reduce:
        if config.no_sync_func is not None:
            raise ValueError("config.no_sync_func is already set; --overlap-grad-reduce installs its own.")
        no_sync = [chunk.no_sync for chunk in model]
        config.no_sync_func = no_sync[0] if len(model) == 1 else no_sync
        if args.align_grad_reduce:
            grad_sync = [chunk.start_grad_sync for chunk in model]
            config.grad_sync_func = grad_sync[0] if len(model) == 1 else grad_sync
    if args.overlap_param_gather and args.align_param_gather:
        param_sync = [chunk.start_param_sync for chunk in model]
        config.param_sync_func = param_sync[0] if len(model) == 1 else param_sync
    config.finalize_model_grads_func = finalize_model_grads


def _read_learning_rates(optimizer):
    learning_rate, decoupled_learning_rate = None, None
    for group in optimizer.param_groups:
        if group.get("is_decoupled_lr", False):
            decoupled_learning_rate = group["lr"]
        else:
            learning_rate = group["lr"]
    return learning_rate, decoupled_learning_rate


def _loss_scale(optimizer):
    if getattr(optimizer, "is_stub_optimizer", False):
        return 1.0
    return optimizer.get_loss_scale()


def _advance_counters(args, batch_size):
    """consumed/skipped sample bookkeeping after a step; returns this batch's FLOPs."""
    args.consumed_train_samples += batch_size
    skipped_in_batch = get_current_global_batch_size() - get_current_running_global_batch_size()
    if skipped_in_batch < 0 or (skipped_in_batch > 0 and not args.decrease_batch_size_if_needed):
        raise RuntimeError(f"running global batch size exceeds the configured one by {-skipped_in_batch} samples.")
    args.skipped_train_samples += skipped_in_batch
    return num_floating_point_operations(args, batch_size)


class _TrainLoopState:
    """Mutable state of `train` shared by its helpers."""

    def __init__(self, args):
        self.iteration = args.iteration
        self.start_iteration = args.iteration
        self.flops_so_far = args.num_floating_point_operations_so_far
        self.total_loss_dict = {}
        self.report_memory_flag = True
        self.pre_hook_enabled = False
        self.param_sync_func = None
        self.num_microbatches = get_num_microbatches()


def _maybe_update_microbatches(state, args, model, optimizer, opt_param_scheduler, checkpointing_context,
                               train_data_iterator):
    update_num_microbatches(args.consumed_train_samples, consistency_check=False, verbose=True)
    if get_num_microbatches() != state.num_microbatches and state.iteration != 0:
        if get_num_microbatches() < state.num_microbatches:
            raise RuntimeError("the number of microbatches decreased during batch-size ramp-up.")
        if args.save is not None:
            save_checkpoint_and_time(state.iteration, model, optimizer, opt_param_scheduler, state.flops_so_far,
                                     checkpointing_context, train_data_iterator=train_data_iterator)
    state.num_microbatches = get_num_microbatches()
    update_num_microbatches(args.consumed_train_samples, consistency_check=True, verbose=True)


def _skip_iteration(state, args, train_data_iterator):
    """--iterations-to-skip: consume the batch without training on it."""
    for _ in range(get_num_microbatches()):
        next(train_data_iterator)
    state.iteration += 1
    batch_size = mpu.get_data_parallel_world_size() * args.micro_batch_size * get_num_microbatches()
    args.consumed_train_samples += batch_size
    args.skipped_train_samples += batch_size


def _after_first_step(state, args, model, config, result):
    if state.iteration != state.start_iteration:
        return
    if result.skipped_iter:
        state.start_iteration = state.iteration + 1
    elif should_disable_forward_pre_hook(args):
        _set_forward_pre_hook(model, enable=True)
        config.param_sync_func = state.param_sync_func
        state.pre_hook_enabled = True


def _run_periodic_eval(state, args, forward_step_func, valid_data_iterator, model, process_non_loss_data_func,
                       config, non_loss_data_func):
    timers = get_timers()
    timers("interval-time").stop()
    if should_disable_forward_pre_hook(args):
        _set_forward_pre_hook(model, enable=False)
        state.pre_hook_enabled = False
    timers("eval-time", log_level=0).start(barrier=True)
    evaluate_and_print_results(f"iteration {state.iteration}", forward_step_func, valid_data_iterator, model,
                               state.iteration, process_non_loss_data_func, config, verbose=False,
                               write_to_tensorboard=True, non_loss_data_func=non_loss_data_func,
                               train_start_time=global_vars.get_train_start()[0])
    timers("eval-time").stop()
    if should_disable_forward_pre_hook(args):
        _set_forward_pre_hook(model, enable=True)
        state.pre_hook_enabled = True
    timers("interval-time", log_level=0).start(barrier=True)


def _log_iteration(state, args, model, optimizer, result):
    params_norm = calc_params_l2_norm(model) if args.log_params_norm else None
    learning_rate, decoupled_learning_rate = _read_learning_rates(optimizer)
    state.report_memory_flag = training_log(
        result.loss_dict, state.total_loss_dict, learning_rate, decoupled_learning_rate, state.iteration,
        _loss_scale(optimizer), state.report_memory_flag, result.skipped_iter, result.grad_norm, params_norm,
        result.num_zeros_in_grad)


def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator, valid_data_iterator,
          process_non_loss_data_func, config, checkpointing_context, non_loss_data_func=None):
    """Run iterations until --train-iters (or an exit condition); returns (iteration, flops_so_far)."""
    args = get_args()
    timers = get_timers()
    write_args_to_tensorboard(args)
    for chunk in model:
        chunk.train()
    state = _TrainLoopState(args)
    get_rerun_state_machine().current_iteration = state.iteration
    if args.result_rejected_tracker_filename is not None:
        args.iterations_to_skip = list(args.iterations_to_skip or []) + \
            RerunStateMachine.get_skipped_iterations_from_tracker_file(args.result_rejected_tracker_filename)
    _configure_grad_sync(config, model, optimizer, args)
    deferred_checks = get_deferred_checks()
    deferred_checks.enabled = _device().type == "cuda"
    timers("interval-time", log_level=0).start(barrier=True)
    print_datetime("before the start of training step")
    forward_backward_func = get_forward_backward_func()
    if should_disable_forward_pre_hook(args):
        _set_forward_pre_hook(model, enable=False, param_sync=False)
        state.param_sync_func, config.param_sync_func = config.param_sync_func, None
    should_exit, exit_code = False, 0
    hooks = TrainingHooks(args, torch.distributed.get_rank())
    monitors = TrainingMonitors(args, model)
    while state.iteration < args.train_iters:
        hooks.before_step(state.iteration)
        maybe_finalize_async_save(blocking=False)
        _maybe_update_microbatches(state, args, model, optimizer, opt_param_scheduler, checkpointing_context,
                                   train_data_iterator)
        if state.iteration in (args.iterations_to_skip or []):
            _skip_iteration(state, args, train_data_iterator)
            continue
        args.curr_iteration = state.iteration
        result = train_step(forward_step_func, train_data_iterator, model, optimizer, opt_param_scheduler, config,
                            forward_backward_func)
        if result.should_checkpoint:
            save_checkpoint_and_time(state.iteration, model, optimizer, opt_param_scheduler, state.flops_so_far,
                                     checkpointing_context, train_data_iterator=train_data_iterator)
        if result.should_exit:
            should_exit, exit_code = True, result.exit_code
            break
        _after_first_step(state, args, model, config, result)
        state.iteration += 1
        batch_size = mpu.get_data_parallel_world_size() * args.micro_batch_size * get_num_microbatches()
        flops = _advance_counters(args, batch_size)
        state.flops_so_far += flops
        _log_iteration(state, args, model, optimizer, result)
        monitors.after_iteration(state.iteration, flops)
        if args.eval_interval and state.iteration % args.eval_interval == 0 and args.do_valid:
            hooks.around_eval()
            monitors.pause()
            _run_periodic_eval(state, args, forward_step_func, valid_data_iterator, model,
                               process_non_loss_data_func, config, non_loss_data_func)
            monitors.resume()
            hooks.around_eval()
        hooks.after_step(state.iteration)
        if checkpoint_and_decide_exit(model, optimizer, opt_param_scheduler, state.iteration, state.flops_so_far,
                                      checkpointing_context, train_data_iterator):
            should_exit = True
            break
    hooks.close()
    monitors.finish()
    deferred_checks.flush()
    deferred_checks.enabled = False
    maybe_finalize_async_save(blocking=True)
    writer = get_tensorboard_writer()
    if writer:
        writer.flush()
    if state.pre_hook_enabled:
        _set_forward_pre_hook(model, enable=False)
    if should_exit:
        wandb_writer = get_wandb_writer()
        if wandb_writer:
            wandb_writer.finish()
        sys.exit(exit_code)
    return state.iteration, state.flops_so_far


def _synchronize_start_time(start_time):
    value = torch.tensor([start_time], dtype=torch.double, device=_collective_device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN)
    return value.item()


def _build_iterators(provider, model, args):
    if args.virtual_pipeline_model_parallel_size is None:
        return build_train_valid_test_data_iterators(provider)
    iterators = [build_train_valid_test_data_iterators(provider) for _ in range(len(model))]
    return tuple([its[i] for its in iterators] for i in range(3))


def _final_evaluations(args, iteration, forward_step_func, valid_it, test_it, model, process_non_loss_data_func,
                       config, non_loss_data_func):
    start_time = global_vars.get_train_start()[0]
    if args.do_valid:
        evaluate_and_print_results(f"iteration {iteration} on validation set", forward_step_func, valid_it, model,
                                   iteration, process_non_loss_data_func, config, verbose=True,
                                   write_to_tensorboard=not args.skip_train, non_loss_data_func=non_loss_data_func,
                                   train_start_time=start_time)
    if args.do_test:
        evaluate_and_print_results(f"iteration {iteration} on test set", forward_step_func, test_it, model,
                                   iteration, process_non_loss_data_func, config, verbose=True,
                                   write_to_tensorboard=not args.skip_train, non_loss_data_func=non_loss_data_func,
                                   train_start_time=start_time)


def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
             process_non_loss_data_func=None, extra_args_provider=None, args_defaults={}, get_embedding_ranks=None,
             get_position_embedding_ranks=None, non_loss_data_func=None, store=None, inprocess_call_wrapper=None):
    """Megatron's main entry: initialize, build model/optimizer/data, train, evaluate."""
    start_time = time.time()
    if inprocess_call_wrapper is not None:
        store = torch.distributed.PrefixStore(str(inprocess_call_wrapper.iteration), store)
    initialize_megatron(extra_args_provider=extra_args_provider, args_defaults=args_defaults,
                        get_embedding_ranks=get_embedding_ranks,
                        get_position_embedding_ranks=get_position_embedding_ranks, store=store)
    args = get_args()
    timers = get_timers()
    if args.enable_cuda_graph and torch.cuda.is_available():
        # Per-layer CUDA graphs are captured on the current stream, which cannot be the legacy default
        # stream; running everything on one stream also keeps autograd's per-node streams consistent.
        torch.cuda.set_stream(torch.cuda.Stream())
    if args.log_progress:
        append_to_progress_log("Starting job")
    set_jit_fusion_options()
    start_time = _synchronize_start_time(start_time)
    global_vars.set_train_start(start_time)
    print_rank_0("time to initialize megatron (seconds): {:.3f}".format(time.time() - start_time))
    print_datetime("after megatron is initialized")
    checkpointing_context = {}
    timers("model-and-optimizer-setup", log_level=0).start(barrier=True)
    model, optimizer, opt_param_scheduler = setup_model_and_optimizer(
        model_provider, model_type, checkpointing_context=checkpointing_context)
    timers("model-and-optimizer-setup").stop()
    maybe_convert_checkpoint_and_exit(model, optimizer, opt_param_scheduler)
    global_vars.set_train_start(start_time, args.num_floating_point_operations_so_far)
    print_datetime("after model, optimizer, and learning rate scheduler are built")
    config = get_model_config(model[0])
    timers("train/valid/test-data-iterators-setup", log_level=0).start(barrier=True)
    with torch.random.fork_rng(devices=[]):
        # DataLoader iterators draw a seed from the CPU generator; keep that draw out of the training RNG
        # stream so that a resumed run continues with exactly the checkpointed RNG state.
        train_it, valid_it, test_it = _build_iterators(train_valid_test_dataset_provider, model, args)
    timers("train/valid/test-data-iterators-setup").stop()
    print_datetime("after dataloaders are built")
    print_rank_0("done with setup ...")
    timers.log(["model-and-optimizer-setup", "train/valid/test-data-iterators-setup"], barrier=True)
    if not args.skip_train:
        print_rank_0("training ...")
        iteration, flops = 0, args.num_floating_point_operations_so_far
        if args.do_train and args.train_iters > 0:
            iteration, flops = train(forward_step_func, model, optimizer, opt_param_scheduler, train_it, valid_it,
                                     process_non_loss_data_func, config, checkpointing_context, non_loss_data_func)
        print_datetime("after training is done")
        if args.save and iteration != 0 and iteration % args.save_interval != 0:
            save_checkpoint(iteration, model, optimizer, opt_param_scheduler, flops, checkpointing_context,
                            train_data_iterator=train_it)
            maybe_finalize_async_save(blocking=True, terminate=True)
    else:
        print_rank_0("skipping training (--skip-train is on) ...")
        iteration = args.iteration
    _final_evaluations(args, iteration, forward_step_func, valid_it, test_it, model, process_non_loss_data_func,
                       config, non_loss_data_func)
    wandb_writer = get_wandb_writer()
    if wandb_writer:
        wandb_writer.finish()
