"""One training iteration: zero grads, forward/backward over the microbatches, optimizer step, LR step.

Loss reporting follows Megatron exactly: each microbatch's loss dict carries `[loss_sum, num_tokens]`;
the per-iteration value is Σloss / Σtokens over the whole global batch (summed over microbatches, then
all-reduced over DP×CP). Values stay on the device; the training log reads them at log intervals only.

Host synchronisation note: nothing here reads a device value back to the host except the deferred
NaN/Inf checks of two iterations back (`megatron.core.deferred_checks`, one read of finished work). The grad norm and the
zero count come back from `optimizer.step()` as 0-dim device tensors and are MAX-reduced over the
model-parallel group on the device (`stat_to_host` turns them into numbers at log time). The
"did every model-parallel rank update" AND needs the host (it decides the LR-scheduler step), so it
runs only when the optimizer has a grad scaler; without one every rank always updates.
"""
from dataclasses import dataclass, field
from typing import Dict, Optional, Union

import torch

from megatron.core import parallel_state as mpu
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.deferred_checks import get_deferred_checks
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.training.global_vars import get_args, get_timers


@dataclass
class TrainStepResult:
    """What one `train_step` produced (Megatron returns the same values as a 7-tuple)."""

    loss_dict: Dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-key global-batch loss (a 0-d device tensor); empty off the last pipeline stage."""
    skipped_iter: int = 0
    """1 when the optimizer skipped the update (inf/NaN grads under fp16 loss scaling), else 0."""
    should_checkpoint: bool = False
    """The rerun state machine asks for a checkpoint."""
    should_exit: bool = False
    """The rerun state machine asks the run to stop."""
    exit_code: int = 0
    """Exit code to use when `should_exit`."""
    grad_norm: Optional[Union[float, torch.Tensor]] = None
    """Pre-clip global gradient L2 norm (MAX over the model-parallel group), usually a 0-dim device tensor
    (read it with `stat_to_host`); None on skipped steps."""
    num_zeros_in_grad: Optional[Union[int, torch.Tensor]] = None
    """Number of zero gradient entries (only with --log-num-zeros-in-grad), read with `stat_to_host`."""

    def __iter__(self):
        """Unpack like Megatron's tuple: (loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code,
        grad_norm, num_zeros_in_grad)."""
        return iter((self.loss_dict, self.skipped_iter, self.should_checkpoint, self.should_exit, self.exit_code,
                     self.grad_norm, self.num_zeros_in_grad))


def _collective_device():
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_ABSENT_STAT = -1.0


def reduce_max_stat_across_model_parallel_group(stat):
    """MAX of a scalar over the model-parallel group; None on every rank if it is None on all of them.

    A Python number is reduced through the host (Megatron's behaviour, one sync). A tensor stays on
    the device: the result is a 0-dim fp32 tensor in which -1.0 stands for "None on every rank";
    `stat_to_host` decodes it when the value is logged.
    """
    if mpu.get_model_parallel_world_size() == 1:
        return stat
    if isinstance(stat, torch.Tensor):
        value = stat.detach().to(device=_collective_device(), dtype=torch.float32, copy=True).reshape(1)  # [] -> [1]
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=mpu.get_model_parallel_group())
        return value[0]
    value = torch.tensor([_ABSENT_STAT if stat is None else float(stat)], dtype=torch.float32,
                         device=_collective_device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=mpu.get_model_parallel_group())
    result = value.item()
    return None if result == _ABSENT_STAT else result


def stat_to_host(stat) -> Optional[float]:
    """A step statistic as a Python number (one host sync for a device tensor); None when absent."""
    if stat is None:
        return None
    if isinstance(stat, torch.Tensor):
        stat = stat.item()
    return None if stat == _ABSENT_STAT else stat


def optimizer_can_skip_step(optimizer) -> bool:
    """True when `optimizer.step()` may report an unsuccessful update: only a grad scaler's inf/nan check
    skips steps. Every rank builds its optimizer from the same config, so the answer is rank-consistent."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return any(optimizer_can_skip_step(opt) for opt in chained)
    return getattr(optimizer, "grad_scaler", None) is not None


def logical_and_across_model_parallel_group(value: bool) -> bool:
    """AND of a bool over the model-parallel group."""
    if mpu.get_model_parallel_world_size() == 1:
        return bool(value)
    flag = torch.tensor([1 if value else 0], dtype=torch.int32, device=_collective_device())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=mpu.get_model_parallel_group())
    return bool(flag.item())


