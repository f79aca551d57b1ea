"""Megatron Core 0.13.1's mixture-of-experts rules of `TransformerConfig.__post_init__`.

`derive_moe_defaults(config)` applies Megatron's rewrites (a negative capacity factor means dropless, the
deprecated `moe_router_topk_limited_devices` and `moe_layer_recompute`); `moe_config_problems(config)`
returns one message per violated rule, which the config raises together with its other problems. Rules that
Megatron only asserts at run time (sinkhorn without aux loss, probabilities on the input only for top-1,
no bias in the experts) are checked here too, where the fix is easy to name. This module imports nothing
from the model code, so the config can use it.
"""
import warnings
from typing import List

_CAPACITY_BALANCING = ("aux_loss", "seq_aux_loss", "none")
_BALANCING = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")
_DISPATCHERS = ("allgather", "alltoall", "flex")


def derive_moe_defaults(config) -> None:
    """Megatron's MoE rewrites of the config fields (in place)."""
    if config.moe_expert_capacity_factor is not None and config.moe_expert_capacity_factor < 0:
        config.moe_expert_capacity_factor = None
    if not config.moe_router_group_topk and config.moe_router_topk_limited_devices:
        warnings.warn("moe_router_topk_limited_devices is deprecated: use moe_router_group_topk and "
                      "moe_router_num_groups.")
        config.moe_router_group_topk = config.moe_router_topk_limited_devices
        config.moe_router_num_groups = config.expert_model_parallel_size
    if config.moe_layer_recompute and config.recompute_granularity != "full":
        warnings.warn("moe_layer_recompute is deprecated: use recompute_granularity='selective' with 'moe' in "
                      "recompute_modules.")
        config.recompute_granularity = "selective"
        if "moe" not in config.recompute_modules:
            config.recompute_modules.append("moe")
    if config.num_moe_experts is not None and config.num_moe_experts >= 32 and not config.moe_router_dtype:
        warnings.warn(f"num_moe_experts ({config.num_moe_experts}) >= 32 without moe_router_dtype: routing in fp32 "
                      "(--moe-router-dtype fp32) is recommended for numerical stability.")


def _choice_problems(config) -> List[str]:
    problems = []
    if config.moe_router_load_balancing_type not in _BALANCING:
        problems.append(f"moe_router_load_balancing_type ({config.moe_router_load_balancing_type!r}) must be one "
                        f"of {list(_BALANCING)}.")
    if config.moe_router_score_function not in ("softmax", "sigmoid"):
        problems.append(f"moe_router_score_function ({config.moe_router_score_function!r}) must be 'softmax' or "
                        "'sigmoid'.")
    if config.moe_token_dispatcher_type not in _DISPATCHERS:
        problems.append(f"moe_token_dispatcher_type ({config.moe_token_dispatcher_type!r}) must be one of "
                        f"{list(_DISPATCHERS)}.")
    if config.moe_token_drop_policy not in ("probs", "position"):
        problems.append(f"moe_token_drop_policy ({config.moe_token_drop_policy!r}) must be 'probs' or 'position'.")
    if config.moe_router_dtype not in (None, "fp32", "fp64"):
        problems.append(f"moe_router_dtype ({config.moe_router_dtype!r}) must be None, 'fp32' or 'fp64'.")
    return problems


def _routing_problems(config) -> List[str]:
    problems = []
    experts, topk = config.num_moe_experts, config.moe_router_topk
    if (topk == 1 and config.moe_router_score_function == "softmax" and not config.moe_router_pre_softmax
            and config.moe_router_load_balancing_type != "sinkhorn"):
        problems.append("moe_router_topk = 1 with the softmax score function needs moe_router_pre_softmax "
                        "(--moe-router-pre-softmax): a softmax over one selected logit has a zero gradient.")
    if config.moe_router_enable_expert_bias and config.moe_router_score_function != "sigmoid":
        problems.append("moe_router_enable_expert_bias (aux-loss-free balancing) needs moe_router_score_function "
                        "'sigmoid' (--moe-router-score-function sigmoid).")
    if config.moe_router_group_topk:
        groups = config.moe_router_num_groups
        if config.moe_router_topk_limited_devices:
            problems.append("moe_router_topk_limited_devices is deprecated and replaced by moe_router_group_topk "
                            "and moe_router_num_groups: do not set it together with them.")
        if not groups:
            problems.append(f"moe_router_group_topk ({config.moe_router_group_topk}) needs moe_router_num_groups "
                            "(--moe-router-num-groups): group-limited routing needs the number of groups.")
        elif experts % groups != 0:
            problems.append(f"num_moe_experts ({experts}) must be divisible by moe_router_num_groups ({groups}).")
        elif config.moe_router_group_topk > groups:
            problems.append(f"moe_router_group_topk ({config.moe_router_group_topk}) must not exceed "
                            f"moe_router_num_groups ({groups}).")
    if config.moe_router_load_balancing_type == "sinkhorn" and config.moe_aux_loss_coeff != 0:
        problems.append(f"moe_router_load_balancing_type 'sinkhorn' needs moe_aux_loss_coeff = 0 (got "
                        f"{config.moe_aux_loss_coeff}): Sinkhorn routing has no auxiliary loss.")
    if config.moe_apply_probs_on_input and topk != 1:
        problems.append(f"moe_apply_probs_on_input needs moe_router_topk = 1 (got {topk}).")
    return problems


