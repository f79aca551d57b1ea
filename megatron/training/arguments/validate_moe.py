"""Mixture-of-experts rules of the command line (Megatron-LM 0.13.1's `validate_args` MoE part, plus the
`TransformerConfig` MoE rules reported with the flags' names).

The config rules live once, in `megatron.core.transformer.moe.config_rules`; here they run on a config-named
view of the arguments and their messages name the flags as typed (`moe_router_topk` -> `--moe-router-topk`).
"""
import copy
import re
import warnings
from types import SimpleNamespace
from typing import List

from megatron.core.transformer.moe.config_rules import derive_moe_defaults, moe_config_problems
from megatron.core.utils import module_available

_FIELD_TO_FLAG = {
    "num_moe_experts": "--num-experts",
    "expert_model_parallel_size": "--expert-model-parallel-size",
    "recompute_modules": "--recompute-modules",
    "recompute_granularity": "--recompute-granularity",
}


def _flag_names(message: str) -> str:
    """Config field names in a message replaced by the flags that set them."""
    for field, flag in _FIELD_TO_FLAG.items():
        message = re.sub(rf"\b{field}\b", flag, message)
    message = re.sub(r"(?<![-\w])(moe_[a-z0-9_]+)", lambda m: "--" + m.group(1).replace("_", "-"), message)
    return re.sub(r"\bfp8 \(", "--fp8-format (", message)


def _config_view(args) -> SimpleNamespace:
    """The MoE fields of TransformerConfig as the config would get them from these arguments."""
    view = SimpleNamespace(**{name: copy.copy(value) for name, value in vars(args).items() if name.startswith("moe_")})
    view.num_moe_experts = args.num_experts
    view.expert_model_parallel_size = args.expert_model_parallel_size
    view.fp16, view.fp8, view.add_bias_linear = args.fp16, args.fp8, args.add_bias_linear
    view.recompute_granularity = "selective" if args.recompute_activations else args.recompute_granularity
    view.recompute_modules = list(args.recompute_modules or ["core_attn"])
    view.variable_seq_lengths = False
    view.moe_router_topk_limited_devices = None
    return view


def _parallel_problems(args) -> List[str]:
    problems = []
    ep, tp, pp = args.expert_model_parallel_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp
    world = getattr(args, "world_size", 1)
    if ep > 1 and args.num_experts is None:
        problems.append(f"--expert-model-parallel-size ({ep}) > 1 needs --num-experts.")
    if ep < 1 or etp < 1:
        problems.append(f"--expert-model-parallel-size ({ep}) and --expert-tensor-parallel-size ({etp}) must be at "
                        "least 1.")
    elif world % (etp * ep * pp) != 0:
        problems.append(f"--expert-tensor-parallel-size ({etp}) x --expert-model-parallel-size ({ep}) x "
                        f"--pipeline-model-parallel-size ({pp}) = {etp * ep * pp} must divide the world size ({world}).")
    if args.num_experts is not None and etp != tp and args.ckpt_format == "torch" and args.save is not None:
        problems.append(f"--ckpt-format torch with --expert-tensor-parallel-size ({etp}) != "
                        f"--tensor-model-parallel-size ({tp}): the legacy files are named by the attention TP rank "
                        f"(mp_rank_<tp>_<ep>), so expert TP shards would overwrite each other. Use --ckpt-format "
                        f"torch_dist (reshardable) or an equal expert TP size.")
    if args.num_experts is not None and tp > 1 and not args.sequence_parallel:
        problems.append(f"--num-experts with --tensor-model-parallel-size ({tp}) > 1 needs --sequence-parallel: the "
                        "MoE layers route each rank's sequence shard.")
    return problems


def _model_problems(args) -> List[str]:
    problems = []
    if args.spec is not None:
        problems.append("--spec must not be given with --num-experts: the MoE block spec is built from the flags.")
    freq = args.moe_layer_freq
    if isinstance(freq, list) and args.num_layers is not None and len(freq) != args.num_layers:
        problems.append(f"--moe-layer-freq has {len(freq)} entries but --num-layers is {args.num_layers}: give one "
                        "0/1 per layer.")
    if (args.transformer_impl == "transformer_engine" and module_available("transformer_engine")):
        problems.append("--num-experts with --transformer-impl transformer_engine (installed): Transformer Engine's MoE "
                        "modules are not wired here; add --transformer-impl local (the native experts, same "
                        "checkpoint layout).")
    return problems


def _upcycling_problems(args) -> List[str]:
    """--moe-use-upcycling rules (Megatron 0.13.1); also turns on --no-load-optim / --no-load-rng, as Megatron."""
    if not args.moe_use_upcycling:
        return []
    problems = []
    granularity = args.moe_upcycling_granularity
    if args.num_experts is None:
        problems.append("--moe-use-upcycling needs --num-experts: it converts a dense checkpoint into an MoE model.")
    if args.save is None or args.load is None:
        problems.append(f"--moe-use-upcycling needs --load (the dense checkpoint; got {args.load}) and --save (where "
                        f"the upcycled checkpoint is written; got {args.save}).")
    if granularity < 1 or (args.num_experts is not None and args.num_experts % granularity):
        problems.append(f"--moe-upcycling-granularity ({granularity}) must be >= 1 and divide --num-experts "
                        f"({args.num_experts}).")
    moe_ffn = args.moe_ffn_hidden_size
    if moe_ffn is not None and args.ffn_hidden_size is not None and moe_ffn != args.ffn_hidden_size:
        problems.append(f"--moe-use-upcycling: --moe-ffn-hidden-size ({moe_ffn}) must equal --ffn-hidden-size "
                        f"({args.ffn_hidden_size}): the dense checkpoint's FFN is --ffn-hidden-size x "
                        f"--moe-upcycling-granularity ({granularity}) and each expert takes one of its "
                        f"{granularity} slices.")
    for name in ("no_load_optim", "no_load_rng"):
        if not getattr(args, name):
            setattr(args, name, True)
            warnings.warn(f"--moe-use-upcycling: setting --{name.replace('_', '-')} (the dense checkpoint's "
                          f"optimizer and RNG state do not apply to the MoE model).")
    return problems


def validate_moe(args) -> List[str]:
    """Every MoE problem of the command line, naming the flags."""
    problems = _parallel_problems(args) + _upcycling_problems(args)
    if args.num_experts is None:
        return problems
    view = _config_view(args)
    with warnings.catch_warnings():  # the config warns once more when it is built
        warnings.simplefilter("ignore")
        derive_moe_defaults(view)
    return problems + _model_problems(args) + [_flag_names(p) for p in moe_config_problems(view)]


__all__ = ["validate_moe"]
