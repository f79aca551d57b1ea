"""`DistributedOptimizer`: ZeRO-1, the optimizer state sharded over data-parallel ranks.

Each DP rank owns one contiguous, equal-sized shard of every bucket of every DDP gradient buffer. It
keeps fp32 main params and Adam moments only for the parameter pieces inside its shards, so optimizer
memory per rank is about 1/DP. Per iteration: DDP reduce-scatters gradients into the shards
(`finish_grad_sync`), this optimizer steps on its shard and writes the result into the DDP parameter
buffer, and DDP all-gathers the buffer (`start_param_sync`, or per bucket in forward pre-hooks with
`overlap_param_gather`).

FP8 parameters (`--fp8-param-gather`): the masters are made, then each FP8 weight's FP8 bytes become its only
copy in the model (`_make_fp8_params_primary`); the step writes no model copy for them (the FP8 gather quantizes
the masters), and after the masters are loaded from a checkpoint the FP8 bytes are gathered from them again
(`_gather_fp8_params`), so training resumes exactly.

Vocabulary of ranges (Megatron's): "gbuf_world" is a range in the whole buffer, "gbuf_world_in_bucket"
the same relative to the bucket start, "gbuf_local" relative to this rank's shard, and "param" the part
of the flattened parameter that this rank owns.

Checkpoints: `state_dict()` holds only param_groups (+ the per-param Adam `step`) and the grad scaler;
tensors go through `get_parameter_state_dp_zero()` into `distrib_optim.pt` (legacy format), one fp32
`param`/`exp_avg`/`exp_avg_sq` tensor per buffer and dtype in buffer order without bucket padding,
gathered on DP rank 0 over the gloo DP group. Everything loads with `torch.load(weights_only=True)`.

Distributed checkpoints: `sharded_state_dict()` gives Megatron's `fully_sharded_model_space` layout by default: the
owned range of each model piece as a `flattened_range` ShardedTensor, which the torch_dist backend stores N-D
flattened and reads back at any TP/PP/DP, into this optimizer or a non-distributed one (`sharded_state.py`). With
`sharding_type="dp_zero_gather_scatter"` (or `metadata={"distrib_optim_sharding_type": ...}`) it gives Megatron's
layout for `--no-ckpt-fully-parallel-save`: ShardedObjects `optimizer.distributed.dp_group_idx_{model-parallel
rank}.{optimizer,grad_scaler}` (replica_id = DP rank) and `....param_state` (the `get_parameter_state_dp_zero()`
dict, written by DP rank 0), which loads only at the TP/PP it was saved with.
"""
import copy
import itertools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer, _timed
from megatron.core.optimizer.sharded_state import (
    DP_ZERO_SHARDING_TYPE,
    SHARDING_TYPE,
    SHARDING_TYPE_KEY,
    ensure_state,
    is_sharded_load,
    mark_for_loading,
    param_state_shards,
    param_to_sharded_map,
    state_tensors,
)

_STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
_MAIN_PARAM_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "shared", "allreduce")


class Range:
    """A [start, end) interval of a flat buffer or flattened parameter."""

    def __init__(self, start: int, end: int):
        self.start = start
        self.end = end
        self.size = end - start

    def normalize(self, start: int = 0) -> "Range":
        """The same size, starting at `start`."""
        return Range(start, start + self.size)

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"{self.start},{self.end} [{self.size}]"


def _copy_main_param_attributes(destination: torch.Tensor, source: torch.Tensor) -> None:
    for name in _MAIN_PARAM_ATTRIBUTES:
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))