def reduce_losses(losses_reduced, args) -> Dict[str, torch.Tensor]:
    """Turn the per-microbatch loss dicts into one value per key (see the module docstring)."""
    loss_dict = {}
    if not losses_reduced:
        return loss_dict
    for key in losses_reduced[0].keys():
        values = [x[key].view(-1) for x in losses_reduced]  # [2] or [1] each
        if values[0].numel() == 2:
            if getattr(args, "sft", False):
                ratios = torch.vstack(values)  # microbatches x [2] -> [m, 2]
                per_mb = ratios[:, 0] / ratios[:, 1]
                total = per_mb.mean()
                torch.distributed.all_reduce(total, group=mpu.get_data_parallel_group(with_context_parallel=True))
                loss_dict[key] = total / mpu.get_data_parallel_world_size(with_context_parallel=True)
            else:
                summed = torch.vstack(values).sum(dim=0)  # microbatches x [2] -> [2]
                torch.distributed.all_reduce(summed, group=mpu.get_data_parallel_group(with_context_parallel=True))
                loss_dict[key] = summed[0] / summed[1]
        elif values[0].numel() == 1:
            loss_dict[key] = torch.cat(values).mean()
        else:
            raise ValueError(f"loss value for {key!r} has shape {tuple(values[0].shape)}: loss_func must report "
                             f"a [loss_sum, num_tokens] pair or a single value.")
    return loss_dict


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
               forward_backward_func) -> TrainStepResult:
    """Run one iteration and return a `TrainStepResult` (unpacks like Megatron's tuple)."""
    args = get_args()
    timers = get_timers()
    rerun_state_machine = get_rerun_state_machine()
    get_deferred_checks().step()  # NaN/Inf checks of two iterations back: no wait for the GPU
    losses_reduced = []
    while rerun_state_machine.should_run_forward_backward(data_iterator):
        for model_chunk in model:
            model_chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses_reduced = forward_backward_func(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            model=model,
            num_microbatches=get_num_microbatches(),
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            decoder_seq_length=args.decoder_seq_length,
            forward_only=False,
        )
    should_checkpoint, should_exit, exit_code = rerun_state_machine.should_checkpoint_and_exit()
    if should_exit:
        return TrainStepResult(should_checkpoint=should_checkpoint, should_exit=True, exit_code=exit_code)
    if args.empty_unused_memory_level >= 1 and torch.cuda.is_available():
        torch.cuda.empty_cache()
    timers("optimizer", log_level=1).start(barrier=args.barrier_with_L1_time)
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    timers("optimizer").stop()
    if optimizer_can_skip_step(optimizer):
        update_successful = logical_and_across_model_parallel_group(update_successful)
    grad_norm = reduce_max_stat_across_model_parallel_group(grad_norm)
    if args.log_num_zeros_in_grad:
        num_zeros_in_grad = reduce_max_stat_across_model_parallel_group(num_zeros_in_grad)
    if update_successful:
        increment = get_num_microbatches() * args.micro_batch_size * args.data_parallel_size
        opt_param_scheduler.step(increment=increment)
        skipped_iter = 0
    else:
        skipped_iter = 1
    if args.empty_unused_memory_level >= 2 and torch.cuda.is_available():
        torch.cuda.empty_cache()
    loss_dict = {}
    if mpu.is_pipeline_last_stage(ignore_virtual=True):
        loss_dict = reduce_losses(losses_reduced, args)
    return TrainStepResult(loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm,
                           num_zeros_in_grad)
