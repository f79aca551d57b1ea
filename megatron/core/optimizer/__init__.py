"""Megatron optimizer construction: param groups, base torch optimizer, mixed-precision wrapper.

`get_megatron_optimizer(config, model_chunks, ...)` groups the trainable params of all model chunks
by `(wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr)`, builds a `torch.optim.AdamW` (Megatron's
Adam is always AdamW: decoupled weight decay) or `torch.optim.SGD` over the groups, and wraps it:
`DistributedOptimizer` with `use_distributed_optimizer`, `Float16OptimizerWithFloat16Params` for
fp16/bf16, else `FP32Optimizer`. Expert-parallel params (`allreduce=False`) get their own optimizer
and the two are combined in a `ChainedOptimizer`.
"""
import logging
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, count_zeros_fp32, get_grad_norm_fp32
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from megatron.core.optimizer.chained_optimizer import ChainedOptimizer
from megatron.core.optimizer.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
    MixedPrecisionOptimizer,
)
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.param_groups import (
    _get_param_groups,
    _update_min_and_max_lr_in_param_groups,
    get_param_groups_and_buffers,
)

logger = logging.getLogger(__name__)

__all__ = [
    "OptimizerConfig",
    "MegatronOptimizer",
    "MixedPrecisionOptimizer",
    "Float16OptimizerWithFloat16Params",
    "FP32Optimizer",
    "ChainedOptimizer",
    "DistributedOptimizer",
    "MegatronGradScaler",
    "ConstantGradScaler",
    "DynamicGradScaler",
    "get_megatron_optimizer",
    "get_grad_norm_fp32",
    "clip_grad_by_total_norm_fp32",
    "count_zeros_fp32",
    "_get_param_groups",
    "_get_param_groups_and_buffers",
    "_update_min_and_max_lr_in_param_groups",
]

# Megatron's private name for the same function, imported by some user scripts.
_get_param_groups_and_buffers = get_param_groups_and_buffers


def _adam_init_state_fn(opt: torch.optim.Optimizer, config: Optional[OptimizerConfig] = None) -> None:
    """Create empty AdamW state for every param that has none (used before loading sharded state)."""
    fused = any(group.get("fused") for group in opt.param_groups)
    for group in opt.param_groups:
        for param in group["params"]:
            if len(opt.state[param]) != 0:
                continue
            step_device = param.device if (fused or group.get("capturable")) else torch.device("cpu")
            opt.state[param]["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
            opt.state[param]["exp_avg"] = torch.zeros_like(param.data)
            opt.state[param]["exp_avg_sq"] = torch.zeros_like(param.data)


def _adam_implementation_kwargs(param_groups: List[Dict]) -> Dict[str, bool]:
    """fused=True where torch has a fused AdamW kernel for the params' device (CUDA, recent CPU), else foreach."""
    devices = {param.device.type for group in param_groups for param in group["params"]}
    supported = set(torch.utils._foreach_utils._get_fused_kernels_supported_devices())
    if devices and devices <= supported:
        return {"fused": True}
    return {"foreach": True}


def _build_base_optimizer(config: OptimizerConfig, param_groups: List[Dict]):
    """The torch optimizer over `param_groups` and the matching state-init function."""
    if config.lr is None:
        raise ValueError("OptimizerConfig.lr (--lr) is None: set a learning rate")
    if config.optimizer == "adam":
        optimizer = torch.optim.AdamW(
            param_groups,
            lr=config.lr,
            weight_decay=config.weight_decay,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            **_adam_implementation_kwargs(param_groups),
        )
        return optimizer, _adam_init_state_fn
    if config.optimizer == "sgd":
        optimizer = torch.optim.SGD(
            param_groups, lr=config.lr, weight_decay=config.weight_decay, momentum=config.sgd_momentum
        )
        return optimizer, None
    raise ValueError(f"OptimizerConfig.optimizer ({config.optimizer!r}) must be 'adam' or 'sgd' (--optimizer)")


def _build_grad_scaler(config: OptimizerConfig) -> Optional[MegatronGradScaler]:
    if config.loss_scale:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=config.loss_scale_window,
            hysteresis=config.hysteresis,
        )
    return None


