"""The one place where parsed arguments become Megatron Core config dataclasses.

Each builder copies every argument whose name equals a field of the config class (iterating
`dataclasses.fields`, so it adapts to the fields that exist), then applies the explicit rename and
derivation table below. The tables `*_RUNTIME_ONLY` name the fields that no flag sets, with the reason;
a test checks that every field is either mapped or listed there.
"""
import dataclasses
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F

from megatron.core.activations import openai_gelu, squared_relu
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

# TransformerConfig fields set from differently named arguments (Megatron's rename table).
TRANSFORMER_RENAMES = {
    "persist_layer_norm": "not no_persist_layer_norm",
    "layernorm_zero_centered_gamma": "apply_layernorm_1p",
    "layernorm_epsilon": "norm_epsilon",
    "deallocate_pipeline_outputs": "always True",
    "pipeline_dtype": "params_dtype",
    "batch_p2p_comm": "not overlap_p2p_comm",
    "num_moe_experts": "num_experts",
    "num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
    "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers",
    "fp8_param": "fp8_param_gather",
    "activation_func": "--swiglu -> silu, --squared-relu, --openai-gelu, else gelu",
    "gated_linear_unit": "--swiglu",
    "bias_activation_fusion": "bias_swiglu_fusion with --swiglu, else bias_gelu_fusion (off for other activations)",
    "init_method": "xavier_uniform_ with --init-method-xavier-uniform, else normal(0, init_method_std)",
    "output_layer_init_method": "xavier_uniform_ with --init-method-xavier-uniform, else scaled normal",
    "num_query_groups": "num_query_groups only with --group-query-attention, else None",
    "cp_comm_type": "a scalar when exactly one --cp-comm-type is given",
    "use_mamba_mem_eff_path": "not disable_mamba_mem_eff_path",
}

_HOOK = "a hook the training loop sets on the config (no flag)"
TRANSFORMER_RUNTIME_ONLY = {
    "timers": _HOOK, "finalize_model_grads_func": _HOOK, "grad_scale_func": _HOOK, "no_sync_func": _HOOK,
    "grad_sync_func": _HOOK, "param_sync_func": _HOOK,
    "enable_autocast": "no Megatron flag; autocast is off for CLI runs",
    "autocast_dtype": "follows params_dtype (set by the config itself)",
    "num_microbatches_with_partial_activation_checkpoints": "no Megatron flag",
    "use_te_rng_tracker": "Transformer Engine RNG tracker; --te-rng-tracker is accepted without effect",
    "tp_comm_atomic_ag": "Transformer Engine userbuffers option without a flag",
    "tp_comm_atomic_rs": "Transformer Engine userbuffers option without a flag",
    "tp_comm_overlap_disable_qkv": "Transformer Engine userbuffers option without a flag",
    "tp_comm_overlap_disable_fc1": "Transformer Engine userbuffers option without a flag",
    "variable_seq_lengths": "set by scripts whose batches vary in length (no flag)",
    "batch_p2p_sync": "no Megatron flag",
    "cpu_offloading": "activation offloading has no Megatron flag",
    "cpu_offloading_num_layers": "activation offloading has no Megatron flag",
    "_cpu_offloading_context": "internal state of activation offloading",
    "cpu_offloading_activations": "activation offloading has no Megatron flag",
    "cpu_offloading_weights": "activation offloading has no Megatron flag",
    "softmax_scale": "no Megatron flag (1/sqrt(kv_channels) by default)",
    "window_size": "sliding-window attention has no Megatron 0.13.1 flag",
    "activation_func_fp8_input_store": "FP8 option without a flag",
    "memory_efficient_layer_norm": "Apex option without a flag",
    "fp8_dot_product_attention": "FP8 option without a flag",
    "fp8_multi_head_attention": "FP8 option without a flag",
    "tp_only_amax_red": "FP8 option without a flag",
    "use_kitchen": "kitchen quantization (its flags are rejected)",
    "quant_recipe": "kitchen quantization (its flags are rejected)",
    "moe_router_topk_limited_devices": "deprecated MoE option without a flag",
    "moe_token_dropping": "MoE option without a flag",
    "cuda_graph_use_single_mempool": "CUDA graph option without a flag",
    "cuda_graph_retain_backward_graph": "CUDA graph option without a flag",
    "disable_parameter_transpose_cache": "Transformer Engine option without a flag",
    "use_te_activation_func": "Transformer Engine option without a flag",
    "heterogeneous_block_specs": "set by HeterogeneousTransformerConfig (--heterogeneous-layers-config-path)",
    "hetereogenous_dist_checkpoint": "no Megatron flag; heterogeneous configs always save per-layer keys",
}

OPTIMIZER_RENAMES: Dict[str, str] = {}
OPTIMIZER_RUNTIME_ONLY = {
    "timers": "set by the training loop",
    "store_param_remainders": "precision-aware optimizer detail without a flag",
}

DDP_RENAMES = {
    "grad_reduce_in_fp32": "accumulate_allreduce_grads_in_fp32",
    "check_for_nan_in_grad": "check_for_nan_in_loss_and_grad",
    "bucket_size": "ddp_bucket_size, or num_parameters // ddp_num_buckets, else max(4e7, 1e6*dp_cp); None without "
                   "--overlap-grad-reduce",
    "pad_buckets_for_high_nccl_busbw": "ddp_pad_buckets_for_high_nccl_busbw",
    "average_in_collective": "ddp_average_in_collective",
}
DDP_RUNTIME_ONLY = {
    "preserve_fp32_weights": "Megatron FSDP option (--use-custom-fsdp is rejected)",
}


