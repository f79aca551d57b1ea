"""`validate_args`: check a parsed command line against Megatron-LM's rules, then derive values.

Validation is a list of small validators, grouped like Megatron's argument groups. Each returns a list
of problem messages that name the flag as typed, the values, the rule and the fix. Every problem of a
command line (unknown flags, rejected flags, rule violations) is collected and raised as ONE
`ArgumentsError`. Derived values are computed afterwards by `derive()`.

Design note (native kernels): Megatron-LM demands `--no-rope-fusion`, `--no-persist-layer-norm` or
`--no-gradient-accumulation-fusion` in some setups because its fused kernels need Transformer Engine or
Apex. The native path here implements or ignores those fusions, so these flags are never demanded.

Design note (the optimisation plan): the FP8 rules, like every decision of how the built model runs, are
checked once, where the plan is resolved (`megatron.core.optimization_plan.resolve`, from `get_model`); a
violation there ends the run the way a bad command line does.
"""
import os
from typing import Callable, List, Optional

import torch

from megatron.core.optimization_plan.resolve import moe_cuda_graph_problems
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.utils import module_available
from megatron.training.arguments.context_parallel import context_parallel_problems
from megatron.training.arguments.derive import derive, derived_ffn_hidden_size
from megatron.training.arguments.errors import ArgumentsError
from megatron.training.arguments.heterogeneous import heterogeneous_config_problems
from megatron.training.arguments.manifest import rejected_flag_problems
from megatron.training.arguments.parser import UNKNOWN_ARGS_ATTR, _print_args, megatron_actions
from megatron.training.arguments.validate_mamba import validate_mamba
from megatron.training.arguments.validate_mla import validate_mla_mtp
from megatron.training.arguments.validate_moe import validate_moe


def validate_args(args, defaults: Optional[dict] = None):
    """Megatron-LM's `validate_args(args, defaults={})`: apply `defaults`, check, derive, print; returns args.

    Raises `ArgumentsError` listing every problem. `defaults` (a script's `args_defaults`) only fill
    arguments whose value is None, i.e. that the user did not give.
    """
    apply_args_defaults(args, defaults or {})
    problems = list(getattr(args, UNKNOWN_ARGS_ATTR, None) or [])
    if hasattr(args, UNKNOWN_ARGS_ATTR):
        delattr(args, UNKNOWN_ARGS_ATTR)
    _normalize_spellings_of_defaults(args)
    problems += rejected_flag_problems(args, megatron_actions())
    for validator in VALIDATORS:
        problems += validator(args)
    if problems:
        raise ArgumentsError(problems)
    derive(args)
    _print_args("arguments", args)
    return args


def _normalize_spellings_of_defaults(args) -> None:
    """Values Megatron treats as "not set": `--num-experts 0`, and an expert TP size equal to the TP size
    (what `derive()` fills in, so an already validated namespace passes the rejected-flag check)."""
    if args.num_experts == 0:
        args.num_experts = None
    if args.expert_tensor_parallel_size == args.tensor_model_parallel_size:
        args.expert_tensor_parallel_size = None


def apply_args_defaults(args, defaults: dict) -> None:
    """Set each `defaults[key]` on args only where the parsed value is None (the user did not pass it)."""
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def _model_parallel_product(args) -> int:
    return args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size


def _validate_required(args) -> List[str]:
    problems = []
    if args.num_layers is None and args.encoder_num_layers is None:
        problems.append("--num-layers is required: give the number of transformer layers.")
    for name, what in (("hidden_size", "the hidden size"), ("num_attention_heads", "the number of attention heads"),
                       ("max_position_embeddings", "the maximum sequence length the model supports"),
                       ("micro_batch_size", "the per-rank micro-batch size")):
        if getattr(args, name) is None:
            problems.append(f"--{name.replace('_', '-')} is required: give {what}.")
    if args.seq_length is None and args.encoder_seq_length is None:
        problems.append("--seq-length is required: give the training sequence length.")
    return problems


