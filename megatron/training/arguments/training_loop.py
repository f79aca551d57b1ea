"""Flags of Megatron's "training", "initialization" and "validation" groups.

Option strings, dests, types, defaults, choices and nargs are Megatron-LM 0.13.1's; whether a
flag has an effect here is recorded in `manifest.json`.
"""
from megatron.training.arguments._spec import add_group, flag
from megatron.training.arguments.manifest import flag_help

TRAINING_FLAGS = (
    flag("--micro-batch-size", type=int, help="Per-rank microbatch (required)."),
    flag("--batch-size", type=int),
    flag("--global-batch-size", type=int, help="Defaults to mbs·DP; must be divisible by mbs·DP."),
    flag("--rampup-batch-size", nargs="*", help="<start> <incr> <samples>."),
    flag("--decrease-batch-size-if-needed", action="store_true", help="Round gbs down to a multiple of mbs·DP."),
    flag("--recompute-activations", action="store_true", help="Implies --recompute-granularity selective."),
    flag(
        "--recompute-granularity",
        type=str,
        choices=["full", "selective"],
        help="Full|selective, uniform|block, N, e.g. core_attn mlp.",
    ),
    flag(
        "--no-check-for-nan-in-loss-and-grad",
        action="store_false",
        dest="check_for_nan_in_loss_and_grad",
        help=(
            "Disables the NaN/Inf loss and grad checks (rerun machine); forced off for fp16 with a "
            "dynamic loss scale."
        ),
    ),
    flag("--check-for-spiky-loss", action="store_true", help="Rerun-machine validations."),
    flag("--check-for-large-grads", action="store_true", help="Rerun-machine validations."),
    flag("--distribute-saved-activations", action="store_true", help="Shard recompute checkpoints over TP."),
    flag(
        "--recompute-method",
        type=str,
        choices=["uniform", "block"],
        help="Full|selective, uniform|block, N, e.g. core_attn mlp.",
    ),
    flag("--recompute-num-layers", type=int, help="Full|selective, uniform|block, N, e.g. core_attn mlp."),
    flag("--recompute-modules", type=str, nargs="*", help="Full|selective, uniform|block, N, e.g. core_attn mlp."),
    flag("--no-clone-scatter-output-in-embedding", action="store_false", dest="clone_scatter_output_in_embedding"),
    flag("--profile", action="store_true", help="Profiling."),
    flag("--profile-step-start", type=int, default=10, help="Profiling."),
    flag("--profile-step-end", type=int, default=12, help="Profiling."),
    flag("--iterations-to-skip", type=int, nargs="+", default=[], help="Skip listed iterations."),
    flag("--result-rejected-tracker-filename", type=str),
    flag(
        "--disable-gloo-process-groups",
        action="store_false",
        dest="enable_gloo_process_groups",
        help="No Gloo groups.",
    ),
    flag("--use-pytorch-profiler", action="store_true", help="Profiling."),
    flag("--profile-ranks", type=int, nargs="+", default=[0], help="Profiling."),
    flag("--record-memory-history", action="store_true"),
    flag("--memory-snapshot-path", type=str, default="snapshot.pickle"),
    flag("--tp-comm-overlap", action="store_true",
         help="Overlap the sequence-parallel all-gathers / reduce-scatters with the GEMMs (needs SP; native "
              "pipelines, copy-engine transfers on one host, no Transformer Engine)."),
    flag("--tp-comm-overlap-cfg", type=str, help="TE userbuffer overlap (needs SP)."),
    flag("--disable-tp-comm-overlap-ag", action="store_false", dest="tp_comm_overlap_ag"),
    flag("--disable-tp-comm-overlap-rs", action="store_false", dest="tp_comm_overlap_rs"),
    flag("--tp-comm-overlap-rs-dgrad", action="store_true"),
    flag("--disable-tp-comm-bulk-dgrad", action="store_false", dest="tp_comm_bulk_dgrad"),
    flag("--disable-tp-comm-bulk-wgrad", action="store_false", dest="tp_comm_bulk_wgrad"),
    flag("--tp-comm-bootstrap-backend", type=str, default="nccl", choices=["nccl", "mpi", "gloo"]),
    flag("--use-cpu-initialization", action="store_true", default=None, help="CPU init (TP-invariant)."),
    flag(
        "--empty-unused-memory-level",
        type=int,
        default=0,
        choices=[0, 1, 2],
        help="0/1/2 calls to torch.cuda.empty_cache.",
    ),
    flag("--deterministic-mode", action="store_true", help="Deterministic algorithms (needs NCCL_ALGO)."),
    flag("--check-weight-hash-across-dp-replicas-interval", type=int),
    flag(
        "--calculate-per-token-loss",
        action="store_true",
        help="Normalise by the global token count instead of per-microbatch.",
    ),
    flag("--train-sync-interval", type=int, help="Periodic cuda.synchronize."),
    flag("--checkpoint-activations", action="store_true"),
    flag("--train-iters", type=int, help="Exactly one is required."),
    flag("--train-samples", type=int, help="Exactly one is required."),
    flag("--log-interval", type=int, default=100, help="Stdout log period."),
    flag("--exit-interval", type=int, help="Exit conditions (save first)."),
    flag("--exit-duration-in-mins", type=int, help="Exit conditions (save first)."),
    flag("--exit-signal-handler", action="store_true", help="Exit conditions (save first)."),
    flag("--tensorboard-dir", type=str),
    flag(
        "--no-masked-softmax-fusion",
        action="store_false",
        dest="masked_softmax_fusion",
        help="Fused scale+mask+softmax.",
    ),
    flag("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion", help="Bias+activation fusion."),
    flag("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion", help="Bias+activation fusion."),
    flag(
        "--no-bias-dropout-fusion",
        action="store_false",
        dest="bias_dropout_fusion",
        help="Bias+dropout+add fusion.",
    ),
    flag(
        "--no-rope-fusion",
        action="store_false",
        dest="apply_rope_fusion",
        help="Fused RoPE (TE); turned off for non-rope.",
    ),
    flag("--cross-entropy-loss-fusion", action="store_true", help="Fused vocab-parallel CE."),
    flag(
        "--cross-entropy-fusion-impl",
        type=str,
        default="native",
        choices=["native", "te"],
        help="Fused vocab-parallel CE.",
    ),
    flag("--use-flash-attn", action="store_true", help="**legacy models only** (no effect on MCore)."),
    flag("--disable-bias-linear", action="store_false", dest="add_bias_linear", help="Removes all linear biases."),
    flag("--add-qkv-bias", action="store_true", help="Bias only in QKV (forced True when bias-linear is on)."),
    flag("--optimizer", type=str, default="adam", choices=["adam", "sgd"], help="Adam|sgd."),
    flag("--optimizer-cpu-offload", action="store_true", help="Hybrid CPU optimizer."),
    flag("--optimizer-offload-fraction", type=float, default=1.0, help="Hybrid CPU optimizer."),
    flag("--use-torch-optimizer-for-cpu-offload", action="store_true"),
    flag("--overlap-cpu-optimizer-d2h-h2d", action="store_true"),
    flag("--no-pin-cpu-grads", action="store_false", dest="pin_cpu_grads"),
    flag("--no-pin-cpu-params", action="store_false", dest="pin_cpu_params"),
    flag("--dataloader-type", type=str, choices=["single", "cyclic", "external"], help="Single|cyclic|external."),
    flag(
        "--no-async-tensor-model-parallel-allreduce",
        action="store_false",
        dest="async_tensor_model_parallel_allreduce",
    ),
    flag("--no-persist-layer-norm", action="store_true", help="Apex persistent LN."),
    flag("--sequence-parallel", action="store_true", help="SP (forced off if TP=1)."),
    flag(
        "--no-gradient-accumulation-fusion",
        action="store_false",
        dest="gradient_accumulation_fusion",
        help=(
            "Disables wgrad accumulation fusion; the fusion needs Apex fused_weight_gradient_mlp_cuda "
            "(local layers) or TE."
        ),
    ),
    flag("--use-mcore-models", action="store_true", dest="deprecated_use_mcore_models"),
    flag("--use-legacy-models", action="store_true", help="Use megatron.legacy.model.*."),
    flag("--manual-gc", action="store_true", help="Deterministic GC."),
    flag("--manual-gc-interval", type=int, default=0, help="Deterministic GC."),
    flag("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval"),
    flag("--disable-tp-comm-split-ag", action="store_false", dest="tp_comm_split_ag"),
    flag("--disable-tp-comm-split-rs", action="store_false", dest="tp_comm_split_rs"),
    flag("--pipeline-model-parallel-comm-backend", type=str, choices=["nccl", "ucc"]),
    flag("--high-priority-stream-groups", type=str, nargs="*", default=[]),
)

INITIALIZATION_FLAGS = (
    flag("--seed", type=int, default=1234, help="Base seed."),
    flag("--data-parallel-random-init", action="store_true", help="Different init per DP rank."),
    flag("--init-method-std", type=float, default=0.02, help="Weight init."),
    flag("--init-method-xavier-uniform", action="store_true", help="Weight init."),
)

VALIDATION_FLAGS = (
    flag("--eval-iters", type=int, default=100, help="Validation cadence and length."),
    flag("--eval-interval", type=int, default=1000, help="Validation cadence and length."),
    flag("--test-mode", action="store_true"),
    flag("--skip-train", action="store_true", help="Eval only."),
)


def _add_training_args(parser):
    """Register the "training" group."""
    return add_group(parser, "training", TRAINING_FLAGS, flag_help)


def _add_initialization_args(parser):
    """Register the "initialization" group."""
    return add_group(parser, "initialization", INITIALIZATION_FLAGS, flag_help)


def _add_validation_args(parser):
    """Register the "validation" group."""
    return add_group(parser, "validation", VALIDATION_FLAGS, flag_help)