def _same_named(args, config_class) -> Dict[str, Any]:
    """Every argument whose name is a field of `config_class`."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(config_class) if hasattr(args, f.name)}


def _only_existing(kwargs: Dict[str, Any], config_class) -> Dict[str, Any]:
    names = {f.name for f in dataclasses.fields(config_class)}
    return {key: value for key, value in kwargs.items() if key in names}


def _activation_kwargs(args) -> Dict[str, Any]:
    if args.swiglu:
        return {"activation_func": F.silu, "gated_linear_unit": True, "bias_activation_fusion": args.bias_swiglu_fusion}
    if args.squared_relu:
        return {"activation_func": squared_relu, "gated_linear_unit": False, "bias_activation_fusion": False}
    if args.openai_gelu:
        return {"activation_func": openai_gelu, "gated_linear_unit": False, "bias_activation_fusion": False}
    fusion = args.bias_gelu_fusion and args.add_bias_linear
    return {"activation_func": F.gelu, "gated_linear_unit": False, "bias_activation_fusion": fusion}


def _transformer_renames(args) -> Dict[str, Any]:
    kwargs = {
        "persist_layer_norm": not args.no_persist_layer_norm,
        "layernorm_zero_centered_gamma": args.apply_layernorm_1p,
        "layernorm_epsilon": args.norm_epsilon,
        "deallocate_pipeline_outputs": True,
        "pipeline_dtype": args.params_dtype,
        "batch_p2p_comm": not args.overlap_p2p_comm,
        "num_moe_experts": args.num_experts,
        "num_layers_in_first_pipeline_stage": args.decoder_first_pipeline_num_layers,
        "num_layers_in_last_pipeline_stage": args.decoder_last_pipeline_num_layers,
        "fp8_param": args.fp8_param_gather,
        "num_query_groups": args.num_query_groups if args.group_query_attention else None,
        "use_mamba_mem_eff_path": not args.disable_mamba_mem_eff_path,
    }
    kwargs.update(_activation_kwargs(args))
    if args.init_method_xavier_uniform:
        kwargs["init_method"] = torch.nn.init.xavier_uniform_
        kwargs["output_layer_init_method"] = torch.nn.init.xavier_uniform_
    if isinstance(args.cp_comm_type, (list, tuple)) and len(args.cp_comm_type) == 1:
        kwargs["cp_comm_type"] = args.cp_comm_type[0]
    return kwargs


def core_transformer_config_from_args(args, config_class=None):
    """Megatron-LM's `core_transformer_config_from_args`: a `TransformerConfig` (or `config_class`) from args;
    a `HeterogeneousTransformerConfig` with --heterogeneous-layers-config-path (as in Megatron, whatever
    `config_class` says)."""
    if config_class is None and getattr(args, "multi_latent_attention", False):
        config_class = MLATransformerConfig  # Megatron's pretrain_gpt.py picks it for --multi-latent-attention
    config_class = config_class or TransformerConfig
    if getattr(args, "heterogeneous_layers_config_path", None) is not None:
        config_class = HeterogeneousTransformerConfig
    kwargs = _same_named(args, config_class)
    kwargs.update(_only_existing(_transformer_renames(args), config_class))
    return config_class(**kwargs)


def optimizer_config_from_args(args, config_class=None):
    """An `OptimizerConfig` from every same-named argument (Megatron's `setup_model_and_optimizer`)."""
    config_class = config_class or OptimizerConfig
    return config_class(**_same_named(args, config_class))


def ddp_bucket_size(args, num_parameters: Optional[int] = None, data_parallel_size: Optional[int] = None):
    """Megatron's bucket-size rule from `get_model` (None means one bucket)."""
    if not args.overlap_grad_reduce:
        return None
    if args.ddp_num_buckets is not None:
        if num_parameters is None:
            raise ValueError(
                f"--ddp-num-buckets ({args.ddp_num_buckets}) needs the model's parameter count: pass num_parameters."
            )
        return num_parameters // args.ddp_num_buckets
    if args.ddp_bucket_size is not None:
        return args.ddp_bucket_size
    if data_parallel_size is None:
        data_parallel_size = args.data_parallel_size * args.context_parallel_size
    return max(40_000_000, 1_000_000 * data_parallel_size)


def ddp_config_from_args(args, num_parameters: Optional[int] = None, data_parallel_size: Optional[int] = None,
                         config_class=None):
    """A `DistributedDataParallelConfig` from args (Megatron's `get_model`).

    `num_parameters` (this rank's parameter count) is needed with `--ddp-num-buckets`; `data_parallel_size`
    is the DP x CP size used for the default bucket size (from args when not given).
    """
    config_class = config_class or DistributedDataParallelConfig
    kwargs = _same_named(args, config_class)
    kwargs.update(_only_existing({
        "grad_reduce_in_fp32": args.accumulate_allreduce_grads_in_fp32,
        "check_for_nan_in_grad": args.check_for_nan_in_loss_and_grad,
        "bucket_size": ddp_bucket_size(args, num_parameters, data_parallel_size),
        "pad_buckets_for_high_nccl_busbw": args.ddp_pad_buckets_for_high_nccl_busbw,
        "average_in_collective": args.ddp_average_in_collective,
    }, config_class))
    return config_class(**kwargs)
