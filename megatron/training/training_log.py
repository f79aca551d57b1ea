"""The training log line, TensorBoard/wandb scalars, and Megatron's FLOPs formula.

The log line is printed on the last rank every --log-interval iterations in Megatron's exact format:
` [YYYY-mm-dd HH:MM:SS] iteration {it:8d}/{train_iters:8d} | consumed samples: {n:12d} | ...`.
Losses are accumulated on the device and read (one host sync) only when the line is printed; the
grad norm and zero count arrive as device tensors and are read only when a log line or a TensorBoard
scalar needs them, and the learning rate is MAX-reduced over the model-parallel group only then.
"""
from datetime import datetime

import torch

from megatron.core import parallel_state as mpu
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from megatron.core.transformer.moe.moe_utils import track_moe_metrics
from megatron.training.global_vars import (
    get_args, get_energy_monitor, get_tensorboard_writer, get_timers, get_wandb_writer)
from megatron.training.theoretical_memory_usage import report_theoretical_memory
from megatron.training.train_step import reduce_max_stat_across_model_parallel_group, stat_to_host
from megatron.training.utils import is_rank0, print_rank_last, report_memory

ADVANCED_ITERS_KEY = "advanced iterations"
SKIPPED_ITERS_KEY = "skipped iterations"
NAN_ITERS_KEY = "nan iterations"
_COUNTER_KEYS = (ADVANCED_ITERS_KEY, SKIPPED_ITERS_KEY, NAN_ITERS_KEY)

TIMERS_TO_LOG = [
    "forward-backward", "forward-compute", "backward-compute", "batch-generator", "forward-recv", "forward-send",
    "backward-recv", "backward-send", "forward-send-forward-recv", "forward-send-backward-recv",
    "backward-send-forward-recv", "backward-send-backward-recv", "forward-backward-send-forward-backward-recv",
    "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "all-grads-sync", "params-all-gather",
    "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad",
    "optimizer-count-zeros", "optimizer-inner-step", "optimizer-copy-main-to-model-params", "optimizer",
]


def _moe_layer_pattern(args):
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(args.num_layers)]
    if isinstance(freq, list):
        if len(freq) != args.num_layers:
            raise ValueError(f"--moe-layer-freq has {len(freq)} entries but --num-layers is {args.num_layers}: "
                             f"give one entry per layer.")
        return freq
    raise ValueError(f"--moe-layer-freq ({freq!r}) must be an int or a list of 0/1 per layer.")


def _mla_attention_term(args, num_layers):
    heads, hidden = args.num_attention_heads, args.hidden_size
    qk, qk_pos, v = args.qk_head_dim, args.qk_pos_emb_head_dim, args.v_head_dim
    if args.q_lora_rank is None:
        q_term = hidden * heads * (qk + qk_pos)
    else:
        q_term = args.q_lora_rank * (hidden + heads * (qk + qk_pos) + 1)
    return 3 * 2 * num_layers * (
        q_term
        + args.kv_lora_rank * (hidden + heads * (qk + v) + 1)
        + hidden * qk_pos
        + heads * v * hidden
        + args.seq_length * heads * (qk + qk_pos) / 2
        + args.seq_length * heads * v / 2
    )


def _transformer_flops(args, batch_size):
    """§9.4 standard transformer: B·s·(mlp + attn + mtp + logit). Sets num_query_groups = heads without GQA."""
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    if args.num_experts is None:
        num_dense, num_moe, topk, last_is_moe = args.num_layers, 0, 0, 0
    else:
        pattern = _moe_layer_pattern(args)
        num_moe = sum(pattern)
        num_dense, topk, last_is_moe = args.num_layers - num_moe, args.moe_router_topk, pattern[-1]
    mtp = args.mtp_num_layers or 0
    num_moe += last_is_moe * mtp
    num_dense += (1 - last_is_moe) * mtp
    num_layers = args.num_layers + mtp
    hidden = args.hidden_size
    ffn_moe = args.moe_ffn_hidden_size if args.moe_ffn_hidden_size is not None else args.ffn_hidden_size
    ffn_shared = args.moe_shared_expert_intermediate_size or 0
    gated = 3 / 2 if args.swiglu else 1
    expansion = 3 * 2 * 2
    if args.multi_latent_attention:
        attn = _mla_attention_term(args, num_layers)
    else:
        ratio = args.kv_channels * args.num_attention_heads / hidden
        attn = expansion * num_layers * hidden * hidden * (
            (1 + args.num_query_groups / args.num_attention_heads + args.seq_length / hidden / 2) * ratio
        )
    mlp = expansion * num_layers * hidden * (
        args.ffn_hidden_size * gated * (num_dense / num_layers)
        + ffn_moe * topk * gated * (num_moe / num_layers)
        + ffn_shared * gated * (num_moe / num_layers)
    )
    mtp_term = 3 * 2 * mtp * (3 * hidden + 2 * hidden * hidden)
    logit = 3 * 2 * hidden * args.padded_vocab_size * (mtp + 1)
    return batch_size * args.seq_length * (mlp + attn + mtp_term + logit)


