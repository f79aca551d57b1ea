"""Flags of Megatron's "network size" group: model shape and architecture.

Option strings, dests, types, defaults, choices and nargs are Megatron-LM 0.13.1's; whether a
flag has an effect here is recorded in `manifest.json`.
"""
from megatron.training.arguments._spec import (
    add_group,
    attention_backend_type,
    flag,
    no_rope_freq_type,
    ATTN_BACKENDS,
    DEFAULT_ATTN_BACKEND,
)
from megatron.training.arguments.manifest import flag_help

NETWORK_SIZE_FLAGS = (
    flag("--num-layers", type=int, help="Transformer layers (required; or --encoder-num-layers)."),
    flag("--encoder-num-layers", type=int, help="Encoder layers (T5)."),
    flag("--decoder-num-layers", type=int, help="Decoder layers (T5)."),
    flag("--hidden-size", type=int, help="Hidden size h (required)."),
    flag("--ffn-hidden-size", type=int, help="MLP size; defaults to 4h, or int(4h*2/3/64)*64 with --swiglu."),
    flag("--num-attention-heads", type=int, help="Heads (required)."),
    flag(
        "--attention-backend",
        type=attention_backend_type,
        default=DEFAULT_ATTN_BACKEND,
        choices=ATTN_BACKENDS,
        help="Flash|fused|unfused|local|auto (TE env selection).",
    ),
    flag("--kv-channels", type=int, help="Head dim; defaults to h/heads."),
    flag(
        "--group-query-attention",
        action="store_true",
        help="Enables GQA (otherwise --num-query-groups is ignored).",
    ),
    flag("--num-query-groups", type=int, default=1, help="KV groups."),
    flag("--max-position-embeddings", type=int, help="Required; must be >= seq-length."),
    flag(
        "--position-embedding-type",
        type=str,
        default="learned_absolute",
        choices=["learned_absolute", "rope", "mrope", "relative", "none"],
        help="Learned_absolute|rope|mrope|relative|none.",
    ),
    flag("--relative-attention-num-buckets", type=int, default=32),
    flag("--relative-attention-max-distance", type=int, default=128),
    flag("--use-rotary-position-embeddings", action="store_true", help="Deprecated alias for rope."),
    flag("--rotary-base", type=int, default=10000, help="RoPE theta."),
    flag("--rotary-percent", type=float, default=1.0, help="Fraction of head dim rotated."),
    flag("--rotary-interleaved", action="store_true", help="RoFormer-style interleaving."),
    flag("--rotary-seq-len-interpolation-factor", type=int, help="Linear RoPE interpolation."),
    flag("--use-rope-scaling", action="store_true", help="Llama-3.x RoPE scaling."),
    flag("--rope-scaling-factor", type=float, default=8.0, help="Llama-3.x RoPE scaling."),
    flag("--no-rope-freq", type=no_rope_freq_type, help="Layers that skip RoPE (int N or list expression)."),
    flag("--no-position-embedding", action="store_false", dest="add_position_embedding", help="Deprecated."),
    flag("--mrope-section", type=int, nargs="+"),
    flag("--make-vocab-size-divisible-by", type=int, default=128, help="Padded vocab = ceil(V/(128·TP))·128·TP."),
    flag("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"], help="LayerNorm|RMSNorm."),
    flag("--norm-epsilon", type=float, default=1e-05, help="Maps to layernorm_epsilon."),
    flag("--apply-layernorm-1p", action="store_true", help="Zero-centred gamma."),
    flag("--apply-residual-connection-post-layernorm", action="store_true", help="Original BERT residual order."),
    flag("--openai-gelu", action="store_true", help="Activation choice (SwiGLU sets gated_linear_unit)."),
    flag("--squared-relu", action="store_true", help="Activation choice (SwiGLU sets gated_linear_unit)."),
    flag("--swiglu", action="store_true", help="Activation choice (SwiGLU sets gated_linear_unit)."),
    flag("--onnx-safe", type=bool),
    flag("--bert-no-binary-head", action="store_false", dest="bert_binary_head", help="BERT NSP/SOP head off."),
    flag("--untie-embeddings-and-output-weights", action="store_true", help="Tied by default."),
    flag(
        "--multi-latent-attention",
        action="store_true",
        help=(
            "MLA (with --q-lora-rank None, --kv-lora-rank 32, --qk-head-dim 128, --qk-pos-emb-head-dim "
            "64, --v-head-dim 128)."
        ),
    ),
    flag("--mtp-num-layers", type=int, help="Multi-token prediction."),
    flag("--mtp-loss-scaling-factor", type=float, default=0.1, help="Multi-token prediction."),
)


def _add_network_size_args(parser):
    """Register the "network size" group."""
    return add_group(parser, "network size", NETWORK_SIZE_FLAGS, flag_help)