def _validate_sizes(args) -> List[str]:
    problems = []
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be at least 1.")
    if problems:
        return problems
    world, product = getattr(args, "world_size", 1), _model_parallel_product(args)
    if world % product != 0:
        problems.append(
            f"--tensor-model-parallel-size ({args.tensor_model_parallel_size}) x --pipeline-model-parallel-size "
            f"({args.pipeline_model_parallel_size}) x --context-parallel-size ({args.context_parallel_size}) = "
            f"{product} must divide the world size ({world}): launch a multiple of {product} ranks or choose "
            f"parallel sizes whose product divides {world}."
        )
    tp, heads = args.tensor_model_parallel_size, args.num_attention_heads
    if heads is not None and heads % tp != 0:
        problems.append(
            f"--num-attention-heads ({heads}) must be divisible by --tensor-model-parallel-size ({tp}): "
            f"choose a TP size that divides {heads}."
        )
    if args.group_query_attention and args.num_query_groups is not None:
        groups = args.num_query_groups
        if groups % tp != 0:
            problems.append(
                f"--num-query-groups ({groups}) must be divisible by --tensor-model-parallel-size ({tp}): "
                f"choose a TP size that divides {groups}."
            )
        if heads is not None and (groups < 1 or heads % groups != 0):
            problems.append(
                f"--num-attention-heads ({heads}) must be divisible by --num-query-groups ({groups}): "
                "each query group serves the same number of heads."
            )
    return problems


def _validate_batch(args) -> List[str]:
    problems = []
    mbs, gbs = args.micro_batch_size, args.global_batch_size
    if mbs is not None and mbs <= 0:
        problems.append(f"--micro-batch-size ({mbs}) must be positive.")
    if gbs is not None and gbs <= 0:
        problems.append(f"--global-batch-size ({gbs}) must be positive.")
    world, product = getattr(args, "world_size", 1), _model_parallel_product(args)
    if mbs and mbs > 0 and gbs and gbs > 0 and product > 0 and world % product == 0:
        dp = world // product
        if gbs % (mbs * dp) != 0 and not args.decrease_batch_size_if_needed and args.rampup_batch_size is None:
            problems.append(
                f"--global-batch-size ({gbs}) must be divisible by --micro-batch-size ({mbs}) x data-parallel size "
                f"({dp}) = {mbs * dp}: choose a multiple of {mbs * dp} or pass --decrease-batch-size-if-needed."
            )
    if args.rampup_batch_size is not None and len(args.rampup_batch_size) != 3:
        problems.append(
            f"--rampup-batch-size ({' '.join(args.rampup_batch_size)}) takes exactly three values: "
            "<start batch size> <batch size increment> <ramp-up samples>."
        )
    return problems


def _validate_training_length(args) -> List[str]:
    problems = []
    if args.train_iters is not None and args.train_samples is not None:
        problems.append(
            f"--train-iters ({args.train_iters}) and --train-samples ({args.train_samples}) are exclusive: "
            "train by iterations or by samples, not both."
        )
    if args.train_iters:
        for flag, value, empty in (("--lr-decay-samples", args.lr_decay_samples, None),
                                   ("--lr-warmup-samples", args.lr_warmup_samples, 0),
                                   ("--rampup-batch-size", args.rampup_batch_size, None)):
            if value != empty:
                problems.append(
                    f"{flag} ({value}) is for sample-based training but --train-iters ({args.train_iters}) selects "
                    f"iteration-based training: use the *-iters flags or train with --train-samples."
                )
    if args.train_samples:
        for flag, value, empty in (("--lr-decay-iters", args.lr_decay_iters, None),
                                   ("--lr-warmup-iters", args.lr_warmup_iters, 0)):
            if value != empty:
                problems.append(
                    f"{flag} ({value}) is for iteration-based training but --train-samples ({args.train_samples}) "
                    "selects sample-based training: use the *-samples flags."
                )
    if args.lr_warmup_fraction is not None and (args.lr_warmup_iters or args.lr_warmup_samples):
        problems.append(
            f"--lr-warmup-fraction ({args.lr_warmup_fraction}) cannot be combined with --lr-warmup-iters "
            f"({args.lr_warmup_iters}) or --lr-warmup-samples ({args.lr_warmup_samples}): give one warm-up length."
        )
    if args.lr is not None and args.min_lr is not None and args.min_lr > args.lr:
        problems.append(f"--min-lr ({args.min_lr}) must not exceed --lr ({args.lr}).")
    return problems


