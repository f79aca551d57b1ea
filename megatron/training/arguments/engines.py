"""Flags of Megatron's "inference" and "Transformer-Engine" groups.

Option strings, dests, types, defaults, choices and nargs are Megatron-LM 0.13.1's; whether a
flag has an effect here is recorded in `manifest.json`.
"""
from megatron.training.arguments._spec import add_group, flag
from megatron.training.arguments.manifest import flag_help

INFERENCE_FLAGS = (
    flag("--inference-batch-times-seqlen-threshold", type=int, default=-1),
    flag("--max-tokens-to-oom", type=int, default=12000),
    flag("--output-bert-embeddings", action="store_true"),
    flag("--bert-embedder-type", default="megatron", choices=["megatron", "huggingface"]),
    flag("--flash-decode", action="store_true"),
    flag("--enable-cuda-graph", action="store_true"),
    flag("--cuda-graph-warmup-steps", type=int, default=3),
    flag("--external-cuda-graph", action="store_true"),
    flag("--cuda-graph-scope", type=str, default="full", choices=["full", "attn"]),
    flag("--inference-max-requests", dest="inference_max_batch_size", type=int, default=8),
    flag("--inference-max-seq-length", type=int, default=2560),
    flag("--inference-dynamic-batching", action="store_true"),
    flag("--inference-dynamic-batching-buffer-size-gb", type=float, default=40.0),
    flag("--inference-dynamic-batching-chunk-size", type=int, default=256),
    flag("--inference-dynamic-batching-buffer-guaranteed-fraction", type=float, default=0.2),
    flag("--inference-dynamic-batching-buffer-overflow-factor", type=float),
    flag("--inference-dynamic-batching-max-requests-override", type=int),
    flag("--inference-dynamic-batching-max-tokens-override", type=int),
    flag("--symmetric-ar-type", type=str, choices=["two_shot", "one_shot", "multimem_all_reduce", None]),
    flag("--nccl-all-reduce-for-prefill", action="store_true"),
    flag("--mlp-chunks-for-prefill", type=int, default=1),
)

TRANSFORMER_ENGINE_FLAGS = (
    flag("--fp8-format", dest="fp8", choices=["e4m3", "hybrid"], help="E4m3|hybrid."),
    flag(
        "--fp8-recipe",
        default="delayed",
        choices=["tensorwise", "delayed", "mxfp8", "blockwise"],
        help="Tensorwise|delayed|mxfp8|blockwise.",
    ),
    flag("--fp8-margin", type=int, default=0, help="Delayed scaling."),
    flag("--fp8-interval", type=int, default=1),
    flag("--fp8-amax-history-len", type=int, default=1, help="Delayed scaling."),
    flag("--fp8-amax-compute-algo", default="most_recent", choices=["most_recent", "max"], help="Delayed scaling."),
    flag("--no-fp8-wgrad", action="store_false", dest="fp8_wgrad"),
    flag(
        "--transformer-impl",
        default="transformer_engine",
        choices=["local", "transformer_engine"],
        help="Local|transformer_engine (which spec).",
    ),
    flag("--fp8-param-gather", action="store_true", help="Fp8 params (maps to fp8_param)."),
    flag("--first-last-layers-bf16", action="store_true", help="Keep edge layers in bf16."),
    flag("--num-layers-at-start-in-bf16", type=int, default=1),
    flag("--num-layers-at-end-in-bf16", type=int, default=1),
    flag("--te-rng-tracker", action="store_true"),
    flag("--inference-rng-tracker", action="store_true"),
)


def _add_inference_args(parser):
    """Register the "inference" group."""
    return add_group(parser, "inference", INFERENCE_FLAGS, flag_help)


def _add_transformer_engine_args(parser):
    """Register the "Transformer-Engine" group."""
    return add_group(parser, "Transformer-Engine", TRANSFORMER_ENGINE_FLAGS, flag_help)
