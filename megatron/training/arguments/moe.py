"""Flags of Megatron's "moe", "mla" and "heterogeneous architecture" groups.

Option strings, dests, types, defaults, choices and nargs are Megatron-LM 0.13.1's; whether a
flag has an effect here is recorded in `manifest.json`.
"""
from megatron.training.arguments._spec import add_group, flag, moe_freq_type
from megatron.training.arguments.manifest import flag_help

MOE_FLAGS = (
    flag("--expert-model-parallel-size", type=int, default=1, help="EP / ETP."),
    flag("--expert-tensor-parallel-size", type=int, help="EP / ETP."),
    flag("--num-experts", type=int),
    flag("--moe-layer-freq", type=moe_freq_type, default=1),
    flag("--moe-ffn-hidden-size", type=int),
    flag("--moe-shared-expert-intermediate-size", type=int),
    flag("--moe-shared-expert-overlap", action="store_true"),
    flag("--moe-grouped-gemm", action="store_true"),
    flag("--moe-use-legacy-grouped-gemm", action="store_true"),
    flag("--moe-layer-recompute", action="store_true"),
    flag("--moe-extended-tp", action="store_true"),
    flag("--moe-use-upcycling", action="store_true"),
    flag(
        "--moe-router-load-balancing-type",
        type=str,
        default="aux_loss",
        choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"],
    ),
    flag("--moe-router-dtype", type=str, choices=["fp32", "fp64"]),
    flag("--moe-router-score-function", type=str, default="softmax", choices=["softmax", "sigmoid"]),
    flag("--moe-router-topk", type=int, default=2),
    flag("--moe-router-pre-softmax", action="store_true"),
    flag("--moe-router-num-groups", type=int),
    flag("--moe-router-group-topk", type=int),
    flag("--moe-router-topk-scaling-factor", type=float),
    flag("--moe-router-enable-expert-bias", action="store_true"),
    flag("--moe-router-bias-update-rate", type=float, default=0.001),
    flag("--moe-router-force-load-balancing", action="store_true"),
    flag("--moe-router-padding-for-fp8", action="store_true"),
    flag("--moe-aux-loss-coeff", type=float, default=0.0),
    flag("--moe-z-loss-coeff", type=float),
    flag("--moe-input-jitter-eps", type=float),
    flag("--moe-per-layer-logging", action="store_true"),
    flag("--moe-token-dispatcher-type", type=str, default="allgather", choices=["allgather", "alltoall", "flex"]),
    flag("--moe-enable-deepep", action="store_true"),
    flag("--moe-deepep-num-sms", type=int, default=20),
    flag("--moe-permute-fusion", action="store_true"),
    flag("--moe-expert-capacity-factor", type=float),
    flag("--moe-pad-expert-input-to-capacity", action="store_true"),
    flag("--moe-token-drop-policy", type=str, default="probs", choices=["probs", "position"]),
    flag("--moe-apply-probs-on-input", action="store_true"),
    flag("--delay-wgrad-compute", action="store_true"),
    flag("--moe-upcycling-granularity", type=int, default=1),
)

MLA_FLAGS = (
    flag("--q-lora-rank", type=int),
    flag("--kv-lora-rank", type=int, default=32),
    flag("--qk-head-dim", type=int, default=128),
    flag("--qk-pos-emb-head-dim", type=int, default=64),
    flag("--v-head-dim", type=int, default=128),
    flag("--rotary-scaling-factor", type=float, default=1.0),
    flag("--mscale", type=float, default=1.0),
    flag("--mscale-all-dim", type=float, default=1.0),
)

HETEROGENEOUS_FLAGS = (
    flag("--heterogeneous-layers-config-path", type=str),
    flag("--heterogeneous-layers-config-encoded-json", type=str),
)


def _add_moe_args(parser):
    """Register the "moe" group."""
    return add_group(parser, "moe", MOE_FLAGS, flag_help)


def _add_mla_args(parser):
    """Register the "mla" group."""
    return add_group(parser, "mla", MLA_FLAGS, flag_help)


def _add_heterogeneous_args(parser):
    """Register the "heterogeneous architecture" group."""
    return add_group(parser, "heterogeneous architecture", HETEROGENEOUS_FLAGS, flag_help)
