"""`DistributedDataParallel`: Megatron's bucketed data parallelism with optional overlap.

Every trainable parameter gets `.main_grad`, a view into a contiguous gradient buffer per
(param dtype, grad dtype). A post-accumulate-grad hook moves `param.grad` into `main_grad` (layers using
gradient-accumulation fusion add their weight gradient there directly and flag
`grad_added_to_main_grad`) and frees `param.grad`. With `overlap_grad_reduce`, a bucket's collective
starts as soon as its last gradient is ready; otherwise all collectives run in `finish_grad_sync`.

Gradient scaling (design note "one place for 1/DP"): unless the loss is per-token, gradients are
multiplied by 1/(DP*CP) right before a SUM collective (or the collective averages when
`average_in_collective`); per-token loss leaves them unscaled and `finalize_model_grads` divides by
the global token count.
"""
from contextlib import contextmanager
from typing import Dict, List

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.fusions.fused_grad_accumulation import accumulate_grad_
from megatron.core.distributed.param_and_grad_buffer import (
    _ParamAndGradBucketGroup,
    _ParamAndGradBuffer,
    partition_buckets,
)

_DEFAULT_MIN_BUCKET_SIZE = 40_000_000
_DEFAULT_BUCKET_SIZE_PER_DP_RANK = 1_000_000


class _CommGroups:
    """The process groups DDP communicates over, resolved once (explicit groups or parallel_state)."""

    def __init__(self, ddp_config: DistributedDataParallelConfig, grad_comm_pgs, model_comm_pgs):
        if (grad_comm_pgs is None) != (model_comm_pgs is None):
            raise ValueError(
                "DistributedDataParallel: grad_comm_pgs and model_comm_pgs must both be given or both be None "
                f"(got grad_comm_pgs={grad_comm_pgs!r}, model_comm_pgs={model_comm_pgs!r})"
            )
        self._explicit = grad_comm_pgs
        if grad_comm_pgs is None:
            self.dp = parallel_state.get_data_parallel_group(with_context_parallel=False)
            self.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
            self.intra_dp_cp = parallel_state.get_data_parallel_group(
                with_context_parallel=True, partial_data_parallel=True
            )
            self.inter_dist_opt = None
            if ddp_config.num_distributed_optimizer_instances > 1:
                self.inter_dist_opt = parallel_state.get_inter_distributed_optimizer_instance_group()
            self.tp = parallel_state.get_tensor_model_parallel_group()
            self.pp = parallel_state.get_pipeline_model_parallel_group()
        else:
            if getattr(grad_comm_pgs, "dp", None) is None:
                raise ValueError("dp process group is required but not provided in grad_comm_pgs")
            self.dp = grad_comm_pgs.dp
            self.dp_cp = getattr(grad_comm_pgs, "dp_cp", None) or self.dp
            self.intra_dp_cp = getattr(grad_comm_pgs, "intra_dp_cp", None) or self.dp_cp
            self.inter_dist_opt = getattr(grad_comm_pgs, "inter_dist_opt", None)
            if ddp_config.num_distributed_optimizer_instances > 1 and self.inter_dist_opt is None:
                raise ValueError(
                    "num_distributed_optimizer_instances > 1 needs grad_comm_pgs.inter_dist_opt (the group that "
                    "all-reduces gradients across optimizer instances)"
                )
            self.tp = getattr(model_comm_pgs, "tp", None)
            self.pp = getattr(model_comm_pgs, "pp", None)

    def expert_groups(self):
        """(expt_dp, intra_expt_dp); resolved only when the model has expert-parallel parameters."""
        if self._explicit is not None:
            expt_dp = getattr(self._explicit, "expt_dp", None)
            if expt_dp is None:
                raise ValueError("the model has expert-parallel parameters but grad_comm_pgs.expt_dp is missing")
            return expt_dp, getattr(self._explicit, "intra_expt_dp", None) or expt_dp
        return (
            parallel_state.get_expert_data_parallel_group(),
            parallel_state.get_expert_data_parallel_group(partial_expert_data_parallel=True),
        )