def _capacity_and_dispatch_problems(config) -> List[str]:
    problems = []
    dispatcher = config.moe_token_dispatcher_type
    if (config.moe_expert_capacity_factor is not None
            and config.moe_router_load_balancing_type not in _CAPACITY_BALANCING):
        problems.append(f"moe_expert_capacity_factor ({config.moe_expert_capacity_factor}) works only with "
                        f"moe_router_load_balancing_type in {list(_CAPACITY_BALANCING)} (got "
                        f"{config.moe_router_load_balancing_type!r}).")
    if config.moe_pad_expert_input_to_capacity and config.moe_expert_capacity_factor is None:
        problems.append("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor "
                        "(--moe-expert-capacity-factor).")
    if config.moe_shared_expert_intermediate_size is not None and config.moe_shared_expert_intermediate_size <= 0:
        problems.append(f"moe_shared_expert_intermediate_size ({config.moe_shared_expert_intermediate_size}) must be "
                        "positive (number of shared experts x the FFN size of each).")
    if config.moe_shared_expert_overlap and dispatcher != "alltoall":
        problems.append(f"moe_shared_expert_overlap works only with the alltoall token dispatcher (got "
                        f"{dispatcher!r}).")
    if dispatcher == "allgather" and config.variable_seq_lengths:
        problems.append("the allgather token dispatcher does not support variable sequence lengths: use "
                        "moe_token_dispatcher_type 'alltoall'.")
    if config.moe_enable_deepep and dispatcher != "flex":
        problems.append("moe_enable_deepep (DeepEP) works only with moe_token_dispatcher_type 'flex'.")
    if dispatcher == "flex" and config.moe_pad_expert_input_to_capacity:
        problems.append("the flex token dispatcher does not support moe_pad_expert_input_to_capacity.")
    if dispatcher == "flex" and config.moe_shared_expert_overlap:
        problems.append("the flex token dispatcher does not support moe_shared_expert_overlap.")
    if config.moe_router_padding_for_fp8 and config.fp8 is None:
        problems.append("moe_router_padding_for_fp8 needs fp8 (--fp8-format).")
    return problems


def _model_problems(config) -> List[str]:
    problems = []
    ep = config.expert_model_parallel_size
    if config.num_moe_experts % ep != 0:
        problems.append(f"num_moe_experts ({config.num_moe_experts}) must be divisible by expert_model_parallel_size "
                        f"({ep}).")
    if ep > 1 and config.fp16:
        problems.append("expert parallelism (expert_model_parallel_size > 1) does not support fp16: use bf16.")
    if config.add_bias_linear:
        problems.append("MoE layers have no linear biases: set add_bias_linear=False (--disable-bias-linear).")
    if config.fp8 is not None:
        problems.append(f"fp8 ({config.fp8!r}) with MoE layers: FP8 experts are not built here (Megatron needs "
                        "Transformer Engine for them); drop --fp8-format.")
    if "moe_act" in config.recompute_modules and not config.moe_grouped_gemm:
        problems.append("recompute_modules 'moe_act' needs moe_grouped_gemm (--moe-grouped-gemm).")
    if config.moe_layer_recompute and config.recompute_granularity == "full":
        problems.append("moe_layer_recompute cannot be combined with recompute_granularity='full'.")
    return problems


def moe_config_problems(config) -> List[str]:
    """Every violated MoE rule of `config` (empty for a dense model)."""
    if config.num_moe_experts is None:
        return []
    if config.num_moe_experts <= 0:
        return [f"num_moe_experts ({config.num_moe_experts}) must be positive."]
    problems = _choice_problems(config)
    if config.moe_router_topk > config.num_moe_experts or config.moe_router_topk < 1:
        problems.append(f"moe_router_topk ({config.moe_router_topk}) must be between 1 and num_moe_experts "
                        f"({config.num_moe_experts}).")
    return problems + _routing_problems(config) + _capacity_and_dispatch_problems(config) + _model_problems(config)


__all__ = ["derive_moe_defaults", "moe_config_problems"]
