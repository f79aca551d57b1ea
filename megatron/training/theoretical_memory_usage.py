"""Theoretical memory footprint of a run (weights + optimizer, and activations), printed after the first log.

Weights and optimizer: 18 bytes per parameter (fp16/bf16 param + fp32 grad + fp32 main param + two Adam
moments), or 6 + 12/DP with the distributed optimizer, on the most loaded (first) model shard. Activations
use Table 2 of Korthikanti et al. 2022 (arXiv:2205.05198), which assumes sequence parallelism and
selective recomputation; without both only the weight/optimizer number is reported (as in Megatron).
"""
import math

from megatron.training.utils import print_line

NUM_BYTES_IN_MEGABYTE = 1024 * 1024


def _transformer_parameter_count(args):
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    num_experts = 1 if args.num_experts is None else args.num_experts
    gated = 3 / 2 if args.swiglu else 1
    projection_ratio = args.kv_channels * args.num_attention_heads / args.hidden_size
    h = args.hidden_size
    return 2 * args.num_layers * h * h * (
        (1 + args.num_query_groups / args.num_attention_heads) * projection_ratio  # attention
        + (args.ffn_hidden_size / h) * num_experts * gated  # MLP
        + 2 / h  # two layernorms per layer
        + 1 / (args.num_layers * h)  # final layernorm
    )


def compute_weight_and_optimizer_memory(args, verbose=False):
    """Bytes of weights, grads and optimizer state on the most loaded model shard."""
    transformer = _transformer_parameter_count(args)
    embedding = args.hidden_size * args.padded_vocab_size
    embeddings = 2 * embedding if args.untie_embeddings_and_output_weights else embedding
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    most_loaded = (transformer / pp + embedding) / tp
    if args.untie_embeddings_and_output_weights and pp == 1:
        most_loaded += embedding / tp
    if verbose:
        print_line(f"Number of parameters in transformer layers in billions: {transformer / 10**9: .2f}")
        print_line(f"Number of parameters in embedding layers in billions: {embeddings / 10**9:.2f}")
        print_line(f"Total number of parameters in billions: {(transformer + embeddings) / 10**9:.2f}")
        print_line(f"Number of parameters in most loaded shard in billions: {most_loaded / 10**9:.4f}")
        if pp > 1:
            print_line(f"Number of parameters in other shards in billions: {transformer / (pp * tp) / 10**9:.4f}")
    bytes_per_param = 18 if not args.use_distributed_optimizer else 6 + 12 / args.data_parallel_size
    return most_loaded * bytes_per_param


def compute_activation_memory(args, num_microbatches, verbose=False):
    """Peak activation bytes on the first pipeline stage (SP + selective recompute assumed)."""
    s, b, h = args.seq_length, args.micro_batch_size, args.hidden_size
    tp, pp, vpp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, \
        args.virtual_pipeline_model_parallel_size
    per_layer = s * b * h * (18 + 4 * (args.ffn_hidden_size / h))
    if verbose:
        per_layer_mb = per_layer / NUM_BYTES_IN_MEGABYTE / tp
        print_line(f"Activation memory footprint per transformer layer: {per_layer_mb:.1f} MB")
    memory = per_layer * args.num_layers
    memory += 8 * s * b * pp  # embedding inputs, pp microbatches in flight
    memory += s * b * h * pp  # embedding dropout
    if vpp is not None:
        penalty = 1 + (pp - 1) / (pp * vpp)
        memory *= penalty
        if verbose:
            print_line(f"Memory penalty from interleaved schedule: {penalty:.2f}")
            print_line(f"Number of in-flight microbatches: {math.ceil(penalty * pp)}")
    elif pp > 1:
        if num_microbatches is not None:
            memory *= min(1, num_microbatches / pp)
            in_flight = min(num_microbatches, pp)
        else:
            in_flight = pp
        if verbose:
            print_line(f"Number of in-flight microbatches: {in_flight}")
    if pp == 1:
        memory += s * b * h * 4 * (1 + args.padded_vocab_size / h)  # output layer input and CE loss
    return memory / tp


def report_theoretical_memory(args, num_microbatches=None, verbose=False):
    """Print `Theoretical memory footprints: weight and optimizer=... MB[, activation=..., total=...]`."""
    weights = compute_weight_and_optimizer_memory(args, verbose=verbose) / NUM_BYTES_IN_MEGABYTE
    if not args.sequence_parallel or args.recompute_granularity != "selective":
        print_line(f"Theoretical memory footprints: weight and optimizer={weights:.2f} MB")
        return
    activations = compute_activation_memory(args, num_microbatches=num_microbatches, verbose=verbose)
    activations /= NUM_BYTES_IN_MEGABYTE
    print_line(f"Theoretical memory footprints: weight and optimizer={weights:.2f} MB, "
               f"activation={activations:.2f} MB, total={weights + activations:.2f} MB\n")