class DistributedDataParallel(_BaseDataParallel):
    """Data-parallel wrapper with contiguous gradient buffers, bucketing and overlapped communication.

    Args:
        config: the model's TransformerConfig (reads `calculate_per_token_loss`).
        ddp_config: the DistributedDataParallelConfig.
        module: the model chunk to wrap.
        disable_bucketing: one bucket group for everything (used for all but the first model chunk).
        grad_comm_pgs / model_comm_pgs: explicit process groups (both or neither); None means parallel_state.
    """

    def __init__(
        self,
        config,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        disable_bucketing: bool = False,
        grad_comm_pgs=None,
        model_comm_pgs=None,
    ):
        super().__init__(config=config, module=module)
        self.ddp_config = ddp_config
        self._groups = _CommGroups(ddp_config, grad_comm_pgs, model_comm_pgs)
        self.dp_group = self._groups.dp
        self.dp_cp_group = self._groups.dp_cp
        self.intra_dp_cp_group = self._groups.intra_dp_cp
        self.tp_group = self._groups.tp
        self.pp_group = self._groups.pp

        self.bucket_size = self._resolve_bucket_size(ddp_config, disable_bucketing)
        self.disable_bucketing = disable_bucketing

        self.param_to_bucket_group: Dict[torch.nn.Parameter, _ParamAndGradBucketGroup] = {}
        self.params_with_grad: List[torch.nn.Parameter] = []
        param_to_name: Dict[torch.nn.Parameter, str] = {}
        dense_params, expert_params = [], []
        for name, param in self.module.named_parameters():
            if not param.requires_grad:
                continue
            self.params_with_grad.append(param)
            param.grad_added_to_main_grad = False
            param_to_name[param] = name
            (dense_params if getattr(param, "allreduce", True) else expert_params).append(param)
        self.param_to_name = param_to_name

        dense_scale, expert_scale = self._gradient_scaling_factors(bool(expert_params))
        self.buffers, self.bucket_groups = self._allocate_buffers_for_parameters(
            dense_params, self.intra_dp_cp_group, dense_scale
        )
        self.expert_parallel_buffers, self.expert_parallel_bucket_groups = [], []
        if expert_params:
            self.expt_dp_group, self.intra_expt_dp_group = self._groups.expert_groups()
            self.expert_parallel_buffers, self.expert_parallel_bucket_groups = self._allocate_buffers_for_parameters(
                expert_params, self.intra_expt_dp_group, expert_scale
            )

        self._grad_hook_handles = [
            param.register_post_accumulate_grad_hook(self._make_backward_post_hook(param))
            for param in self.params_with_grad
        ]
        self.use_forward_hook = ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather
        self.remove_forward_pre_hook_handles: Dict[torch.nn.Module, object] = {}
        self.overlap_param_gather_with_optimizer_step = False
        if self.use_forward_hook:
            self.enable_forward_pre_hook()

    def _resolve_bucket_size(self, ddp_config: DistributedDataParallelConfig, disable_bucketing: bool):
        """Megatron's rule, including its writes to the shared config: an unset `bucket_size` becomes
        max(4e7, 1e6 x DP size) and is reset to None (one bucket) without `overlap_grad_reduce`; this
        wrapper then uses one bucket anyway when `disable_bucketing` or when it is not on the first
        pipeline stage (its gradient reduction is off the critical path there)."""
        if ddp_config.bucket_size is None:
            ddp_config.bucket_size = max(_DEFAULT_MIN_BUCKET_SIZE, _DEFAULT_BUCKET_SIZE_PER_DP_RANK * self.dp_group.size())
        if not ddp_config.overlap_grad_reduce:
            ddp_config.bucket_size = None
        pp_group = self.pp_group[0] if isinstance(self.pp_group, list) else self.pp_group
        pp_rank = pp_group.rank() if pp_group is not None else 0
        if disable_bucketing or pp_rank > 0:
            return None
        return ddp_config.bucket_size

    def _gradient_scaling_factors(self, has_expert_params: bool):
        """(dense, expert) pre-collective gradient multipliers; see the module docstring."""
        if getattr(self.config, "calculate_per_token_loss", False):
            if self.ddp_config.average_in_collective:
                raise ValueError(
                    "average_in_collective=True (--ddp-average-in-collective) cannot be combined with "
                    "calculate_per_token_loss=True (--calculate-per-token-loss): per-token loss must not be "
                    "averaged over DP; turn one of them off."
                )
            return 1.0, 1.0
        dp_cp_size = self.dp_cp_group.size()
        if self.ddp_config.average_in_collective:
            if not has_expert_params:
                return 1.0, 1.0
            expt_dp, _ = self._groups.expert_groups()
            return 1.0, expt_dp.size() / dp_cp_size
        return 1.0 / dp_cp_size, 1.0 / dp_cp_size

    def _allocate_buffers_for_parameters(self, input_params, data_parallel_group, gradient_scaling_factor):
        """One buffer per (param dtype, grad dtype); returns (buffers, bucket_groups)."""
        by_dtype: Dict[tuple, List[torch.nn.Parameter]] = {}
        indices: Dict[tuple, List[int]] = {}
        for param in input_params:
            grad_dtype = torch.float if self.ddp_config.grad_reduce_in_fp32 else param.dtype
            key = (param.dtype, grad_dtype)
            by_dtype.setdefault(key, []).append(param)
            indices.setdefault(key, []).append(len(indices.get(key, [])))
        buffers = [
            _ParamAndGradBuffer(
                self.ddp_config,
                param_dtype,
                grad_dtype,
                params,
                data_parallel_group,
                self.bucket_size,
                self.param_to_name,
                gradient_scaling_factor,
                indices[(param_dtype, grad_dtype)],
            )
            for (param_dtype, grad_dtype), params in by_dtype.items()
        ]
        bucket_groups = partition_buckets(buffers, force_single_bucket_group=self.disable_bucketing)
        for bucket_group in bucket_groups:
            bucket_group.inter_distributed_optimizer_instance_group = self._groups.inter_dist_opt
        if self.ddp_config.use_distributed_optimizer and self.ddp_config.overlap_param_gather:
            # Forward uses the last bucket first, so each group prefetches the one before it.
            for i in range(len(bucket_groups) - 1, 0, -1):
                bucket_groups[i].next_param_gather_bucket_group = bucket_groups[i - 1]
        for bucket_group in bucket_groups:
            for param in bucket_group.params:
                self.param_to_bucket_group[param] = bucket_group
        return buffers, bucket_groups

    @property
    def _all_bucket_groups(self):
        return self.bucket_groups + self.expert_parallel_bucket_groups

    def _make_backward_post_hook(self, param: torch.nn.Parameter):
        def hook(*unused):
            if param not in self.param_to_bucket_group:
                return
            if param.grad is not None and (
                not param.grad_added_to_main_grad or getattr(param, "zero_out_wgrad", False)
            ):
                accumulate_grad_(param.main_grad, param.grad.data)
            param.grad = None
            if self.ddp_config.overlap_grad_reduce:
                self.param_to_bucket_group[param].register_grad_ready(param)

        return hook

    def _make_forward_pre_hook(self):
        def hook(module, *unused):
            skip_next = self.ddp_config.align_param_gather or self.overlap_param_gather_with_optimizer_step
            for param in module.parameters(recurse=False):
                bucket_group = self.param_to_bucket_group.get(param)
                if bucket_group is not None:
                    bucket_group.finish_param_sync(skip_next_bucket_dispatch=skip_next)

        return hook

    def enable_forward_pre_hook(self):
        """Install the pre-hooks that wait for each bucket's parameter all-gather before use."""
        if not self.use_forward_hook:
            raise RuntimeError("forward pre-hooks are only used with the distributed optimizer and overlap_param_gather")
        if self.remove_forward_pre_hook_handles:
            raise RuntimeError("forward pre-hooks are already enabled")
        for module in self.module.modules():
            self.remove_forward_pre_hook_handles[module] = module.register_forward_pre_hook(
                self._make_forward_pre_hook()
            )

    def disable_forward_pre_hook(self, param_sync: bool = True):
        """Remove the pre-hooks; with `param_sync`, finish all parameter all-gathers now."""
        if not self.use_forward_hook:
            raise RuntimeError("forward pre-hooks are only used with the distributed optimizer and overlap_param_gather")
        for handle in self.remove_forward_pre_hook_handles.values():
            handle.remove()
        self.remove_forward_pre_hook_handles = {}
        if param_sync:
            self.start_param_sync(force_sync=True)

    @contextmanager
    def no_sync(self):
        """Accumulate gradients across microbatches without communicating."""
        for bucket_group in self._all_bucket_groups:
            bucket_group.is_last_microbatch = False
        try:
            yield
        finally:
            for bucket_group in self._all_bucket_groups:
                bucket_group.is_last_microbatch = True

    def start_param_sync(self, *unused, force_sync: bool = False, force_dispatch: bool = False):
        """All-gather the updated parameter shards (distributed optimizer); async with overlap_param_gather."""
        if not force_sync and self.overlap_param_gather_with_optimizer_step and not force_dispatch:
            return
        for bucket_group in self._all_bucket_groups:
            bucket_group.start_param_sync(force_sync=force_sync)

    def start_grad_sync(self, *unused):
        """Launch the gradient collectives of every bucket group."""
        for bucket_group in self._all_bucket_groups:
            bucket_group.start_grad_sync()

    def finish_grad_sync(self):
        """Finish (or, without overlap, run) the gradient all-reduce / reduce-scatter."""
        for bucket_group in self._all_bucket_groups:
            bucket_group.finish_grad_sync()

    def scale_gradients(self, scaling_factor):
        """Multiply every gradient in the buffers by `scaling_factor`."""
        for buffer in self.buffers + self.expert_parallel_buffers:
            buffer.scale_gradients(scaling_factor)

    def zero_grad_buffer(self):
        """Zero the gradient buffers and reset readiness tracking; call at the start of each iteration."""
        for param in self.params_with_grad:
            param.grad_added_to_main_grad = False
        for buffer in self.buffers + self.expert_parallel_buffers:
            buffer.reset()
        for bucket_group in self._all_bucket_groups:
            bucket_group.reset()

    def broadcast_params(self):
        """Make every data-parallel rank hold data-parallel rank 0's parameters."""
        for param in self.module.parameters():
            expert = not getattr(param, "allreduce", True)
            group = self.expt_dp_group if expert else self.dp_cp_group
            dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)

