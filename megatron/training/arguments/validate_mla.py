"""Multi-latent attention and multi-token prediction rules of the command line (Megatron-LM 0.13.1's
`validate_args` MLA / MTP parts and the MLA FLOPs assert), reported with the flags' names."""
from typing import List


def _mla_problems(args) -> List[str]:
    problems = []
    if args.rotary_interleaved:
        problems.append("--rotary-interleaved cannot be combined with --multi-latent-attention (as in Megatron-LM): "
                        "drop --rotary-interleaved.")
    if args.qk_l2_norm:
        problems.append("--qk-l2-norm cannot be combined with --multi-latent-attention (as in Megatron-LM): drop it.")
    if args.group_query_attention:
        problems.append("--group-query-attention cannot be combined with --multi-latent-attention (Megatron-LM's "
                        "FLOPs count asserts it): MLA shares one latent over all heads; drop --group-query-attention.")
    for flag, value in (("--kv-lora-rank", args.kv_lora_rank), ("--qk-head-dim", args.qk_head_dim),
                        ("--qk-pos-emb-head-dim", args.qk_pos_emb_head_dim), ("--v-head-dim", args.v_head_dim),
                        ("--q-lora-rank", args.q_lora_rank)):
        if value is not None and value <= 0:
            problems.append(f"{flag} ({value}) must be positive with --multi-latent-attention.")
    if args.qk_pos_emb_head_dim is not None and args.qk_pos_emb_head_dim % 2:
        problems.append(f"--qk-pos-emb-head-dim ({args.qk_pos_emb_head_dim}) must be even: RoPE rotates pairs.")
    return problems


def _mtp_problems(args) -> List[str]:
    problems = []
    if args.mtp_num_layers <= 0:
        problems.append(f"--mtp-num-layers ({args.mtp_num_layers}) must be positive (or left out).")
    if args.position_embedding_type not in ("rope", "none"):
        problems.append(f"--mtp-num-layers needs --position-embedding-type rope or none, got "
                        f"{args.position_embedding_type!r} (as in Megatron-LM).")
    return problems


def validate_mla_mtp(args) -> List[str]:
    """Problems of --multi-latent-attention and --mtp-num-layers command lines."""
    problems = []
    if getattr(args, "multi_latent_attention", False):
        problems += _mla_problems(args)
    if getattr(args, "mtp_num_layers", None) is not None:
        problems += _mtp_problems(args)
    return problems


__all__ = ["validate_mla_mtp"]