def _hybrid_layer_counts(args):
    if args.hybrid_override_pattern:
        pattern = args.hybrid_override_pattern
        return pattern.count("*"), pattern.count("M"), pattern.count("-")
    num_attn = round(args.num_layers * args.hybrid_attention_ratio)
    num_mlp = round(args.num_layers * args.hybrid_mlp_ratio)
    return num_attn, args.num_layers - num_attn - num_mlp, num_mlp


def _hybrid_flops(args, batch_size):
    """§9.4 hybrid (Mamba) model: 3 × forward FLOPs."""
    b, s, h = batch_size, args.seq_length, args.hidden_size
    num_attn, num_mamba, num_mlp = _hybrid_layer_counts(args)
    heads = args.num_attention_heads
    p = (args.kv_channels * heads / h) if args.kv_channels else 1
    g = args.num_query_groups if args.group_query_attention else heads
    attn = 4 * b * s * h * p * (h + h * (g / heads) + s / 2)
    gated = 3.0 / 2.0 if args.swiglu else 1.0
    mlp = 4 * (args.ffn_hidden_size / h) * gated * b * s * h ** 2
    d_in = 2 * h
    nheads = args.mamba_num_heads if args.mamba_num_heads else d_in // args.mamba_head_dim
    state, groups = args.mamba_state_dim, args.mamba_num_groups
    mamba = (2 * b * s * h * (2 * d_in + 2 * groups * state + nheads) + 7 * b * s * d_in * state
             + 2 * b * s * d_in * h)
    logits = 2 * b * s * h * args.padded_vocab_size
    return 3 * (num_attn * attn + num_mlp * mlp + num_mamba * mamba + logits)


def num_floating_point_operations(args, batch_size):
    """FLOPs of one full iteration (forward + backward) over `batch_size` sequences (Megatron's formula)."""
    if getattr(args, "is_hybrid_model", False):
        return _hybrid_flops(args, batch_size)
    return _transformer_flops(args, batch_size)


def write_args_to_tensorboard(args):
    """Every arg as TensorBoard text (last rank, once per run)."""
    writer = get_tensorboard_writer()
    if writer:
        for arg in vars(args):
            writer.add_text(arg, str(getattr(args, arg)), global_step=args.iteration)


def _accumulate(loss_dict, total_loss_dict, skipped_iter):
    """Add this iteration's losses on the device; count NaN/Inf losses of skipped iterations."""
    if not skipped_iter:
        total_loss_dict[ADVANCED_ITERS_KEY] = total_loss_dict.get(ADVANCED_ITERS_KEY, 0) + 1
    else:
        total_loss_dict.setdefault(ADVANCED_ITERS_KEY, 0)
    total_loss_dict[SKIPPED_ITERS_KEY] = total_loss_dict.get(SKIPPED_ITERS_KEY, 0) + skipped_iter
    got_nan = False
    for key, value in loss_dict.items():
        if not skipped_iter:
            previous = total_loss_dict.get(key)
            total_loss_dict[key] = value.detach().float() if previous is None else previous + value.detach().float()
        else:
            number = value.float().sum().item()
            got_nan = got_nan or number in (float("inf"), float("-inf")) or number != number
    total_loss_dict[NAN_ITERS_KEY] = total_loss_dict.get(NAN_ITERS_KEY, 0) + int(got_nan)


def _writes_scalars(args):
    """Whether any rank writes TensorBoard/wandb scalars: the same answer on every rank, so the collective
    reading the learning rate runs on all of them or on none."""
    return bool(getattr(args, "tensorboard_dir", None) or getattr(args, "wandb_project", ""))


def _scalar(value):
    return value.item() if isinstance(value, torch.Tensor) else value


