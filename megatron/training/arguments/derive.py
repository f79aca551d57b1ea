"""`derive(args)`: every value Megatron-LM's `validate_args` computes from the flags, in one place.

It runs after validation succeeded, so it may assume the flags are consistent. `padded_vocab_size` is
not derived here: the tokenizer builder sets it once the vocabulary is known.
"""
from typing import Optional

import torch

from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.training.arguments.heterogeneous import derive_heterogeneous_config

DEFAULT_SPLIT = "969, 30, 1"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}


def derived_ffn_hidden_size(args) -> int:
    """Megatron's default MLP width: 4h, or int((4h * 2/3) / 64) * 64 with SwiGLU."""
    if args.swiglu:
        return int((4 * args.hidden_size * 2 / 3) / 64) * 64
    return 4 * args.hidden_size


def virtual_pipeline_size(args) -> Optional[int]:
    """Virtual stages per pipeline rank from the VPP flags or the layout; None without interleaving."""
    pp = args.pipeline_model_parallel_size
    if args.pipeline_model_parallel_layout is not None:
        vpp = PipelineParallelLayerLayout.from_str(
            args.pipeline_model_parallel_layout, pp).virtual_pipeline_model_parallel_size
    elif args.num_layers_per_virtual_pipeline_stage is not None:
        total = args.num_layers + int(args.account_for_embedding_in_pipeline_split) + int(
            args.account_for_loss_in_pipeline_split)
        vpp = (total // pp) // args.num_layers_per_virtual_pipeline_stage
    else:
        vpp = args.num_virtual_stages_per_pipeline_rank
    return vpp if vpp is not None and vpp > 1 else None


def derive(args):
    """Fill derived values on `args` in place (and return it)."""
    _derive_shape(args)
    _derive_parallel(args)
    _derive_batch_and_data(args)
    _derive_precision(args)
    _derive_features(args)
    derive_heterogeneous_config(args)
    _drop_deprecated(args)
    args.consumed_train_samples = 0
    args.skipped_train_samples = 0
    args.consumed_valid_samples = 0
    args.iteration = 0
    return args


# Flags Megatron-LM still parses but removes from args once checked (validation rejects non-default values).
DEPRECATED_DESTS = ("batch_size", "warmup", "model_parallel_size", "checkpoint_activations", "recompute_activations")


def _drop_deprecated(args) -> None:
    """Delete the deprecated flags' attributes, as Megatron's validate_args does (so saved args match)."""
    for name in DEPRECATED_DESTS:
        if hasattr(args, name):
            delattr(args, name)


def _derive_parallel(args) -> None:
    world = getattr(args, "world_size", 1)
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    args.data_parallel_size = world // model_parallel
    # Megatron's names: the pipeline size of the transformer layers (encoder stages were removed), and whether
    # microbatches may differ in sequence length (set by scripts that need it; GPT's do not).
    args.transformer_pipeline_model_parallel_size = args.pipeline_model_parallel_size
    args.variable_seq_lengths = getattr(args, "variable_seq_lengths", False)
    if args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    args.virtual_pipeline_model_parallel_size = virtual_pipeline_size(args)
    if args.virtual_pipeline_model_parallel_size is None:
        args.overlap_p2p_comm = False
        args.align_param_gather = False
    elif args.microbatch_group_size_per_vp_stage is None:
        args.microbatch_group_size_per_vp_stage = args.pipeline_model_parallel_size
    if args.lazy_mpu_init:
        args.use_cpu_initialization = True


def _derive_shape(args) -> None:
    if args.num_layers is not None:
        args.encoder_num_layers = args.num_layers
    else:
        args.num_layers = args.encoder_num_layers
    if args.seq_length is not None:
        args.encoder_seq_length = args.seq_length
    else:
        args.seq_length = args.encoder_seq_length
    if args.ffn_hidden_size is None and args.hidden_size is not None:
        args.ffn_hidden_size = derived_ffn_hidden_size(args)
    if args.kv_channels is None and args.hidden_size is not None and args.num_attention_heads:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.num_experts == 0:
        args.num_experts = None
    if args.num_experts is not None and args.moe_ffn_hidden_size is None:  # as Megatron: only for MoE models
        args.moe_ffn_hidden_size = args.ffn_hidden_size


def _derive_batch_and_data(args) -> None:
    if args.global_batch_size is None and args.micro_batch_size is not None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.dataloader_type is None:
        args.dataloader_type = "single"
    if args.data_path and args.split is None and not args.data_args_path:
        args.split = DEFAULT_SPLIT
        if getattr(args, "rank", 0) == 0:
            print(f"WARNING: --split not given with --data-path; using the default split {DEFAULT_SPLIT!r}.",
                  flush=True)
    args.use_dist_ckpt = args.ckpt_format != "torch"
    if args.weight_decay_incr_style == "constant":
        # A constant weight-decay schedule starts and ends at --weight-decay (as Megatron's validate_args).
        args.start_weight_decay = args.weight_decay
        args.end_weight_decay = args.weight_decay


def _derive_precision(args) -> None:
    args.params_dtype = torch.float32
    if args.fp16:
        args.params_dtype = torch.half
        if args.loss_scale is None:
            args.check_for_nan_in_loss_and_grad = False
    elif args.bf16:
        args.params_dtype = torch.bfloat16
        if not args.grad_reduce_in_bf16:
            args.accumulate_allreduce_grads_in_fp32 = True
    if args.apply_query_key_layer_scaling:
        args.attention_softmax_in_fp32 = True
    for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        value = getattr(args, name)
        if not isinstance(value, torch.dtype):
            setattr(args, name, _DTYPES[value])


def _derive_features(args) -> None:
    if getattr(args, "recompute_activations", False):
        args.recompute_granularity = "selective"
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.position_embedding_type not in ("rope", "mrope") or args.rotary_interleaved:
        args.apply_rope_fusion = False
    if not args.add_bias_linear:
        args.bias_gelu_fusion = False
    else:
        args.add_qkv_bias = True