class DistributedOptimizer(MixedPrecisionOptimizer):
    """Sharded (ZeRO-1) mixed-precision optimizer over DDP gradient buffers.

    Args:
        optimizer: the torch optimizer, built over the model params (its groups are re-pointed here to
            this rank's fp32 main-param shards).
        config: the OptimizerConfig.
        grad_scaler: loss scaler (None for bf16/fp32).
        init_state_fn: creates empty optimizer state (used before loading a checkpoint).
        model_chunks: the DDP-wrapped model chunks.
        per_model_buffers: {model chunk index: [DDP _ParamAndGradBuffer, ...]}.
        data_parallel_group: the group the state is sharded over (the DDP buffers' group).
        data_parallel_group_gloo: gloo twin of that group, used for checkpoint gathers/scatters.
        data_parallel_group_idx: this rank's index in the model-parallel group (for sharded checkpoints).
        distributed_optimizer_instance_id: which optimizer instance this rank belongs to.
    """

    def __init__(
        self,
        optimizer: Optional[torch.optim.Optimizer],
        config,
        grad_scaler,
        init_state_fn: Optional[Callable],
        model_chunks: List[torch.nn.Module],
        per_model_buffers: Dict[int, list],
        data_parallel_group,
        data_parallel_group_gloo=None,
        data_parallel_group_idx: Optional[int] = None,
        distributed_optimizer_instance_id: int = 0,
    ):
        super().__init__(optimizer, config, grad_scaler, init_state_fn)
        self.model_chunks = model_chunks
        self.ddp_config = model_chunks[0].ddp_config if model_chunks else None
        for chunk in model_chunks:
            if not chunk.ddp_config.use_distributed_optimizer:
                raise ValueError(
                    "OptimizerConfig.use_distributed_optimizer=True needs the model wrapped with "
                    "DistributedDataParallelConfig(use_distributed_optimizer=True) (--use-distributed-optimizer "
                    "sets both): the gradient buffers must be reduce-scattered and hold the parameters."
                )
        if per_model_buffers is None or not per_model_buffers:
            raise ValueError("DistributedOptimizer needs per_model_buffers (the DDP wrappers' .buffers)")
        if data_parallel_group is None:
            data_parallel_group = per_model_buffers[next(iter(per_model_buffers))][0].data_parallel_group
        self.per_model_buffers = per_model_buffers
        self.buffers = list(itertools.chain(*per_model_buffers.values()))
        self.data_parallel_group = data_parallel_group
        self.data_parallel_group_gloo = data_parallel_group_gloo
        self.data_parallel_group_idx = data_parallel_group_idx
        self.distributed_optimizer_instance_id = distributed_optimizer_instance_id
        self.gbuf_idx_to_model_idx_map = {}
        for gbuf_idx, model_idx in enumerate(
            model_idx for model_idx, buffers in per_model_buffers.items() for _ in buffers
        ):
            self.gbuf_idx_to_model_idx_map[gbuf_idx] = model_idx
        for buffer in self.buffers:
            if buffer.data_parallel_world_size != data_parallel_group.size():
                raise ValueError(
                    f"DDP buffer is sharded over {buffer.data_parallel_world_size} ranks but the distributed "
                    f"optimizer's data_parallel_group has {data_parallel_group.size()}: pass the same group"
                )

        self.gbuf_ranges = [self._build_gbuf_range_map(buffer) for buffer in self.buffers]
        self.model_param_gbuf_map = self._build_model_param_gbuf_map(self.gbuf_ranges)
        if self.is_stub_optimizer:
            self.model_param_group_index_map, self.opt_group_ranges = {}, []
            self.model_float16_groups, self.model_fp32_groups = [], []
            self.shard_float16_groups, self.shard_fp32_groups, self.shard_fp32_from_float16_groups = [], [], []
            self.model_param_to_main_param = {}
            self._make_fp8_params_primary()
            return
        self.model_param_group_index_map, self.opt_group_ranges = self._build_optimizer_group_ranges(
            self.optimizer.param_groups, self.gbuf_ranges
        )
        self._build_model_and_main_param_groups()
        shard_groups = [group_range["orig_group"] for group_range in self.opt_group_ranges]
        if isinstance(self.optimizer, HybridDeviceOptimizer):
            # Megatron's rebuild: the hybrid optimizer splits the shards (not the full params) host/device.
            self.optimizer = HybridDeviceOptimizer(params=shard_groups, **self.optimizer.defaults)
        else:
            self.optimizer.param_groups = shard_groups
        self._make_fp8_params_primary()

    def _make_fp8_params_primary(self) -> None:
        """`--fp8-param-gather`: now that the fp32 masters exist, each FP8 parameter's FP8 copy becomes its only
        copy in the model (`fp8.params`, "FP8-primary parameters"), and its module's state dict saves the
        dequantized values and quantizes what it loads."""
        if self.ddp_config is None or not self.ddp_config.fp8_param_gather:
            return
        for buffer in self.buffers:
            buffer.make_fp8_params_primary(self.model_chunks)

    def _gather_fp8_params(self) -> None:
        """After the masters were loaded: the FP8 copies quantized from them again (exactly those training had)."""
        if self.ddp_config is not None and self.ddp_config.fp8_param_gather:
            for buffer in self.buffers:
                buffer.gather_fp8_params()

    # ----------------------------------------------------------------------------------------------
    # Shard layout
    # ----------------------------------------------------------------------------------------------

    @classmethod
    def _build_model_gbuf_param_range_map(cls, param_world_index_map, gbuf_world_range: Range, bucket_offset: int):
        """For every param overlapping this rank's shard: its ranges (see the module docstring)."""
        param_range_map = {}
        for param, (param_world_start, param_world_end, _) in param_world_index_map.items():
            param_local_start = max(0, param_world_start - gbuf_world_range.start)
            param_local_end = min(gbuf_world_range.size, param_world_end - gbuf_world_range.start)
            if param_local_end <= param_local_start:
                continue
            param_local_range = Range(param_local_start, param_local_end)
            param_world_range = param_local_range.normalize(param_local_start + gbuf_world_range.start)
            param_world_range_in_bucket = Range(
                param_world_range.start - bucket_offset, param_world_range.end - bucket_offset
            )
            sub_param_start = max(0, gbuf_world_range.start - param_world_start)
            param_range_map[param] = {
                "gbuf_world": param_world_range,
                "gbuf_world_in_bucket": param_world_range_in_bucket,
                "gbuf_local": param_local_range,
                "param": param_local_range.normalize(sub_param_start),
            }
        return param_range_map

    @classmethod
    def _build_model_gbuf_range(cls, param_and_grad_buffer, bucket_index: int):
        """This rank's shard of one bucket and the param pieces inside it."""
        data_parallel_rank = dist.get_rank(param_and_grad_buffer.data_parallel_group)
        data_parallel_world_size = param_and_grad_buffer.data_parallel_group.size()
        bucket = param_and_grad_buffer.buckets[bucket_index]
        gbuf_size = bucket.grad_data.numel()
        if gbuf_size % data_parallel_world_size != 0:
            raise ValueError(f"bucket of {gbuf_size} elements is not divisible by DP size {data_parallel_world_size}")
        shard_size = gbuf_size // data_parallel_world_size
        start = data_parallel_rank * shard_size + bucket.offset
        gbuf_world_range = Range(start, start + shard_size)
        bucket_params = {p: param_and_grad_buffer.param_index_map[p] for p in bucket.params_list}
        return {"param_map": cls._build_model_gbuf_param_range_map(bucket_params, gbuf_world_range, bucket.offset)}

    @classmethod
    def _build_gbuf_range_map(cls, param_and_grad_buffer):
        """{(param dtype, grad dtype): [per-bucket range map]} for one buffer."""
        key = (param_and_grad_buffer.param_dtype, param_and_grad_buffer.grad_dtype)
        return {
            key: [
                cls._build_model_gbuf_range(param_and_grad_buffer, bucket_index)
                for bucket_index in range(len(param_and_grad_buffer.buckets))
            ]
        }

    @classmethod
    def _build_model_param_gbuf_map(cls, gbuf_ranges) -> Dict[torch.nn.Parameter, Tuple[int, tuple, int]]:
        """param -> (buffer index, dtype key, bucket index), for params this rank owns a piece of."""
        param_gbuf_map = {}
        for gbuf_index, gbuf_range_map in enumerate(gbuf_ranges):
            for dtype, per_bucket in gbuf_range_map.items():
                for bucket_index, bucket_range_map in enumerate(per_bucket):
                    for param in bucket_range_map["param_map"]:
                        param_gbuf_map[param] = (gbuf_index, dtype, bucket_index)
        return param_gbuf_map

    @classmethod
    def _build_optimizer_group_ranges(cls, param_groups: List[Dict], gbuf_ranges):
        """Which optimizer group every locally owned param belongs to, and its order there."""
        world_param_group_map = {}
        for group_index, group in enumerate(param_groups):
            for param in group["params"]:
                if not param.requires_grad:
                    raise ValueError("optimizer param groups must only hold params with requires_grad=True")
                world_param_group_map[param] = group_index
        local_param_group_map = {}
        group_ranges = [{"params": []} for _ in param_groups]
        for gbuf_range_map in gbuf_ranges:
            for per_bucket in gbuf_range_map.values():
                for bucket_range_map in per_bucket:
                    for param in bucket_range_map["param_map"]:
                        if param not in world_param_group_map:
                            raise ValueError(
                                "a parameter in the DDP gradient buffers is in no optimizer param group: build the "
                                "optimizer over the same model chunks (and params) that DDP wraps"
                            )
                        group_range = group_ranges[world_param_group_map[param]]
                        group_range["params"].append(param)
                        local_param_group_map[param] = (world_param_group_map[param], len(group_range["params"]) - 1)
        for group_index, group_range in enumerate(group_ranges):
            group_range["orig_group"] = param_groups[group_index]
            group_range["orig_group_idx"] = group_index
        return local_param_group_map, group_ranges

    def _get_model_param_range_map(self, param: torch.nn.Parameter):
        gbuf_index, dtype, bucket_index = self.model_param_gbuf_map[param]
        return self.gbuf_ranges[gbuf_index][dtype][bucket_index]["param_map"][param]

    def _build_model_and_main_param_groups(self):
        """Create the fp32 main-param shards and re-point every optimizer group at them."""
        self.model_float16_groups, self.model_fp32_groups = [], []
        self.shard_float16_groups, self.shard_fp32_groups, self.shard_fp32_from_float16_groups = [], [], []
        self.model_param_to_main_param: Dict[torch.nn.Parameter, torch.Tensor] = {}
        for group_range in self.opt_group_ranges:
            model_float16, model_fp32, shard_float16, shard_fp32, shard_main16 = [], [], [], [], []
            for model_param in group_range["params"]:
                param_range = self._get_model_param_range_map(model_param)["param"]
                # [*param.shape] -> [numel], then this rank's piece (of the dequantized FP8 values when they are
                # the parameter's only copy: an optimizer built again over an FP8-parameter model).
                values = model_param.fp8_weight_copy.dequantized(torch.float32) \
                    if getattr(model_param, "fp8_primary", False) else model_param.detach()
                shard_model_param = values.view(-1)[param_range.start : param_range.end]
                # An FP8 parameter's model copy is its FP8 bytes, gathered from its fp32 master.
                fp8_param = bool(getattr(model_param, "fp8_param", False)) and self.ddp_config is not None \
                    and self.ddp_config.fp8_param_gather
                if model_param.dtype in (torch.float16, torch.bfloat16) or fp8_param:
                    # The precision-aware optimizer steps the model shard itself (it keeps its own fp32 copy).
                    precision_aware = self.config.use_precision_aware_optimizer and not fp8_param
                    shard_main_param = shard_model_param if precision_aware else shard_model_param.clone().float()
                    model_float16.append(model_param)
                    # an FP8 parameter's model copy is its FP8 bytes (`_make_fp8_params_primary`): no view to keep
                    shard_float16.append(None if fp8_param else shard_model_param)
                    shard_main16.append(shard_main_param)
                elif model_param.dtype == torch.float32:
                    shard_main_param = shard_model_param
                    model_fp32.append(model_param)
                    shard_fp32.append(shard_model_param)
                else:
                    raise TypeError(
                        f"Wrapped parameters must be torch.float16, torch.bfloat16 or torch.float32; got {model_param.dtype}"
                    )
                _copy_main_param_attributes(shard_main_param, model_param)
                if fp8_param:  # the FP8 gather quantizes this rank's piece from the fp32 master, as Megatron does
                    model_param.fp8_main_shard = shard_main_param
                self.model_param_to_main_param[model_param] = shard_main_param
            self.model_float16_groups.append(model_float16)
            self.model_fp32_groups.append(model_fp32)
            self.shard_float16_groups.append(shard_float16)
            self.shard_fp32_groups.append(shard_fp32)
            self.shard_fp32_from_float16_groups.append(shard_main16)
            group_range["orig_group"]["params"] = [*shard_fp32, *shard_main16]

    # ----------------------------------------------------------------------------------------------
    # Step
    # ----------------------------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True):
        """Drop the grads of main shards and model params (DDP zeroes its own buffers)."""
        groups = (
            self.model_float16_groups,
            self.model_fp32_groups,
            self.shard_float16_groups,
            self.shard_fp32_groups,
            self.shard_fp32_from_float16_groups,
        )
        for group in itertools.chain(*groups):
            for param in group:
                if param is None:  # an FP8 parameter's (absent) model shard
                    continue
                if getattr(param, "decoupled_grad", None) is not None:
                    param.decoupled_grad = None
                if param.grad is None:
                    continue
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_()
                    param.grad.zero_()

    def _collect_main_grad_data_for_unscaling(self) -> List[torch.Tensor]:
        attr = "decoupled_grad" if self.config.use_precision_aware_optimizer else "grad"
        grads = (getattr(param, attr, None) for group in self.optimizer.param_groups for param in group["params"])
        return [grad.data for grad in grads if grad is not None]

    def _get_main_params_and_model_data_float16(self):
        """(this rank's fp32 main shards, the matching pieces of the DDP parameter buffer they are copied to);
        nothing with the precision-aware optimizer, which writes the model shards itself."""
        main_params, model_data = [], []
        if self.config.use_precision_aware_optimizer:
            return main_params, model_data
        for model_group, main_group in zip(self.shard_float16_groups, self.shard_fp32_from_float16_groups):
            for model_shard, main_param in zip(model_group, main_group):
                if model_shard is not None:  # FP8 parameters are gathered from their masters as FP8 bytes
                    main_params.append(main_param)
                    model_data.append(model_shard.data)
        return main_params, model_data

    def _copy_model_grads_to_main_grads(self):
        """Point every main shard's .grad at its (reduce-scattered) piece of DDP's main_grad, in fp32."""
        for model_group, main_group in itertools.chain(
            zip(self.model_float16_groups, self.shard_fp32_from_float16_groups),
            zip(self.model_fp32_groups, self.shard_fp32_groups),
        ):
            for model_param, main_param in zip(model_group, main_group):
                param_range = self._get_model_param_range_map(model_param)["param"]
                # [*param.shape] -> [numel], then this rank's piece.
                shard_grad = model_param.main_grad.view(-1)[param_range.start : param_range.end]
                if self.config.use_precision_aware_optimizer:
                    main_param.decoupled_grad = shard_grad
                else:
                    main_param.grad = shard_grad.float()

    def _copy_model_params_to_main_params(self) -> None:
        """Refresh main params from the model params (the hybrid optimizer refreshes its own copies)."""
        if not self.config.use_precision_aware_optimizer:
            super()._copy_model_params_to_main_params()
        for model_param, main_param, start, stop in self._model_and_main_params():
            if getattr(model_param, "fp8_primary", False):  # the model holds FP8 values only (`fp8.params`)
                values = model_param.fp8_weight_copy.dequantized(torch.float32)
                main_param.data.copy_(values.view(-1)[start:stop])  # [*shape] -> [numel], this rank's piece
        if isinstance(self.optimizer, HybridDeviceOptimizer):
            self.optimizer.update_fp32_param_by_new_param()

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Step the shard, then all-gather the updated params (deferred to forward pre-hooks with overlap)."""
        update_successful = super().step_with_ready_grads()
        with _timed(self.config, "params-all-gather"):
            if self.config.overlap_param_gather_with_optimizer_step:
                for model_chunk in self.model_chunks:
                    model_chunk.start_param_sync(force_dispatch=True)
            elif not self.ddp_config.overlap_param_gather:
                for model_chunk in self.model_chunks:
                    model_chunk.start_param_sync()
        return update_successful

    # ----------------------------------------------------------------------------------------------
    # Checkpointing
    # ----------------------------------------------------------------------------------------------

    def _model_and_main_params(self) -> List[Tuple[torch.Tensor, torch.Tensor, int, int]]:
        pairs = []
        for group_range in self.opt_group_ranges:
            for model_param in group_range["params"]:
                param_range = self._get_model_param_range_map(model_param)["param"]
                pairs.append((model_param, self.model_param_to_main_param[model_param], param_range.start,
                              param_range.end))
        return pairs

    def _main_params_in_group_order(self, group_index: int) -> List[torch.Tensor]:
        return self.optimizer.param_groups[group_index]["params"]

    def state_dict(self) -> Dict[str, Any]:
        """param_groups without params (plus Adam's `step`, which torch keeps per param) and the scaler."""
        state_dict: Dict[str, Any] = {}
        if not self.is_stub_optimizer:
            inner = self.optimizer.state_dict()
            groups = []
            for group_index, group in enumerate(inner["param_groups"]):
                saved = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
                step = self._group_step(group_index)
                if step is not None:
                    saved["step"] = step
                groups.append(saved)
            state_dict["optimizer"] = {"param_groups": groups}
        if self.grad_scaler is not None:
            state_dict["grad_scaler"] = self.grad_scaler.state_dict()
        return state_dict

    def _group_step(self, group_index: int) -> Optional[float]:
        """Adam's step of a group, as the float Megatron stores in the group."""
        for param in self._main_params_in_group_order(group_index):
            step = self.optimizer.state.get(param, {}).get("step")
            if step is not None:
                return float(step.item()) if torch.is_tensor(step) else float(step)
        return None

    def _ensure_optimizer_state(self):
        """Create empty state (zeros, step 0) for every main shard that has none yet."""
        ensure_state(self.optimizer, self.init_state_fn, self.config)

    def _params_in_buffer_order(self) -> List[Tuple[torch.Tensor, int, int]]:
        """(model param, owned flat start, owned flat stop) of every param piece this rank owns, in the order of
        the gradient buffers and their buckets (Megatron numbers `param_state` entries in this order)."""
        pieces = []
        for gbuf_range_maps in self.gbuf_ranges:
            for per_bucket in gbuf_range_maps.values():
                for bucket_range_map in per_bucket:
                    for model_param, ranges in bucket_range_map["param_map"].items():
                        pieces.append((model_param, ranges["param"].start, ranges["param"].end))
        return pieces

    def sharded_state_dict(self, model_sharded_state_dict: Dict, is_loading: bool = False,
                           sharding_type: Optional[str] = None, metadata: Optional[Dict] = None,
                           **kwargs) -> Dict[str, Any]:
        """Distributed-checkpoint state in Megatron's default `fully_sharded_model_space` layout, or its
        `dp_zero_gather_scatter` layout when `sharding_type` or `metadata["distrib_optim_sharding_type"]` asks for
        it (collective over the DP group when saving: DP rank 0 gathers the state).

        `fully_sharded_model_space`: `state_dict()` (param groups with `step`, grad scaler) plus `param_state`,
        {i: {"fp32_param", "exp_avg", "exp_avg_sq": the owned range of each model piece as a `flattened_range`
        ShardedTensor, "step"}} numbered in buffer order; the tensors are views of this rank's shards."""
        if sharding_type is None:
            sharding_type = (metadata or {}).get("distrib_optim_sharding_type", SHARDING_TYPE)
        if sharding_type == DP_ZERO_SHARDING_TYPE:
            return self._dp_zero_sharded_state_dict(is_loading)
        if sharding_type != SHARDING_TYPE:
            raise ValueError(f"sharding_type={sharding_type!r}: the distributed optimizer writes "
                             f"{SHARDING_TYPE!r} or {DP_ZERO_SHARDING_TYPE!r}")
        if self.is_stub_optimizer:
            return mark_for_loading({SHARDING_TYPE_KEY: SHARDING_TYPE})
        self._ensure_optimizer_state()
        state = self.state_dict()
        param_map = param_to_sharded_map(model_sharded_state_dict)
        param_state = {}
        for index, (model_param, start, stop) in enumerate(self._params_in_buffer_order()):
            main_param = self.model_param_to_main_param[model_param]
            entry = param_state_shards(model_param, start, stop, state_tensors(self.optimizer, main_param),
                                       param_map, sharded_over_dp=True,
                                       instance_id=self.distributed_optimizer_instance_id)
            step = self.optimizer.state.get(main_param, {}).get("step")
            if step is not None:
                entry["step"] = step.detach().clone() if torch.is_tensor(step) else step
            param_state[index] = entry
        state["param_state"] = param_state
        state[SHARDING_TYPE_KEY] = SHARDING_TYPE
        return mark_for_loading(state)

    def _dp_zero_sharded_state_dict(self, is_loading: bool) -> Dict[str, Any]:
        """Megatron's `dp_zero_gather_scatter` layout (see the module docstring)."""
        prefix = f"optimizer.distributed.dp_group_idx_{self.data_parallel_group_idx or 0}"
        dp_rank = dist.get_rank(self.data_parallel_group)
        state: Dict[str, Any] = {SHARDING_TYPE_KEY: DP_ZERO_SHARDING_TYPE}
        for key, value in self.state_dict().items():
            # [1] global shape, one shard; every DP rank holds a replica, DP rank 0 writes it.
            state[key] = ShardedObject(f"{prefix}.{key}", value, (1,), (0,), replica_id=dp_rank)
        param_state = None if is_loading else self.get_parameter_state_dp_zero()
        if dp_rank == 0:
            state["param_state"] = ShardedObject(f"{prefix}.param_state", param_state, (1,), (0,), replica_id=0)
        else:
            # Other DP ranks neither write nor read it; the load scatters DP rank 0's copy.
            state["param_state"] = LocalNonpersistentObject(None)
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore param_groups (and the Adam step) and the grad scaler; tensors come from
        `load_parameter_state` / `load_parameter_state_from_dp_zero`, or from a distributed load (in place
        for the model-space layout, scattered from DP rank 0 for `dp_zero_gather_scatter`)."""
        if state_dict.get(SHARDING_TYPE_KEY) == DP_ZERO_SHARDING_TYPE:
            self.load_state_dict({k: state_dict[k] for k in ("optimizer", "grad_scaler") if k in state_dict})
            self.load_parameter_state_from_dp_zero(state_dict.get("param_state"))
            return
        if is_sharded_load(state_dict):
            self._load_sharded_common(state_dict)
            self._gather_fp8_params()
            return
        if not self.is_stub_optimizer:
            self._ensure_optimizer_state()
            inner = self.optimizer.state_dict()
            saved_groups = state_dict["optimizer"]["param_groups"]
            if len(saved_groups) != len(inner["param_groups"]):
                raise ValueError(
                    f"checkpoint has {len(saved_groups)} optimizer param groups, this run has "
                    f"{len(inner['param_groups'])}: the parameter grouping (weight decay / lr multipliers) must match"
                )
            groups = []
            for current, saved in zip(inner["param_groups"], saved_groups):
                merged = {**{k: v for k, v in current.items() if k != "params"}, **saved, "params": current["params"]}
                step = merged.pop("step", None)
                if step is not None:
                    for index in current["params"]:
                        entry = inner["state"].get(index)
                        if entry is not None and "step" in entry:
                            old = entry["step"]
                            entry["step"] = torch.full_like(old, float(step)) if torch.is_tensor(old) else step
                groups.append(merged)
            self.optimizer.load_state_dict({"state": inner["state"], "param_groups": groups})
        if "grad_scaler" in state_dict and self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def _checkpoint_group_and_device(self):
        """Gloo DP group on CPU when available, else the DP group itself on the current device."""
        if self.data_parallel_group_gloo is not None:
            return self.data_parallel_group_gloo, torch.device("cpu")
        if dist.get_backend(self.data_parallel_group) == "gloo":
            return self.data_parallel_group, torch.device("cpu")
        return self.data_parallel_group, torch.device("cuda", torch.cuda.current_device())

    def _main_param_and_optimizer_states(self, model_param) -> Dict[str, torch.Tensor]:
        main_param = self.model_param_to_main_param[model_param]
        state = self.optimizer.state[main_param]
        # The hybrid optimizer keeps the fp32 copy it steps (on the host or the device) as `master_param`.
        main_param = state.get("master_param", main_param)
        return {"param": main_param, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}

    def get_parameter_state_dp_zero(self) -> Optional[Dict]:
        """Gather fp32 params and Adam moments on DP rank 0 (None elsewhere), in Megatron's coalesced
        layout: {"buckets_coalesced": True, buffer index: {(param dtype, grad dtype): {"param",
        "exp_avg", "exp_avg_sq" (fp32, buffer order, no bucket padding), "numel_unpadded"}}}."""
        group, device = self._checkpoint_group_and_device()
        dp_size = group.size()
        dp_rank = dist.get_rank(group)
        root = dist.get_global_rank(group, 0)
        if not self.is_stub_optimizer:
            self._ensure_optimizer_state()
        state: Dict[Any, Any] = {"buckets_coalesced": True}
        for gbuf_idx, gbuf_range_maps in enumerate(self.gbuf_ranges):
            dtype_state = {}
            for dtype, per_bucket in gbuf_range_maps.items():
                buffer = self.buffers[gbuf_idx]
                world = {}
                if dp_rank == 0:
                    world = {k: torch.zeros(buffer.numel_unpadded, dtype=torch.float32) for k in _STATE_KEYS}
                    world["numel_unpadded"] = buffer.numel_unpadded
                offset = 0
                for bucket_idx, bucket_range_map in enumerate(per_bucket):
                    bucket = buffer.buckets[bucket_idx]
                    shard_numel = bucket.grad_data.numel() // dp_size
                    local = {k: torch.zeros(shard_numel, dtype=torch.float32, device=device) for k in _STATE_KEYS}
                    for model_param, ranges in bucket_range_map["param_map"].items():
                        tensors = self._main_param_and_optimizer_states(model_param)
                        local_range = ranges["gbuf_local"]
                        for key in _STATE_KEYS:
                            local[key][local_range.start : local_range.end].copy_(tensors[key].detach())
                    for key in _STATE_KEYS:
                        gathered = None
                        if dp_rank == 0:
                            gathered = [torch.empty(shard_numel, dtype=torch.float32, device=device) for _ in range(dp_size)]
                        dist.gather(local[key], gathered, dst=root, group=group)
                        if dp_rank == 0:
                            flat = torch.cat(gathered).cpu()
                            world[key][offset : offset + bucket.numel_unpadded].copy_(flat[: bucket.numel_unpadded])
                    offset += bucket.numel_unpadded
                dtype_state[dtype] = world
            state[gbuf_idx] = dtype_state
        return state if dp_rank == 0 else None

    def load_parameter_state_from_dp_zero(self, state_dict: Optional[Dict], *, update_legacy_format: bool = False):
        """Scatter a `get_parameter_state_dp_zero()` dict (given on DP rank 0) into this rank's shards."""
        group, device = self._checkpoint_group_and_device()
        dp_size = group.size()
        dp_rank = dist.get_rank(group)
        root = dist.get_global_rank(group, 0)
        if dp_rank == 0:
            self._check_dp_zero_state(state_dict)
        if not self.is_stub_optimizer:
            self._ensure_optimizer_state()
        for gbuf_idx, gbuf_range_maps in enumerate(self.gbuf_ranges):
            for dtype, per_bucket in gbuf_range_maps.items():
                buffer = self.buffers[gbuf_idx]
                for key in _STATE_KEYS:
                    offset = 0
                    for bucket_idx, bucket_range_map in enumerate(per_bucket):
                        bucket = buffer.buckets[bucket_idx]
                        bucket_numel = bucket.grad_data.numel()
                        shard_numel = bucket_numel // dp_size
                        received = torch.empty(shard_numel, dtype=torch.float32, device=device)
                        pieces = None
                        if dp_rank == 0:
                            world = state_dict[gbuf_idx][dtype][key][offset : offset + bucket.numel_unpadded]
                            padded = torch.nn.functional.pad(world.float(), (0, bucket_numel - bucket.numel_unpadded))
                            pieces = [t.to(device).contiguous() for t in padded.split(shard_numel)]
                        offset += bucket.numel_unpadded
                        dist.scatter(received, pieces, src=root, group=group)
                        for model_param, ranges in bucket_range_map["param_map"].items():
                            target = self._main_param_and_optimizer_states(model_param)[key]
                            local_range = ranges["gbuf_local"]
                            target.data.copy_(received[local_range.start : local_range.end])
        self._gather_fp8_params()

    def _check_dp_zero_state(self, state_dict: Optional[Dict]):
        if state_dict is None:
            raise ValueError("DP rank 0 needs the distributed-optimizer parameter state to scatter (got None)")
        if not state_dict.get("buckets_coalesced", False):
            raise ValueError(
                "distrib_optim.pt uses Megatron's pre-0.8 per-bucket layout, which this framework does not read: "
                "re-save it with a newer Megatron-LM or convert it with tools/checkpoint"
            )
        for gbuf_idx, gbuf_range_maps in enumerate(self.gbuf_ranges):
            for dtype in gbuf_range_maps:
                if gbuf_idx not in state_dict or dtype not in state_dict[gbuf_idx]:
                    raise ValueError(
                        f"distrib_optim.pt has no state for buffer {gbuf_idx} with dtypes {dtype}: the model, its "
                        "precision flags (--bf16/--fp16, --accumulate-allreduce-grads-in-fp32) or its layout differ"
                    )
                expected = self.buffers[gbuf_idx].numel_unpadded
                found = state_dict[gbuf_idx][dtype]["numel_unpadded"]
                if expected != found:
                    raise ValueError(
                        f"Number of unpadded elements must be same in current run ({expected}) and checkpoint "
                        f"({found}) for buffer {gbuf_idx}: the model or the DDP settings differ"
                    )

    def save_parameter_state(self, filename: str):
        """Write `distrib_optim.pt` (DP rank 0 gathers and saves; every DP rank must call this)."""
        state_dict = self.get_parameter_state_dp_zero()
        if dist.get_rank(self.data_parallel_group) == 0:
            torch.save(state_dict, filename)

    def load_parameter_state(self, filename: str, *, update_legacy_format: bool = False):
        """Read `distrib_optim.pt` on DP rank 0 (weights_only) and scatter it; every DP rank must call this."""
        state_dict = None
        if dist.get_rank(self.data_parallel_group) == 0:
            state_dict = torch.load(filename, map_location="cpu", weights_only=True)
        self.load_parameter_state_from_dp_zero(state_dict, update_legacy_format=update_legacy_format)

    def get_parameter_state_local(self) -> Dict[str, Any]:
        """This rank's own shard of fp32 params and Adam moments, with no communication (local
        non-persistent checkpoints): {"param"/"exp_avg"/"exp_avg_sq": [cpu tensors in
        `_model_and_main_params` order], "numels": [shard sizes]}."""
        if not self.is_stub_optimizer:
            self._ensure_optimizer_state()
        pairs = self._model_and_main_params()
        state: Dict[str, Any] = {"numels": [stop - start for _, _, start, stop in pairs]}
        for key in _STATE_KEYS:
            state[key] = [self._main_param_and_optimizer_states(model_param)[key].detach().cpu().clone()
                          for model_param, _, _, _ in pairs]
        return state

    def load_parameter_state_local(self, state: Dict[str, Any]) -> None:
        """Restore `get_parameter_state_local()` of the same rank and layout; raises naming the mismatch."""
        if not self.is_stub_optimizer:
            self._ensure_optimizer_state()
        pairs = self._model_and_main_params()
        numels = [stop - start for _, _, start, stop in pairs]
        if state.get("numels") != numels:
            raise ValueError(
                f"the local optimizer state holds shards of sizes {state.get('numels')} but this rank owns "
                f"{numels}: the model, the DDP bucketing or the data-parallel layout differ from the run that "
                "saved it")
        for key in _STATE_KEYS:
            for (model_param, _, _, _), saved in zip(pairs, state[key]):
                target = self._main_param_and_optimizer_states(model_param)[key]
                target.detach().copy_(saved.view_as(target))
        self._copy_main_params_to_model_params()
        self._gather_fp8_params()