def _write_scalars(args, writer, wandb_writer, loss_dict, learning_rate, decoupled_lr, iteration, loss_scale,
                   batch_size, grad_norm, params_norm, num_zeros_in_grad):
    """§9.2 TensorBoard/wandb keys (each with a `vs samples` twin on TensorBoard)."""
    samples = args.consumed_train_samples
    scalars = {"learning-rate": learning_rate, "batch-size": batch_size}
    if args.decoupled_lr is not None and decoupled_lr is not None:
        scalars["decoupled-learning-rate"] = decoupled_lr
    if args.skipped_train_samples > 0:
        scalars["skipped-train-samples"] = args.skipped_train_samples
    for key, value in loss_dict.items():
        scalars[key] = _scalar(value)
    if args.log_loss_scale_to_tensorboard:
        scalars["loss-scale"] = _scalar(loss_scale)
    if args.log_world_size_to_tensorboard:
        scalars["world-size"] = args.world_size
    for name, value in (("grad-norm", grad_norm), ("num-zeros", num_zeros_in_grad), ("params-norm", params_norm)):
        if value is not None:
            scalars[name] = value
    if args.log_memory_to_tensorboard and torch.cuda.is_available():
        stats = torch.cuda.memory_stats()
        scalars["mem-reserved-bytes"] = stats.get("reserved_bytes.all.current", 0)
        scalars["mem-allocated-bytes"] = stats.get("allocated_bytes.all.current", 0)
        scalars["mem-max-allocated-bytes"] = stats.get("allocated_bytes.all.peak", 0)
        scalars["mem-allocated-count"] = stats.get("allocation.all.current", 0)
    if wandb_writer:
        wandb_writer.log({"samples vs steps": samples}, iteration)
    for name, value in scalars.items():
        writer.add_scalar(name, value, iteration)
        if name not in ("world-size", "skipped-train-samples") and not name.startswith("mem-"):
            writer.add_scalar(name + " vs samples", value, samples)
        if wandb_writer:
            wandb_writer.log({name: value}, iteration)


def _format_line(args, total_loss_dict, iteration, elapsed_per_iter, throughput, learning_rate, decoupled_lr,
                 batch_size, loss_scale, grad_norm, num_zeros_in_grad, params_norm, energy=None):
    line = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"
    line += " iteration {:8d}/{:8d} |".format(iteration, args.train_iters)
    line += " consumed samples: {:12d} |".format(args.consumed_train_samples)
    if args.skipped_train_samples > 0:
        line += " skipped samples: {:12d} |".format(args.skipped_train_samples)
    line += " elapsed time per iteration (ms): {:.1f} |".format(elapsed_per_iter * 1000.0)
    if args.log_throughput:
        line += f" throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |"
    if energy is not None:
        line += f" energy per GPU (J/iter/GPU): {energy[0]:.1f} | power per GPU (W/GPU): {energy[1]:.1f} |"
    line += f" learning rate: {learning_rate:.6E} |"
    if args.decoupled_lr is not None and decoupled_lr is not None:
        line += f" decoupled learning rate: {decoupled_lr:.6E} |"
    line += f" global batch size: {batch_size:5d} |"
    advanced = float(max(1, total_loss_dict[ADVANCED_ITERS_KEY]))
    for key in list(total_loss_dict):
        if key in _COUNTER_KEYS:
            continue
        avg = _scalar(total_loss_dict[key]) / advanced
        if avg > 0.0:
            line += " {}: {:.6E} |".format(key, avg)
        del total_loss_dict[key]
    line += f" loss scale: {_scalar(loss_scale):.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    if num_zeros_in_grad is not None:
        line += f" num zeros: {int(num_zeros_in_grad)} |"
    if params_norm is not None:
        line += f" params norm: {params_norm:.3f} |"
    line += " number of skipped iterations: {:3d} |".format(total_loss_dict[SKIPPED_ITERS_KEY])
    line += " number of nan iterations: {:3d} |".format(total_loss_dict[NAN_ITERS_KEY])
    return line


def _energy_per_gpu(args, writer, wandb_writer, iteration, total_iterations, elapsed_per_iter):
    """With --log-energy: (joules per iteration per GPU, watts per GPU) of this log interval (a collective),
    also written as `iter-energy/gpu` and `power/gpu`; else None."""
    if not getattr(args, "log_energy", False):
        return None
    energy = get_energy_monitor().lap() / max(1, total_iterations) / args.world_size
    power = energy / elapsed_per_iter if elapsed_per_iter > 0 else 0.0
    for name, value in (("iter-energy/gpu", energy), ("power/gpu", power)):
        if writer:
            writer.add_scalar(name, value, iteration)
        if wandb_writer:
            wandb_writer.log({name: value}, iteration)
    return energy, power


def moe_track_names(args):
    """Names of the tracked MoE losses as Megatron 0.13.1 picks them (a substring test on the balancing type,
    so 'seq_aux_loss' also tracks 'load_balancing_loss')."""
    names = []
    balancing = args.moe_router_load_balancing_type
    if "aux_loss" in balancing:
        names.append("load_balancing_loss")
    if "seq_aux_loss" in balancing:
        names.append("seq_load_balancing_loss")
    if args.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names