def _get_megatron_optimizer_based_on_param_groups(
    config: OptimizerConfig,
    model_chunks: List[torch.nn.Module],
    param_groups: List[Dict],
    per_model_buffers: Optional[Dict[int, list]] = None,
    model_parallel_group: Optional[dist.ProcessGroup] = None,
    data_parallel_group: Optional[dist.ProcessGroup] = None,
    data_parallel_group_gloo: Optional[dist.ProcessGroup] = None,
    data_parallel_group_idx: Optional[int] = None,
    intra_dist_opt_group: Optional[dist.ProcessGroup] = None,
    distributed_optimizer_instance_id: int = 0,
) -> MegatronOptimizer:
    """Base optimizer over `param_groups`, wrapped for the configured precision and sharding."""
    if param_groups:
        optimizer, init_state_fn = _build_base_optimizer(config, param_groups)
    else:
        optimizer, init_state_fn = None, None
    if config.fp16 or config.bf16 or config.use_distributed_optimizer:
        grad_scaler = _build_grad_scaler(config)
        if config.use_distributed_optimizer:
            wrapped = DistributedOptimizer(
                optimizer,
                config,
                grad_scaler,
                init_state_fn,
                model_chunks=model_chunks,
                per_model_buffers=per_model_buffers,
                data_parallel_group=data_parallel_group,
                data_parallel_group_gloo=data_parallel_group_gloo,
                data_parallel_group_idx=data_parallel_group_idx,
                distributed_optimizer_instance_id=distributed_optimizer_instance_id,
            )
            # Main-param shards are disjoint across the whole optimizer instance, so grad stats are
            # reduced over it rather than over the model-parallel group only.
            wrapped.grad_stats_parallel_group = intra_dist_opt_group
        else:
            wrapped = Float16OptimizerWithFloat16Params(optimizer, config, grad_scaler, init_state_fn)
            wrapped.grad_stats_parallel_group = model_parallel_group
    else:
        wrapped = FP32Optimizer(optimizer, config, init_state_fn)
        wrapped.grad_stats_parallel_group = model_parallel_group
    wrapped.model_chunks = model_chunks
    return wrapped


def _check_supported(config: OptimizerConfig) -> None:
    errors = []
    if config.optimizer_cpu_offload:
        errors.append("--optimizer-cpu-offload is a Megatron-LM flag this framework does not implement yet")
    if config.use_precision_aware_optimizer:
        errors.append(
            "--use-precision-aware-optimizer needs Transformer Engine's FusedAdam, which this framework does not use"
        )
    if errors:
        raise ValueError("; ".join(errors) + ": drop the flag")


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized() and parallel_state.model_parallel_is_initialized()


def _group_rank(group) -> int:
    """This rank's index in `group` (0 without a group)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def _distributed_optimizer_instance_id() -> int:
    if not _dist_ready():
        return 0
    full = dist.get_world_size(parallel_state.get_data_parallel_group(with_context_parallel=True))
    partial = dist.get_world_size(
        parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
    )
    if full > partial:
        return dist.get_rank(parallel_state.get_inter_distributed_optimizer_instance_group())
    return 0


def _dense_groups(use_gloo_process_groups: bool) -> Dict:
    """Process groups of the dense optimizer (None everywhere without parallel_state)."""
    if not _dist_ready():
        return dict(model_parallel_group=None, data_parallel_group=None, data_parallel_group_gloo=None)
    gloo = None
    if use_gloo_process_groups:
        gloo = parallel_state.get_data_parallel_group_gloo(with_context_parallel=True, partial_data_parallel=True)
    return dict(
        model_parallel_group=parallel_state.get_model_parallel_group(),
        data_parallel_group=parallel_state.get_data_parallel_group(
            with_context_parallel=True, partial_data_parallel=True
        ),
        data_parallel_group_gloo=gloo,
    )


def _expert_groups(use_gloo_process_groups: bool) -> Dict:
    """Process groups of the expert-parallel optimizer: like DDP's expert buffers, the expert-DP part
    inside this rank's distributed-optimizer instance."""
    if not _dist_ready():
        return dict(model_parallel_group=None, data_parallel_group=None, data_parallel_group_gloo=None)
    gloo = None
    if use_gloo_process_groups:
        gloo = parallel_state.get_expert_data_parallel_group_gloo(partial_expert_data_parallel=True)
    return dict(
        model_parallel_group=parallel_state.get_expert_tensor_model_pipeline_parallel_group(),
        data_parallel_group=parallel_state.get_expert_data_parallel_group(partial_expert_data_parallel=True),
        data_parallel_group_gloo=gloo,
    )


