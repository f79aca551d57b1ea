"""Validation and test evaluation: forward-only passes, token-weighted loss, the validation block.

The valid iterator is never restarted: each evaluation continues where the previous one stopped, and
`args.consumed_valid_samples` (saved in checkpoints) says where that is after a resume.
"""
import math
import time

import torch

from megatron.core import parallel_state as mpu
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine
from megatron.training.global_vars import get_args, get_tensorboard_writer, get_timers, get_wandb_writer
from megatron.training.utils import is_last_rank, print_rank_0, print_rank_last


def _accumulate_eval_losses(loss_dicts, total_loss_dict, device):
    for key in loss_dicts[0].keys():
        if key not in total_loss_dict:
            total_loss_dict[key] = torch.zeros(2, dtype=torch.float, device=device)
        values = [x[key].view(-1) for x in loss_dicts]  # [2] or [1] each
        if values[0].numel() == 2 and getattr(get_args(), "sft", False):
            # Megatron's SFT reporting: the mean of per-microbatch means (over microbatches and DP x CP).
            pairs = torch.vstack(values).float()  # microbatches x [2] -> [m, 2]
            per_microbatch = pairs[:, 0] / pairs[:, 1]
            summed = torch.stack([per_microbatch.sum(), torch.tensor(float(len(values)), device=pairs.device)])
            torch.distributed.all_reduce(summed, group=mpu.get_data_parallel_group(with_context_parallel=True))
            total_loss_dict[key] += summed
        elif values[0].numel() == 2:
            summed = torch.vstack(values).sum(dim=0).float()  # microbatches x [2] -> [2]
            torch.distributed.all_reduce(summed, group=mpu.get_data_parallel_group(with_context_parallel=True))
            total_loss_dict[key] += summed
        elif values[0].numel() == 1:
            total_loss_dict[key][0] += torch.cat(values).sum().float()
            total_loss_dict[key][1] += len(loss_dicts)
        else:
            raise ValueError(f"loss value for {key!r} has shape {tuple(values[0].shape)}: expected [sum, count] "
                             f"or a single value.")


def _time_limit_reached(args, train_start_time):
    if not args.exit_duration_in_mins or train_start_time is None:
        return False
    minutes = (time.time() - train_start_time) / 60.0
    device = torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend() == "nccl" \
        else torch.device("cpu")
    done = torch.tensor([int(minutes > args.exit_duration_in_mins)], dtype=torch.int, device=device)
    torch.distributed.all_reduce(done, op=torch.distributed.ReduceOp.MAX)
    return bool(done.item())


def evaluate(forward_step_func, data_iterator, model, process_non_loss_data_func, config, verbose=False,
             non_loss_data_func=None, eval_iters=None, train_start_time=None):
    """Average each loss key over `eval_iters` global batches; returns (loss_dict, non_loss_data, timelimit)."""
    args = get_args()
    timers = get_timers()
    timers("evaluate", log_level=0).start(barrier=True)
    for chunk in model:
        chunk.eval()
    rerun_state_machine = get_rerun_state_machine()
    rerun_mode = rerun_state_machine.get_mode()
    rerun_state_machine.set_mode(RerunMode.DISABLED)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    total_loss_dict = {}
    eval_batch_size = args.global_batch_size
    eval_num_microbatches = eval_batch_size // (args.micro_batch_size * args.data_parallel_size)
    forward_backward_func = get_forward_backward_func()
    eval_iters = args.eval_iters if eval_iters is None else eval_iters
    collected_non_loss_data = None
    with torch.no_grad():
        if verbose:
            print_rank_0(f"Evaluating on {eval_iters * eval_batch_size} samples")
        for iteration in range(1, eval_iters + 1):
            if verbose:
                print_rank_0(f"Evaluating iter {iteration}/{eval_iters}")
            config.timers = None
            loss_dicts = forward_backward_func(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=eval_num_microbatches, seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, decoder_seq_length=args.decoder_seq_length,
                forward_only=True,
            )
            config.timers = timers
            if args.empty_unused_memory_level >= 1 and torch.cuda.is_available():
                torch.cuda.empty_cache()
            if mpu.is_pipeline_last_stage(ignore_virtual=True) and loss_dicts:
                _accumulate_eval_losses(loss_dicts, total_loss_dict, device)
            args.consumed_valid_samples += eval_batch_size
            if _time_limit_reached(args, train_start_time):
                rerun_state_machine.set_mode(rerun_mode)
                print_rank_0("Exiting during evaluation, timelimit reached")
                return None, None, True
        if non_loss_data_func is not None:
            collected_non_loss_data = non_loss_data_func(model)
        elif process_non_loss_data_func is not None and is_last_rank():
            collected_non_loss_data = forward_backward_func(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=get_num_eval_microbatches(args), seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, decoder_seq_length=args.decoder_seq_length,
                forward_only=True, collect_non_loss_data=True,
            )
    for chunk in model:
        chunk.train()
    for key in total_loss_dict:
        numerator, denominator = total_loss_dict[key]
        total_loss_dict[key] = numerator / denominator
    timers("evaluate").stop()
    timers.log(["evaluate"])
    rerun_state_machine.set_mode(rerun_mode)
    return total_loss_dict, collected_non_loss_data, False


def get_num_eval_microbatches(args):
    """Microbatches per evaluation step: one global batch."""
    return args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)


def evaluate_and_print_results(prefix, forward_step_func, data_iterator, model, iteration,
                               process_non_loss_data_func, config, verbose=False, write_to_tensorboard=True,
                               non_loss_data_func=None, train_start_time=None):
    """Evaluate and print ` validation loss at {prefix} | lm loss value: X | lm loss PPL: Y | ` between dashes."""
    args = get_args()
    writer = get_tensorboard_writer() if write_to_tensorboard else None
    wandb_writer = get_wandb_writer()
    total_loss_dict, collected_non_loss_data, timelimit = evaluate(
        forward_step_func, data_iterator, model, process_non_loss_data_func, config, verbose, non_loss_data_func,
        train_start_time=train_start_time,
    )
    if timelimit:
        return
    string = f" validation loss at {prefix} | "
    for key, value in total_loss_dict.items():
        loss = value.item()
        ppl = math.exp(min(20, loss))
        string += "{} value: {:.6E} | ".format(key, loss)
        string += "{} PPL: {:.6E} | ".format(key, ppl)
        if writer:
            writer.add_scalar(f"{key} validation", loss, iteration)
            writer.add_scalar(f"{key} validation vs samples", loss, args.consumed_train_samples)
            if args.log_validation_ppl_to_tensorboard:
                writer.add_scalar(f"{key} validation ppl", ppl, iteration)
                writer.add_scalar(f"{key} validation ppl vs samples", ppl, args.consumed_train_samples)
        if wandb_writer and is_last_rank():
            wandb_writer.log({f"{key} validation": loss}, iteration)
    if process_non_loss_data_func is not None and writer and is_last_rank():
        process_non_loss_data_func(collected_non_loss_data, iteration, writer)
    length = len(string) + 1
    print_rank_last("-" * length)
    print_rank_last(string)
    print_rank_last("-" * length)