def _track_moe(args, writer, wandb_writer, total_loss_dict, iteration):
    """Every iteration (Megatron 0.13.1): reduce, log and clear the per-layer MoE losses (mean over
    microbatches); with a TensorBoard writer they join the log line and, with --moe-per-layer-logging, each
    layer's value is a `moe/<name>_layer_<i>` scalar."""
    if args.num_experts is None:
        return
    track_moe_metrics(loss_scale=1 / get_num_microbatches(), iteration=iteration, writer=writer,
                      wandb_writer=wandb_writer, total_loss_dict=total_loss_dict,
                      per_layer_logging=args.moe_per_layer_logging, force_initialize=True,
                      track_names=moe_track_names(args), num_layers=args.num_layers,
                      moe_layer_freq=args.moe_layer_freq, mtp_num_layers=getattr(args, "mtp_num_layers", None))


def training_log(loss_dict, total_loss_dict, learning_rate, decoupled_learning_rate, iteration, loss_scale,
                 report_memory_flag, skipped_iter, grad_norm, params_norm, num_zeros_in_grad):
    """Accumulate this iteration and print the log line every --log-interval; returns report_memory_flag."""
    args = get_args()
    timers = get_timers()
    writer = get_tensorboard_writer()
    wandb_writer = get_wandb_writer()
    _accumulate(loss_dict, total_loss_dict, skipped_iter)
    _track_moe(args, writer, wandb_writer, total_loss_dict, iteration)
    if args.mtp_num_layers is not None:  # Megatron's MTP log entries: `mtp_1 loss`, ... (per-iteration sums)
        MTPLossLoggingHelper.track_mtp_metrics(1 / get_num_microbatches(), iteration,
                                               writer if _writes_scalars(args) else None, wandb_writer,
                                               total_loss_dict)
    batch_size = args.micro_batch_size * args.data_parallel_size * get_num_microbatches()
    total_iterations = total_loss_dict[ADVANCED_ITERS_KEY] + total_loss_dict[SKIPPED_ITERS_KEY]
    is_log_iteration = iteration % args.log_interval == 0
    is_scalar_iteration = _writes_scalars(args) and iteration % args.tensorboard_log_interval == 0
    if not (is_log_iteration or is_scalar_iteration):
        return report_memory_flag
    learning_rate = reduce_max_stat_across_model_parallel_group(learning_rate)
    grad_norm, num_zeros_in_grad = stat_to_host(grad_norm), stat_to_host(num_zeros_in_grad)
    if writer and is_scalar_iteration:
        _write_scalars(args, writer, wandb_writer, loss_dict, learning_rate, decoupled_learning_rate, iteration,
                       loss_scale, batch_size, grad_norm, params_norm, num_zeros_in_grad)
    if not is_log_iteration:
        return report_memory_flag
    elapsed_time = timers("interval-time").elapsed(barrier=True)
    elapsed_per_iter = elapsed_time / max(1, total_iterations)
    throughput = num_floating_point_operations(args, batch_size) / (elapsed_per_iter * 10 ** 12 * args.world_size)
    if args.log_timers_to_tensorboard:
        if writer:
            writer.add_scalar("iteration-time", elapsed_per_iter, iteration)
            if args.log_throughput:
                writer.add_scalar("throughput", throughput, iteration)
        if wandb_writer:
            wandb_writer.log({"iteration-time": elapsed_per_iter}, iteration)
    energy = _energy_per_gpu(args, writer, wandb_writer, iteration, total_iterations, elapsed_per_iter)
    if not (mpu.is_pipeline_first_stage(ignore_virtual=True) or mpu.is_pipeline_last_stage(ignore_virtual=True)):
        decoupled_learning_rate = None
    line = _format_line(args, total_loss_dict, iteration, elapsed_per_iter, throughput, learning_rate,
                        decoupled_learning_rate, batch_size, loss_scale, grad_norm, num_zeros_in_grad, params_norm,
                        energy)
    for key in _COUNTER_KEYS:
        total_loss_dict[key] = 0
    print_rank_last(line)
    if report_memory_flag:
        if is_rank0():
            report_theoretical_memory(args, num_microbatches=get_num_microbatches(), verbose=True)
        report_memory(f"(after {iteration} iterations)")
        report_memory_flag = False
    timers.log(TIMERS_TO_LOG, normalizer=args.log_interval)
    return report_memory_flag