def _validate_data(args) -> List[str]:
    problems = []
    per_split = [args.train_data_path, args.valid_data_path, args.test_data_path]
    if args.data_path and args.data_args_path:
        problems.append("--data-path and --data-args-path are exclusive: give the blend one way.")
    if any(per_split) and args.per_split_data_args_path:
        problems.append(
            "--train/valid/test-data-path and --per-split-data-args-path are exclusive: give the splits one way."
        )
    sources = int(bool(args.mock_data)) + int(bool(args.data_path or args.data_args_path)) + int(
        bool(any(per_split) or args.per_split_data_args_path))
    if sources > 1:
        problems.append(
            "--mock-data, --data-path (or --data-args-path) and --train/valid/test-data-path (or "
            "--per-split-data-args-path) are exclusive: choose one data source."
        )
    if args.num_workers < 0:
        problems.append(f"--num-workers ({args.num_workers}) must be >= 0.")
    return problems + _sft_problems(args)


def _sft_problems(args) -> List[str]:
    """--sft: Megatron's SFT dataset needs the SFT tokenizer and real JSONL data; position resets only with
    --reset-attention-mask (which packs conversations)."""
    if not args.sft:
        return []
    problems = []
    if args.tokenizer_type != "SFTTokenizer":
        problems.append(f"--sft needs --tokenizer-type SFTTokenizer (got {args.tokenizer_type}): it renders the "
                        "conversations with --sft-tokenizer-prompt-format; add --tokenizer-type SFTTokenizer "
                        "--tokenizer-model <HF tokenizer dir>.")
    if args.mock_data:
        problems.append("--sft reads JSONL conversations: replace --mock-data with --data-path <file.jsonl>.")
    if args.reset_position_ids and not args.reset_attention_mask:
        problems.append("--sft with --reset-position-ids needs --reset-attention-mask (packed conversations): add "
                        "--reset-attention-mask or remove --reset-position-ids.")
    return problems


def _validate_shape(args) -> List[str]:
    problems = []
    hidden, heads = args.hidden_size, args.num_attention_heads
    if args.kv_channels is None and hidden is not None and heads and hidden % heads != 0:
        problems.append(
            f"--hidden-size ({hidden}) must be divisible by --num-attention-heads ({heads}) unless --kv-channels "
            "is given: choose sizes that divide or set --kv-channels."
        )
    if args.ffn_hidden_size is None and hidden is not None and derived_ffn_hidden_size(args) <= 0:
        problems.append(
            f"--swiglu with --hidden-size ({hidden}) and no --ffn-hidden-size gives an FFN size of "
            f"{derived_ffn_hidden_size(args)} (int(4*h*2/3/64)*64): pass --ffn-hidden-size."
        )
    seq = args.seq_length if args.seq_length is not None else args.encoder_seq_length
    max_pos = args.max_position_embeddings
    for flag, length in (("--seq-length", seq), ("--decoder-seq-length", args.decoder_seq_length)):
        if max_pos is not None and length is not None and max_pos < length:
            problems.append(
                f"--max-position-embeddings ({max_pos}) must be >= {flag} ({length}): raise "
                f"--max-position-embeddings to at least {length}."
            )
    # derive() mirrors these pairs, so equal values (an already validated namespace) are fine.
    if None not in (args.seq_length, args.encoder_seq_length) and args.seq_length != args.encoder_seq_length:
        problems.append(
            f"--seq-length ({args.seq_length}) and --encoder-seq-length ({args.encoder_seq_length}) are exclusive: "
            "give one."
        )
    if None not in (args.num_layers, args.encoder_num_layers) and args.num_layers != args.encoder_num_layers:
        problems.append(
            f"--num-layers ({args.num_layers}) and --encoder-num-layers ({args.encoder_num_layers}) are exclusive: "
            "give one."
        )
    activations = [f for f, on in (("--swiglu", args.swiglu), ("--squared-relu", args.squared_relu),
                                   ("--openai-gelu", args.openai_gelu)) if on]
    if len(activations) > 1:
        problems.append(f"{' and '.join(activations)} are exclusive: choose one MLP activation.")
    return problems


