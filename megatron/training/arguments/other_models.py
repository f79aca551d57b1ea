"""Flags of Megatron's groups for model families beyond GPT: biencoder, vision, retro, the
experimental (Mamba/hybrid, yaml, precision-aware optimizer) group, kitchen and sft.

Option strings, dests, types, defaults, choices and nargs are Megatron-LM 0.13.1's; whether a
flag has an effect here is recorded in `manifest.json`.
"""
from megatron.training.arguments._spec import add_group, flag
from megatron.training.arguments.manifest import flag_help

BIENCODER_FLAGS = (
    flag("--ict-head-size", type=int),
    flag("--biencoder-projection-dim", type=int, default=0),
    flag("--biencoder-shared-query-context-model", action="store_true"),
    flag("--ict-load", type=str),
    flag("--bert-load", type=str),
    flag("--titles-data-path", type=str),
    flag("--query-in-block-prob", type=float, default=0.1),
    flag("--use-one-sent-docs", action="store_true"),
    flag("--evidence-data-path", type=str),
    flag("--retriever-report-topk-accuracies", type=int, nargs="+", default=[]),
    flag("--retriever-score-scaling", action="store_true"),
    flag("--block-data-path", type=str),
    flag("--embedding-path", type=str),
    flag("--indexer-batch-size", type=int, default=128),
    flag("--indexer-log-interval", type=int, default=1000),
)

VISION_FLAGS = (
    flag("--num-classes", type=int, default=1000),
    flag("--img-h", type=int, default=224),
    flag("--img-w", type=int, default=224),
    flag("--num-channels", type=int, default=3),
    flag("--patch-dim", type=int, default=16),
    flag("--classes-fraction", type=float, default=1.0),
    flag("--data-per-class-fraction", type=float, default=1.0),
    flag("--no-data-sharding", action="store_false", dest="data_sharding"),
    flag("--head-lr-mult", type=float, default=1.0),
    flag("--vision-pretraining", action="store_true"),
    flag("--vision-pretraining-type", type=str, default="classify", choices=["classify", "inpaint", "dino"]),
    flag("--vision-backbone-type", type=str, default="vit", choices=["vit", "mit", "swin"]),
    flag("--swin-backbone-type", type=str, default="tiny", choices=["tiny", "base", "h3"]),
    flag("--mask-type", type=str, default="random", choices=["random", "row"]),
    flag("--mask-factor", type=float, default=1.0),
    flag("--iter-per-epoch", type=int, default=1250),
    flag("--dino-local-img-size", type=int, default=96),
    flag("--dino-local-crops-number", type=int, default=10),
    flag("--dino-head-hidden-size", type=int, default=2048),
    flag("--dino-bottleneck-size", type=int, default=256),
    flag("--dino-freeze-last-layer", type=float, default=1),
    flag("--dino-norm-last-layer", action="store_true"),
    flag("--dino-warmup-teacher-temp", type=float, default=0.04),
    flag("--dino-teacher-temp", type=float, default=0.07),
    flag("--dino-warmup-teacher-temp-epochs", type=int, default=30),
    flag("--qk-layernorm", action="store_true", help="Q/K normalisation."),
    flag("--qk-l2-norm", action="store_true", help="Q/K normalisation."),
)

RETRO_FLAGS = (
    flag("--retro-project-dir"),
    flag("--retro-add-retriever", action="store_true"),
    flag("--retro-cyclic-train-iters", type=int),
    flag("--retro-encoder-layers", type=int, default=2),
    flag("--retro-encoder-hidden-dropout", type=float, default=0.1),
    flag("--retro-encoder-attention-dropout", type=float, default=0.1),
    flag("--retro-num-neighbors", type=int, default=2),
    flag("--retro-num-retrieved-chunks", type=int, default=2),
    flag("--retro-attention-gate", type=float, default=1),
    flag("--retro-no-verify-neighbor-count", action="store_false", dest="retro_verify_neighbor_count"),
)

EXPERIMENTAL_FLAGS = (
    flag("--enable-experimental", action="store_true"),
    flag("--spec", type=str, nargs="*", help="<module> <attr> layer/stack spec (nargs=*)."),
    flag("--hybrid-attention-ratio", type=float, default=0.0, help="Mamba hybrid allocation."),
    flag("--hybrid-mlp-ratio", type=float, default=0.0, help="Mamba hybrid allocation."),
    flag("--hybrid-override-pattern", type=str, help="String over M, *, -."),
    flag("--mamba-state-dim", type=int, default=128, help="Mamba-2 mixer sizes."),
    flag("--mamba-head-dim", type=int, default=64, help="Mamba-2 mixer sizes."),
    flag("--mamba-num-groups", type=int, default=8, help="Mamba-2 mixer sizes."),
    flag("--mamba-num-heads", type=int, help="Mamba-2 mixer sizes."),
    flag("--is-hybrid-model", action="store_true", help="Switches the FLOPs formula to hybrid."),
    flag("--disable-mamba-mem-eff-path", action="store_true"),
    flag("--yaml-cfg", type=str, help="Experimental yaml config."),
    flag("--use-precision-aware-optimizer", action="store_true", help="TE FusedAdam low-precision state."),
    flag("--main-grads-dtype", default="fp32", choices=["fp32", "bf16"], help="TE FusedAdam low-precision state."),
    flag("--main-params-dtype", default="fp32", choices=["fp32", "fp16"], help="TE FusedAdam low-precision state."),
    flag(
        "--exp-avg-dtype",
        default="fp32",
        choices=["fp32", "fp16", "bf16", "fp8"],
        help="TE FusedAdam low-precision state.",
    ),
    flag(
        "--exp-avg-sq-dtype",
        default="fp32",
        choices=["fp32", "fp16", "bf16", "fp8"],
        help="TE FusedAdam low-precision state.",
    ),
)

KITCHEN_FLAGS = (
    flag("--kitchen-config-file", type=str),
    flag("--kitchen-recipe-number", type=int),
)

SFT_FLAGS = (
    flag("--sft", action="store_true", help="SFT mode."),
    flag("--sft-tokenizer-prompt-format", type=str, default="nemotron-h-aligned", help="SFT mode."),
)


def _add_biencoder_args(parser):
    """Register the "biencoder" group."""
    return add_group(parser, "biencoder", BIENCODER_FLAGS, flag_help)


def _add_vision_args(parser):
    """Register the "vision" group."""
    return add_group(parser, "vision", VISION_FLAGS, flag_help)


def _add_retro_args(parser):
    """Register the "retro" group."""
    return add_group(parser, "retro", RETRO_FLAGS, flag_help)


def _add_experimental_args(parser):
    """Register the "experimental" group."""
    return add_group(parser, "experimental", EXPERIMENTAL_FLAGS, flag_help)


def _add_kitchen_quantization_arguments(parser):
    """Register the "kitchen" group."""
    return add_group(parser, "kitchen", KITCHEN_FLAGS, flag_help)


def _add_sft_args(parser):
    """Register the "sft" group."""
    return add_group(parser, "sft", SFT_FLAGS, flag_help)
