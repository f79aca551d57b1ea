"""Flags of Megatron's "regularization", "learning rate" and "mixed precision" groups.

Option strings, dests, types, defaults, choices and nargs are Megatron-LM 0.13.1's; whether a
flag has an effect here is recorded in `manifest.json`.
"""
from megatron.training.arguments._spec import add_group, flag
from megatron.training.arguments.manifest import flag_help

REGULARIZATION_FLAGS = (
    flag("--attention-dropout", type=float, default=0.1, help="Dropouts."),
    flag("--hidden-dropout", type=float, default=0.1, help="Dropouts."),
    flag("--weight-decay", type=float, default=0.01, help="L2 (decoupled, AdamW)."),
    flag("--start-weight-decay", type=float, help="WD schedule (constant|linear|cosine)."),
    flag("--end-weight-decay", type=float, help="WD schedule (constant|linear|cosine)."),
    flag(
        "--weight-decay-incr-style",
        type=str,
        default="constant",
        choices=["constant", "linear", "cosine"],
        help="WD schedule (constant|linear|cosine).",
    ),
    flag("--clip-grad", type=float, default=1.0, help="Global L2 clip."),
    flag("--adam-beta1", type=float, default=0.9, help="Adam."),
    flag("--adam-beta2", type=float, default=0.999, help="Adam."),
    flag("--adam-eps", type=float, default=1e-08, help="Adam."),
    flag("--sgd-momentum", type=float, default=0.9, help="SGD."),
)

LEARNING_RATE_FLAGS = (
    flag("--lr", type=float, help="Max LR."),
    flag(
        "--lr-decay-style",
        type=str,
        default="linear",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
        help="Constant|linear|cosine|inverse-square-root|WSD.",
    ),
    flag(
        "--lr-wsd-decay-style",
        type=str,
        default="exponential",
        choices=["exponential", "linear", "cosine", "minus_sqrt"],
        help="WSD annealing.",
    ),
    flag("--lr-decay-iters", type=int, help="Defaults to train iters/samples."),
    flag("--lr-decay-samples", type=int, help="Defaults to train iters/samples."),
    flag("--lr-wsd-decay-samples", type=int, help="WSD annealing."),
    flag("--lr-wsd-decay-iters", type=int, help="WSD annealing."),
    flag("--lr-warmup-fraction", type=float, help="Warm-up (fraction of decay steps)."),
    flag("--lr-warmup-iters", type=int, default=0, help="Warm-up (fraction of decay steps)."),
    flag("--lr-warmup-samples", type=int, default=0, help="Warm-up (fraction of decay steps)."),
    flag("--lr-warmup-init", type=float, default=0.0, help="Warm-up start LR."),
    flag("--warmup", type=int),
    flag("--min-lr", type=float, default=0.0, help="Floor."),
    flag(
        "--override-opt_param-scheduler",
        action="store_true",
        help="**underscore in the flag name**; ignore the checkpoint's scheduler.",
    ),
    flag(
        "--use-checkpoint-opt_param-scheduler",
        action="store_true",
        help="**underscore in the flag name**; take the scheduler from the checkpoint.",
    ),
    flag("--decoupled-lr", type=float, help="Separate LR for the embedding and output layer."),
    flag("--decoupled-min-lr", type=float, help="Separate LR for the embedding and output layer."),
)

MIXED_PRECISION_FLAGS = (
    flag("--fp16", action="store_true", help="Model dtype (Float16Module)."),
    flag("--bf16", action="store_true", help="Model dtype (Float16Module)."),
    flag("--grad-reduce-in-bf16", action="store_true", help="Bf16 grad reduce."),
    flag("--loss-scale", type=float, help="Static scale; None means dynamic (fp16)."),
    flag("--initial-loss-scale", type=float, default=2**32, help="Dynamic scaler."),
    flag("--min-loss-scale", type=float, default=1.0, help="Dynamic scaler."),
    flag("--loss-scale-window", type=float, default=1000, help="Dynamic scaler."),
    flag("--hysteresis", type=int, default=2, help="Dynamic scaler."),
    flag("--fp32-residual-connection", action="store_true", help="Fp32 residual stream."),
    flag("--apply-query-key-layer-scaling", action="store_true", help="QK scaling by 1/layer (forces fp32 softmax)."),
    flag("--attention-softmax-in-fp32", action="store_true", help="Fp32 softmax."),
    flag(
        "--accumulate-allreduce-grads-in-fp32",
        action="store_true",
        help="Forced True for bf16 unless --grad-reduce-in-bf16.",
    ),
    flag("--fp16-lm-cross-entropy", action="store_true", help="Fp16 CE (fp16 only)."),
    flag("--disable-bf16-reduced-precision-matmul", action="store_true"),
    flag("--reuse-grad-buf-for-mxfp8-param-ag", action="store_true"),
)


def _add_regularization_args(parser):
    """Register the "regularization" group."""
    return add_group(parser, "regularization", REGULARIZATION_FLAGS, flag_help)


def _add_learning_rate_args(parser):
    """Register the "learning rate" group."""
    return add_group(parser, "learning rate", LEARNING_RATE_FLAGS, flag_help)


def _add_mixed_precision_args(parser):
    """Register the "mixed precision" group."""
    return add_group(parser, "mixed precision", MIXED_PRECISION_FLAGS, flag_help)