def _validate_pipeline(args) -> List[str]:
    problems = []
    pp, layers = args.pipeline_model_parallel_size, args.num_layers or args.encoder_num_layers
    vpp_flags = [f for f, v in (("--num-layers-per-virtual-pipeline-stage", args.num_layers_per_virtual_pipeline_stage),
                                ("--num-virtual-stages-per-pipeline-rank", args.num_virtual_stages_per_pipeline_rank),
                                ("--pipeline-model-parallel-layout", args.pipeline_model_parallel_layout))
                 if v is not None]
    if len(vpp_flags) > 1:
        problems.append(f"{' and '.join(vpp_flags)} are exclusive: describe the virtual pipeline one way.")
        return problems
    uneven = args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None
    total = (layers or 0) + int(args.account_for_embedding_in_pipeline_split) + int(
        args.account_for_loss_in_pipeline_split)
    vpp = None
    if args.pipeline_model_parallel_layout is not None:
        try:
            layout = PipelineParallelLayerLayout.from_str(args.pipeline_model_parallel_layout, pp)
        except ValueError as err:
            return problems + [f"--pipeline-model-parallel-layout ({args.pipeline_model_parallel_layout!r}): {err}"]
        vpp = layout.virtual_pipeline_model_parallel_size
        if layers is not None:
            problems += [f"--pipeline-model-parallel-layout: {p}" for p in layout.problems(layers, None, None)]
    elif args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage, nlpvps = total // max(pp, 1), args.num_layers_per_virtual_pipeline_stage
        if uneven:
            problems.append(
                "--num-layers-per-virtual-pipeline-stage cannot be combined with "
                "--decoder-first/last-pipeline-num-layers: use --num-virtual-stages-per-pipeline-rank with uneven "
                "pipeline stages."
            )
        elif layers is not None and (total % pp != 0 or nlpvps <= 0 or per_stage % nlpvps != 0):
            problems.append(
                f"--num-layers ({layers}, {total} counting embedding/loss) / --pipeline-model-parallel-size ({pp}) "
                f"must be a multiple of --num-layers-per-virtual-pipeline-stage ({nlpvps}): choose sizes that divide."
            )
        vpp = per_stage // nlpvps if nlpvps > 0 else None
    elif args.num_virtual_stages_per_pipeline_rank is not None:
        vpp = args.num_virtual_stages_per_pipeline_rank
        if vpp < 1:
            problems.append(f"--num-virtual-stages-per-pipeline-rank ({vpp}) must be at least 1.")
        elif layers is not None and not uneven and total % (pp * vpp) != 0:
            problems.append(
                f"--num-layers ({layers}, {total} counting embedding/loss) must be divisible by "
                f"--pipeline-model-parallel-size ({pp}) x --num-virtual-stages-per-pipeline-rank ({vpp}) = {pp * vpp}."
            )
    elif layers is not None and not uneven and total % pp != 0:
        problems.append(
            f"--num-layers ({layers}, {total} counting embedding/loss) must be divisible by "
            f"--pipeline-model-parallel-size ({pp}): choose a PP size that divides it or use "
            "--decoder-first/last-pipeline-num-layers for an uneven split."
        )
    if uneven:
        problems += _uneven_pipeline_problems(args, layers, pp, vpp)
    if vpp is not None and vpp > 1:
        minimum = 1 if args.overlap_p2p_comm else 2
        if pp <= minimum:
            problems.append(
                f"an interleaved (virtual) pipeline needs --pipeline-model-parallel-size ({pp}) > {minimum}"
                + ("" if args.overlap_p2p_comm else " with --no-overlap-p2p-communication") + "."
            )
    return problems


def _validate_p2p(args) -> List[str]:
    if not args.overlap_p2p_comm_warmup_flush:
        return []
    interleaved = (args.num_layers_per_virtual_pipeline_stage is not None
                   or args.num_virtual_stages_per_pipeline_rank is not None
                   or args.pipeline_model_parallel_layout is not None)
    if interleaved and args.overlap_p2p_comm:
        return []
    return ["--overlap-p2p-communication-warmup-flush needs an interleaved pipeline (virtual stages) with p2p "
            "overlap on: drop it, or add virtual stages and remove --no-overlap-p2p-communication."]