def _intra_distributed_optimizer_group(config: OptimizerConfig):
    if not config.use_distributed_optimizer or not _dist_ready():
        return None
    return parallel_state.get_intra_distributed_optimizer_instance_group()


def _build_dense_optimizers(config, dense_chunk_lists, overlap_flags, group_kwargs, use_gloo_process_groups):
    """One optimizer per list of dense model chunks (two when chunk 0 overlaps its param gather)."""
    dense_groups = _dense_groups(use_gloo_process_groups)
    dense_idx = _group_rank(dense_groups["model_parallel_group"])
    instance_id = _distributed_optimizer_instance_id()
    intra_group = _intra_distributed_optimizer_group(config)
    optimizers = []
    for offset, (chunks, overlap) in enumerate(zip(dense_chunk_lists, overlap_flags)):
        param_groups, buffers = get_param_groups_and_buffers(
            chunks,
            model_chunk_offset=offset,
            filter_fn=lambda g: not g["is_expert_parallel"],
            buffer_name="buffers",
            **group_kwargs,
        )
        for chunk in chunks:
            chunk.overlap_param_gather_with_optimizer_step = overlap
        optimizers.append(
            _get_megatron_optimizer_based_on_param_groups(
                config,
                model_chunks=chunks,
                param_groups=param_groups,
                per_model_buffers=buffers,
                data_parallel_group_idx=dense_idx,
                intra_dist_opt_group=intra_group,
                distributed_optimizer_instance_id=instance_id,
                **dense_groups,
            )
        )
    return optimizers


def get_megatron_optimizer(
    config: OptimizerConfig,
    model_chunks: List[torch.nn.Module],
    no_weight_decay_cond: Optional[Callable] = None,
    scale_lr_cond: Optional[Callable] = None,
    lr_mult: float = 1.0,
    use_gloo_process_groups: bool = True,
    default_skip_embedding_weight_decay: bool = False,
) -> MegatronOptimizer:
    """Build the Megatron optimizer for `model_chunks` (a list of, usually DDP-wrapped, model chunks).

    `no_weight_decay_cond(name, param)` and `scale_lr_cond(name, param)` override the default
    grouping (no weight decay for biases and 1-D params; no LR scaling); `lr_mult` is the LR
    multiplier of params selected by `scale_lr_cond`.
    """
    _check_supported(config)
    logger.info("Setting up optimizer with config %s", config)
    if config.overlap_param_gather_with_optimizer_step:
        dense_chunk_lists = [[model_chunks[0]], model_chunks[1:]]
        overlap_flags = [True, False]
    else:
        dense_chunk_lists = [model_chunks]
        overlap_flags = [False]
    group_kwargs = dict(
        config=config,
        no_weight_decay_cond=no_weight_decay_cond,
        scale_lr_cond=scale_lr_cond,
        lr_mult=lr_mult,
        default_skip_embedding_weight_decay=default_skip_embedding_weight_decay,
    )
    optimizers = _build_dense_optimizers(config, dense_chunk_lists, overlap_flags, group_kwargs, use_gloo_process_groups)
    expert_param_groups, expert_buffers = get_param_groups_and_buffers(
        model_chunks,
        model_chunk_offset=0,
        filter_fn=lambda g: g["is_expert_parallel"],
        buffer_name="expert_parallel_buffers",
        **group_kwargs,
    )
    if expert_param_groups:
        expert_groups = _expert_groups(use_gloo_process_groups)
        optimizers.append(
            _get_megatron_optimizer_based_on_param_groups(
                config,
                model_chunks=model_chunks,
                param_groups=expert_param_groups,
                per_model_buffers=expert_buffers,
                data_parallel_group_idx=_group_rank(expert_groups["model_parallel_group"]),
                intra_dist_opt_group=_intra_distributed_optimizer_group(config),
                distributed_optimizer_instance_id=_distributed_optimizer_instance_id(),
                **expert_groups,
            )
        )
    if len(optimizers) == 1:
        return optimizers[0]
    return ChainedOptimizer(optimizers)