def _validate_wgrad_deferral(args) -> List[str]:
    """--defer-embedding-wgrad-compute: the rules of Megatron's ModelParallelConfig, on the flags as typed."""
    problems = []
    if args.defer_embedding_wgrad_compute:
        if args.pipeline_model_parallel_size <= 1:
            problems.append(
                f"--defer-embedding-wgrad-compute defers the output layer's weight gradients to the pipeline flush: "
                f"it needs --pipeline-model-parallel-size > 1 (got {args.pipeline_model_parallel_size}); drop it or "
                f"use pipeline parallelism.")
        if not args.gradient_accumulation_fusion:
            problems.append("--defer-embedding-wgrad-compute adds the deferred weight gradients into main_grad: it "
                            "needs gradient accumulation fusion; drop --no-gradient-accumulation-fusion.")
    if args.wgrad_deferral_limit < 0:
        problems.append(f"--wgrad-deferral-limit ({args.wgrad_deferral_limit}) must be >= 0: 0 defers every "
                        f"microbatch.")
    return problems


def _uneven_pipeline_problems(args, layers, pp, vpp) -> List[str]:
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if pp <= 1:
        return ["--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1."]
    if args.account_for_embedding_in_pipeline_split or args.account_for_loss_in_pipeline_split:
        return ["--decoder-first/last-pipeline-num-layers cannot be combined with "
                "--account-for-embedding/loss-in-pipeline-split: use one way of uneven splitting."]
    if layers is None:
        return []
    middle_stages = pp - int(first is not None) - int(last is not None)
    middle_layers = layers - (first or 0) - (last or 0)
    if middle_layers < 0 or (middle_stages == 0 and middle_layers != 0):
        return [f"--num-layers ({layers}) does not match --decoder-first-pipeline-num-layers ({first}) + "
                f"--decoder-last-pipeline-num-layers ({last}) on {pp} pipeline stages."]
    if middle_stages > 0 and middle_layers % (middle_stages * (vpp or 1)) != 0:
        return [f"the {middle_layers} layers left for the {middle_stages} other pipeline stages must be divisible by "
                f"{middle_stages * (vpp or 1)}: adjust --decoder-first/last-pipeline-num-layers."]
    return []


def _validate_overlap_and_sharding(args) -> List[str]:
    problems = []
    if args.overlap_param_gather and not (args.use_distributed_optimizer and args.overlap_grad_reduce):
        problems.append(
            "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce: add both."
        )
    if args.overlap_param_gather_with_optimizer_step and not (
        args.use_distributed_optimizer and args.overlap_param_gather
    ):
        problems.append(
            "--overlap-param-gather-with-optimizer-step needs --use-distributed-optimizer and --overlap-param-gather."
        )
    if args.ddp_num_buckets is not None and args.ddp_bucket_size is not None:
        problems.append(
            f"--ddp-num-buckets ({args.ddp_num_buckets}) and --ddp-bucket-size ({args.ddp_bucket_size}) are "
            "exclusive: size the buckets one way."
        )
    if args.use_torch_fsdp2:
        problems += _fsdp2_problems(args)
    problems += _distributed_optimizer_instances_problems(args)
    if not args.enable_gloo_process_groups and args.use_distributed_optimizer and args.ckpt_format == "torch":
        problems.append(
            "--disable-gloo-process-groups with --use-distributed-optimizer needs a distributed checkpoint format: "
            "use --ckpt-format torch_dist (the legacy format gathers optimizer state over gloo)."
        )
    return problems


def _distributed_optimizer_instances_problems(args) -> List[str]:
    """Megatron's rules for --num-distributed-optimizer-instances (asserted there in DDP and
    initialize_model_parallel): at least 1; above 1 only with the distributed optimizer; it must divide
    the DP x CP size and the expert DP size."""
    instances = args.num_distributed_optimizer_instances
    if instances < 1:
        return [f"--num-distributed-optimizer-instances ({instances}) must be at least 1."]
    if instances == 1:
        return []
    problems = []
    if not args.use_distributed_optimizer:
        problems.append(
            f"--num-distributed-optimizer-instances ({instances}) > 1 needs --use-distributed-optimizer: the "
            "instances are copies of the distributed optimizer's sharded state."
        )
    world, product = getattr(args, "world_size", 1), _model_parallel_product(args)
    if product < 1 or world % product != 0:
        return problems
    dp_cp = world // product * args.context_parallel_size
    if dp_cp % instances != 0:
        problems.append(
            f"--num-distributed-optimizer-instances ({instances}) must divide the data-parallel x context-parallel "
            f"size ({dp_cp}, world size {world}): each instance takes an equal share of it."
        )
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    expert_product = etp * args.expert_model_parallel_size * args.pipeline_model_parallel_size
    if expert_product >= 1 and world % expert_product == 0 and (world // expert_product) % instances != 0:
        problems.append(
            f"--num-distributed-optimizer-instances ({instances}) must divide the expert data-parallel size "
            f"({world // expert_product} = world {world} / (expert TP x EP x PP)): choose a divisor."
        )
    return problems


def _validate_optimizer_cpu_offload(args) -> List[str]:
    """Megatron-LM's rules: the hybrid CPU optimizer runs on the precision-aware optimizer's code path (the
    optimizer steps the model shards and keeps fp32 copies itself), which needs Adam and the distributed
    optimizer. Without the offload that path is Transformer Engine's FusedAdam, which is not used here."""
    problems = []
    if args.optimizer_cpu_offload and not args.use_precision_aware_optimizer:
        problems.append("--optimizer-cpu-offload needs --use-precision-aware-optimizer (as in Megatron-LM, the hybrid "
                        "CPU optimizer reuses its code path): add --use-precision-aware-optimizer.")
    if args.use_precision_aware_optimizer:
        if args.optimizer != "adam":
            problems.append(f"--use-precision-aware-optimizer needs --optimizer adam (got --optimizer {args.optimizer}).")
        if not args.use_distributed_optimizer:
            problems.append("--use-precision-aware-optimizer needs --use-distributed-optimizer: add it.")
        if not args.optimizer_cpu_offload:
            problems.append("--use-precision-aware-optimizer without --optimizer-cpu-offload needs Transformer "
                            "Engine's FusedAdam, which this framework does not use: add --optimizer-cpu-offload "
                            "(the hybrid optimizer keeps fp32 master params) or drop the flag.")
    return problems


def _fsdp2_problems(args) -> List[str]:
    rules = [
        (args.pipeline_model_parallel_size > 1,
         f"--use-torch-fsdp2 does not support --pipeline-model-parallel-size "
         f"({args.pipeline_model_parallel_size}) > 1."),
        (args.use_distributed_optimizer,
         "--use-torch-fsdp2 and --use-distributed-optimizer are exclusive: FSDP2 already shards optimizer state."),
        (args.ckpt_format not in ("torch_dist", "torch_dcp"),
         f"--use-torch-fsdp2 needs --ckpt-format torch_dist or torch_dcp (got {args.ckpt_format})."),
        (not args.untie_embeddings_and_output_weights,
         "--use-torch-fsdp2 needs --untie-embeddings-and-output-weights (tied weights cannot be sharded apart)."),
        (args.fp16, "--use-torch-fsdp2 does not support --fp16: use --bf16."),
    ]
    return [message for broken, message in rules if broken]


def _validate_precision(args) -> List[str]:
    problems = []
    if args.fp16 and args.bf16:
        problems.append("--fp16 and --bf16 are exclusive: choose one precision.")
    if args.fp16_lm_cross_entropy and not args.fp16:
        problems.append("--fp16-lm-cross-entropy needs --fp16.")
    if args.fp32_residual_connection and not (args.fp16 or args.bf16):
        problems.append("--fp32-residual-connection needs --fp16 or --bf16 (the residual is already fp32 otherwise).")
    if args.loss_scale is not None and args.loss_scale <= 0:
        problems.append(f"--loss-scale ({args.loss_scale}) must be positive; omit it for dynamic loss scaling.")
    return problems


def _validate_checkpointing(args) -> List[str]:
    problems = []
    if args.save is not None and args.save_interval is None:
        problems.append(
            f"--save ({args.save}) needs --save-interval: give the number of iterations between checkpoints."
        )
    if args.save_interval is not None and args.save_interval <= 0:
        problems.append(f"--save-interval ({args.save_interval}) must be positive.")
    if args.ckpt_convert_format is not None and args.ckpt_convert_save is None:
        problems.append(
            f"--ckpt-convert-format ({args.ckpt_convert_format}) needs --ckpt-convert-save: give the output directory."
        )
    if args.async_save and args.ckpt_format != "torch_dist":
        problems.append(
            f"--async-save needs --ckpt-format torch_dist (got --ckpt-format {args.ckpt_format}): "
            "drop --async-save or use the torch_dist format."
        )
    if args.non_persistent_ckpt_type == "local" and not args.non_persistent_local_ckpt_dir:
        problems.append("--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir: give a node-local "
                        "directory for each rank's file.")
    if args.ckpt_format == "torch_dcp" and args.save is not None:
        problems.extend(_torch_dcp_save_problems(args))
    return problems


def _torch_dcp_save_problems(args) -> List[str]:
    """torch_dcp stores each rank's plain state dict: model-parallel copies of a key would collide."""
    from megatron.training.checkpointing_dist import torch_dcp_layout_problems

    return [f"--ckpt-format torch_dcp with --save cannot store this run: {problem}; use --ckpt-format torch_dist "
            "(reshardable, any layout) or --ckpt-format torch." for problem in
            torch_dcp_layout_problems(args, with_optimizer=not args.no_save_optim)]


def _validate_recompute(args) -> List[str]:
    problems = []
    granularity = "selective" if getattr(args, "recompute_activations", False) else args.recompute_granularity
    if granularity == "full":
        if args.recompute_method is None:
            problems.append("--recompute-granularity full needs --recompute-method (uniform or block).")
        if args.recompute_num_layers is None:
            problems.append("--recompute-granularity full needs --recompute-num-layers.")
    else:
        if args.recompute_method is not None:
            problems.append(
                f"--recompute-method ({args.recompute_method}) only applies to --recompute-granularity full."
            )
        if granularity == "selective" and args.recompute_num_layers is not None:
            problems.append(
                f"--recompute-num-layers ({args.recompute_num_layers}) must not be set with selective recompute."
            )
    if args.distribute_saved_activations and (granularity != "full" or args.sequence_parallel):
        problems.append(
            "--distribute-saved-activations needs --recompute-granularity full and no --sequence-parallel."
        )
    return problems


def gpu_compute_capability() -> Optional[tuple]:
    """The (major, minor) compute capability of the current GPU, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def _validate_communication(args, capability_fn: Callable = None) -> List[str]:
    capability = (capability_fn or gpu_compute_capability)()
    parallel = args.tensor_model_parallel_size > 1 or args.context_parallel_size > 1
    if capability is None or capability[0] >= 10 or not parallel or args.use_torch_fsdp2:
        return []
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if value == "1":
        return []
    return [
        f"--tensor-model-parallel-size ({args.tensor_model_parallel_size}) or --context-parallel-size "
        f"({args.context_parallel_size}) > 1 on a GPU of compute capability "
        f"{capability[0]}.{capability[1]} needs the environment variable CUDA_DEVICE_MAX_CONNECTIONS=1 (it is "
        f"{value!r}) so that communication and compute kernels keep their order: export "
        "CUDA_DEVICE_MAX_CONNECTIONS=1 before launching."
    ]


def _validate_misc(args) -> List[str]:
    problems = []
    if args.deterministic_mode and args.distributed_backend == "nccl" and torch.cuda.is_available():
        allowed = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")
        if os.environ.get("NCCL_ALGO") not in allowed:
            problems.append(
                f"--deterministic-mode needs the environment variable NCCL_ALGO set to one of {', '.join(allowed)} "
                f"(it is {os.environ.get('NCCL_ALGO')!r}): export NCCL_ALGO=Ring, for example."
            )
    if args.rotary_percent is not None and not 0.0 < args.rotary_percent <= 1.0:
        problems.append(f"--rotary-percent ({args.rotary_percent}) must be in (0, 1].")
    if args.tensorboard_log_interval is not None and args.tensorboard_log_interval <= 0:
        problems.append(f"--tensorboard-log-interval ({args.tensorboard_log_interval}) must be positive.")
    if args.log_interval is not None and args.log_interval <= 0:
        problems.append(f"--log-interval ({args.log_interval}) must be positive.")
    if args.eval_interval is not None and args.eval_interval <= 0:
        problems.append(f"--eval-interval ({args.eval_interval}) must be positive.")
    return problems


def _validate_tp_comm_overlap(args) -> List[str]:
    if args.tp_comm_overlap and not args.sequence_parallel:
        return ["--tp-comm-overlap overlaps the sequence-parallel all-gathers / reduce-scatters with the GEMMs: "
                "it needs --sequence-parallel (and --tensor-model-parallel-size > 1); add it or drop --tp-comm-overlap."]
    return []


def _validate_fp8_param_gather(args) -> List[str]:
    """Megatron's rule: FP8 parameters need a sharded optimizer that gathers them; here the distributed optimizer
    (FSDP2's gather of FP8 bytes is not built)."""
    if not getattr(args, "fp8_param_gather", False):
        return []
    if args.use_torch_fsdp2:
        return ["--fp8-param-gather with --use-torch-fsdp2: FSDP2 does not all-gather FP8 parameters here; use "
                "--use-distributed-optimizer instead of --use-torch-fsdp2 (or drop --fp8-param-gather)."]
    if not args.use_distributed_optimizer:
        return ["--fp8-param-gather is only supported with the distributed optimizer (as in Megatron): add "
                "--use-distributed-optimizer or drop --fp8-param-gather."]
    if args.fp8 is None:
        return ["--fp8-param-gather needs --fp8-format (the FP8 parameters are those of the FP8 linears)."]
    return []


def _validate_cuda_graph(args) -> List[str]:
    """--enable-cuda-graph graphs whole layers with one micro-batch in flight (megatron/core/transformer/cuda_graphs.py)."""
    if not args.enable_cuda_graph:
        return []
    rules = [
        (args.pipeline_model_parallel_size > 1,
         f"--pipeline-model-parallel-size ({args.pipeline_model_parallel_size}) > 1 keeps several micro-batches "
         "in flight, which per-layer graphs do not support yet: drop --enable-cuda-graph or use 1."),
        (bool(args.hidden_dropout) or bool(args.attention_dropout),
         f"--hidden-dropout ({args.hidden_dropout}) and --attention-dropout ({args.attention_dropout}) must be 0: "
         "the graphs do not advance the dropout RNG; set both to 0 or drop --enable-cuda-graph."),
        (args.recompute_granularity is not None or getattr(args, "recompute_activations", False),
         "activation recompute (--recompute-granularity / --recompute-activations) cannot be graphed yet: drop "
         "one of the two."),
        (args.reset_attention_mask, "--reset-attention-mask: document boundaries change every micro-batch, "
         "which graphs cannot follow; drop one of the two."),
        (args.overlap_param_gather,
         "--overlap-param-gather gathers parameters in forward pre-hooks, which cannot run inside a graph: drop "
         "one of the two."),
        (args.cuda_graph_warmup_steps < 1,
         f"--cuda-graph-warmup-steps ({args.cuda_graph_warmup_steps}) must be at least 1."),
    ]
    problems = [f"--enable-cuda-graph: {message}" for broken, message in rules if broken]
    if args.num_experts:
        etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
        problems += [f"--enable-cuda-graph with --num-experts {args.num_experts}: the MoE layers cannot be graphed "
                     f"with {problem}; drop --enable-cuda-graph or that setting."
                     for problem in moe_cuda_graph_problems(args, etp)]
    return problems


VALIDATORS = (
    _validate_required, _validate_sizes, _validate_batch, _validate_training_length, _validate_data,
    _validate_shape, _validate_pipeline, _validate_p2p, _validate_wgrad_deferral, _validate_overlap_and_sharding,
    _validate_precision,
    _validate_checkpointing, _validate_recompute, _validate_communication, _validate_misc,
    _validate_cuda_graph, _validate_tp_comm_overlap, _validate_fp8_param_gather, _validate_optimizer_cpu_offload,
    heterogeneous_config_problems, validate_moe, validate_mamba, validate_mla_mtp,
    context_parallel_problems,
)
