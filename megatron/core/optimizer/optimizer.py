"""Megatron optimizer wrappers around a `torch.optim` optimizer.

- `MegatronOptimizer`: the interface the training loop uses (`step() -> (ok, grad_norm, num_zeros)`,
  `zero_grad`, loss scaling, grad-norm clipping, checkpoint state).
- `MixedPrecisionOptimizer`: the step of a model whose params are not the ones the torch optimizer
  updates (fp32 main params): copy grads to main grads, unscale and check for inf/nan, clip, step,
  copy main params back (a fused torch AdamW on CUDA writes the large model params in its step:
  `fused_adamw.py`). `DistributedOptimizer` (in `distrib_optimizer.py`) subclasses it.
- `Float16OptimizerWithFloat16Params`: fp16/bf16 model params with fp32 main copies.
- `FP32Optimizer`: fp32 params, stepped in place.
- `ChainedOptimizer` (`chained_optimizer.py`, importable from here too): several optimizers (e.g. dense
  and expert-parallel params) stepped as one, with one global grad norm.

Model grads are read from `param.main_grad` when the DDP wrapper attached one (a view into its grad
buffer), else from `param.grad`.
"""
import logging
from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.optimizer import fused_adamw
from megatron.core.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32_tensor,
    defer_clip_to_fused_adam,
    get_grad_norm_fp32_tensor,
    param_is_not_shared,
    param_is_not_tensor_parallel_duplicate,
)
from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.param_groups import PARAM_GROUP_IDENTIFIER_KEYS
from megatron.core.optimizer.sharded_state import (
    SHARDING_TYPE,
    ensure_state,
    is_sharded_load,
    load_sharded_common,
    mark_for_loading,
    megatron_param_groups,
    param_state_shards,
    param_to_sharded_map,
    torch_optimizer_sharded_state,
)
from megatron.core.reexports import lazy_attribute

# Megatron's name: the keys that identify a param group when matching checkpoint state to groups.
param_group_identifier_keys = PARAM_GROUP_IDENTIFIER_KEYS

logger = logging.getLogger(__name__)

StepStat = Union[float, torch.Tensor]

_PARAM_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "shared", "allreduce")


def _zero_grad_group_helper(group: List[torch.Tensor], set_to_none: bool) -> None:
    """Drop (or zero in place) the `.grad` of every param in `group`."""
    for param in group:
        if param.grad is None:
            continue
        if set_to_none:
            param.grad = None
            continue
        if param.grad.grad_fn is not None:
            param.grad.detach_()
        else:
            param.grad.requires_grad_(False)
        param.grad.zero_()


def _inner_step(optimizer, main_params: Sequence[torch.Tensor] = (),
                model_params: Sequence[torch.Tensor] = ()) -> List[torch.Tensor]:
    """`optimizer.step()`, then drop a clip coefficient handed to it (`defer_clip_to_fused_adam`).

    With `main_params` / `model_params` (fp32 params of the optimizer, their fp16/bf16 model copies) a fused
    torch AdamW on CUDA is stepped by `fused_adamw.step_with_model_copy`, which also writes the model copies
    of the large params; returns the main params whose copy is written (none otherwise)."""
    try:
        written = fused_adamw.step_with_model_copy(optimizer, main_params, model_params)
        if written is None:
            optimizer.step()
            return []
        return written
    finally:
        optimizer.__dict__.pop("grad_scale", None)


def _multi_tensor_copy_this_to_that(this: List[torch.Tensor], that: List[torch.Tensor]) -> None:
    """`that[i].copy_(this[i])` for all i (dtype-converting), as one foreach call."""
    if this:
        torch._foreach_copy_(that, this)


def _copy_param_attributes(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Carry the tensor-parallel and sharing attributes from a model param to its main copy."""
    for name in _PARAM_ATTRIBUTES:
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))


def _optimizer_device(optimizer: Optional[torch.optim.Optimizer]) -> torch.device:
    """Device of the optimizer's first param; the default accelerator (or CPU) when there is none."""
    if optimizer is not None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                return param.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextmanager
def _timed(config: OptimizerConfig, name: str):
    """Run the block under the level-1 timer `name` when `config.timers` is set."""
    timers = config.timers
    if timers is None:
        yield
        return
    timers(name, log_level=1).start(barrier=config.barrier_with_L1_time)
    try:
        yield
    finally:
        timers(name).stop()


def _fill_missing_adam_step(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """Give per-param Adam state a `step` when a checkpoint kept it per group (Apex/TE FusedAdam)."""
    groups = state_dict.get("param_groups", [])
    state = state_dict.get("state", {})
    if not any("exp_avg" in s and "step" not in s for s in state.values()):
        return state_dict
    new_state = {}
    for group in groups:
        step = float(group.get("step", 0))
        for index in group["params"]:
            if index in state:
                entry = dict(state[index])
                entry.setdefault("step", torch.tensor(step, dtype=torch.float32))
                new_state[index] = entry
    return {**state_dict, "state": {**state, **new_state}}


_IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable")


def _load_torch_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> None:
    """`optimizer.load_state_dict`, also for checkpoints written with Apex/TE FusedAdam (Adam's `step` per group).

    The kernel choices this run made (fused / foreach / capturable) are kept whatever the checkpoint holds:
    Megatron writes None for them, and adopting that would switch this run's fused AdamW off.
    """
    current = [{key: group.get(key) for key in _IMPLEMENTATION_KEYS} for group in optimizer.param_groups]
    optimizer.load_state_dict(_fill_missing_adam_step(state_dict))
    for group, flags in zip(optimizer.param_groups, current):
        group.update(flags)


def _megatron_torch_state(optimizer: Optional[torch.optim.Optimizer]) -> Dict[str, Any]:
    """`optimizer.state_dict()` with the param groups' kernel choices as Megatron writes them (None)."""
    if optimizer is None:
        return {}
    state_dict = optimizer.state_dict()
    groups = megatron_param_groups(state_dict["param_groups"])
    for group, saved in zip(groups, state_dict["param_groups"]):
        group["params"] = saved["params"]
    return {**state_dict, "param_groups": groups}


class MegatronOptimizer(ABC):
    """Base class: wraps a torch optimizer (or None on a rank that owns no params)."""

    def __init__(
        self,
        optimizer: Optional[torch.optim.Optimizer],
        config: OptimizerConfig,
        init_state_fn: Optional[Callable] = lambda x: None,
    ):
        self.optimizer = optimizer
        self.is_stub_optimizer = optimizer is None
        if self.is_stub_optimizer:
            logger.info("this rank holds no parameters for this optimizer; it will only join collectives")
        self.config = config
        self.init_state_fn = init_state_fn

    def get_parameters(self) -> List[torch.Tensor]:
        """All params the torch optimizer updates (main params for mixed precision)."""
        return [param for group in self.param_groups for param in group["params"]]

    def get_main_grads_for_grad_norm(self) -> List[torch.Tensor]:
        """Grads that count for the norm: skip missing grads, shared params and TP duplicates."""
        grads = []
        for param in self.get_parameters():
            if self.config.use_precision_aware_optimizer:
                grad = getattr(param, "decoupled_grad", None)
            else:
                grad = param.grad
            if grad is not None and param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param):
                grads.append(grad)
        return grads

    def get_grad_stats_parallel_group(self) -> Optional[dist.ProcessGroup]:
        """Group over which grad norm, zero counts and the inf flag are reduced."""
        group = getattr(self, "grad_stats_parallel_group", None)
        if group is not None:
            return group
        if getattr(self, "model_parallel_group", None) is not None:
            return self.model_parallel_group
        if parallel_state.model_parallel_is_initialized():
            return parallel_state.get_model_parallel_group()
        return None

    @abstractmethod
    def prepare_grads(self) -> bool:
        """Make main grads ready for the step; return True when an inf/nan was found."""

    @abstractmethod
    def step_with_ready_grads(self) -> bool:
        """Run the inner optimizer step and propagate the result to the model params."""

    def get_grad_norm_tensor(self) -> torch.Tensor:
        """Global L2 norm of the main grads (no clipping) as a 0-dim device tensor (no host sync)."""
        return get_grad_norm_fp32_tensor(
            self.get_main_grads_for_grad_norm(), grad_stats_parallel_group=self.get_grad_stats_parallel_group()
        )

    def get_grad_norm(self) -> float:
        """Global L2 norm of the main grads (no clipping)."""
        return self.get_grad_norm_tensor().item()

    def clip_grad_norm_tensor(self, clip_grad: float, defer_to_step: bool = False) -> torch.Tensor:
        """Clip all main grads to global norm `clip_grad` with a device-side coefficient; return the
        pre-clip norm as a 0-dim device tensor (no host sync). `defer_to_step`: a fused inner Adam(W)
        applies the coefficient in its next step instead (`defer_clip_to_fused_adam`)."""
        params = self.get_parameters()
        grads_for_norm = self.get_main_grads_for_grad_norm() if params else []
        grad_norm = get_grad_norm_fp32_tensor(
            grads_for_norm, grad_stats_parallel_group=self.get_grad_stats_parallel_group()
        )
        decoupled = self.config.use_precision_aware_optimizer
        if params and not (defer_to_step and defer_clip_to_fused_adam(self.optimizer, clip_grad, grad_norm, decoupled)):
            clip_grad_by_total_norm_fp32(params, clip_grad, grad_norm, decoupled)
        return grad_norm

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Clip all main grads to global norm `clip_grad`; return the norm before clipping."""
        return self.clip_grad_norm_tensor(clip_grad).item()

    def count_zeros_tensor(self) -> torch.Tensor:
        """Number of zero entries in the owned main grads, over the grad-stats group, as a device tensor."""
        return count_zeros_fp32_tensor(
            self.get_parameters(),
            grad_stats_parallel_group=self.get_grad_stats_parallel_group(),
            use_decoupled_grad=self.config.use_precision_aware_optimizer,
        )

    def count_zeros(self) -> float:
        """Number of zero entries in the owned main grads, over the grad-stats group."""
        return self.count_zeros_tensor().item()

    @abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the grads of model and main params."""

    @abstractmethod
    def get_loss_scale(self) -> torch.Tensor:
        """Current loss scale as a 1-element tensor (1.0 without a grad scaler)."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Multiply the loss by the loss scale before backward (fp16 training)."""
        return self.get_loss_scale() * loss

    def start_param_sync(self, model_index: int, *unused) -> None:
        """Start the param all-gather of one model chunk (only the distributed optimizer does work)."""

    @abstractmethod
    def reload_model_params(self) -> None:
        """Refresh main params from the model params (after the model was loaded)."""

    @abstractmethod
    def state_dict(self) -> Dict[str, Any]:
        """Checkpointable state (tensors, numbers, strings, lists, dicts only)."""

    @abstractmethod
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore from `state_dict()`."""

    def _model_and_main_params(self) -> List[Tuple[torch.Tensor, torch.Tensor, int, int]]:
        """(model param, main param, owned flat start, owned flat stop) of every optimized param."""
        return [(p, p, 0, p.numel()) for group in self.optimizer.param_groups for p in group["params"]]

    def _model_param_of(self):
        """main param -> model param (the identity where the optimizer steps the model params)."""
        model_of = {id(main): model for model, main, _, _ in self._model_and_main_params()}
        return lambda main: model_of.get(id(main), main)

    def sharded_state_dict(self, model_sharded_state_dict: Dict, is_loading: bool = False,
                           sharding_type: str = SHARDING_TYPE, metadata: Optional[Dict] = None,
                           **kwargs) -> Dict[str, Any]:
        """Megatron's sharded state of a non-distributed optimizer: the torch optimizer's state tensors as
        ShardedTensors in the layout of their model params (`optimizer.state.<name>.<model key>`), Adam's step
        once (`state.common_step`) and the param groups in `common.pt` (`sharded_state.py`). Every tensor is a
        view of this optimizer's state, so a distributed load fills it in place."""
        if self.is_stub_optimizer:
            return mark_for_loading({})
        ensure_state(self.optimizer, self.init_state_fn, self.config)
        state = torch_optimizer_sharded_state(self.optimizer, self._model_param_of(),
                                              param_to_sharded_map(model_sharded_state_dict))
        return mark_for_loading(state)

    def _load_sharded_common(self, state_dict: Dict[str, Any]) -> None:
        """After a distributed load (tensors were filled in place): param groups, step, grad scaler."""
        if not self.is_stub_optimizer:
            load_sharded_common(self.optimizer, state_dict)
        grad_scaler = getattr(self, "grad_scaler", None)
        if grad_scaler is not None and "grad_scaler" in state_dict:
            grad_scaler.load_state_dict(state_dict["grad_scaler"])

    @abstractmethod
    def step(self) -> Tuple[bool, Optional[StepStat], Optional[StepStat]]:
        """One update: `(update_successful, grad_norm, num_zeros_in_grad)`.

        `grad_norm` and `num_zeros_in_grad` are 0-dim device tensors when computed (read them with
        `.item()` only when they are logged), a float/None otherwise. Without a grad scaler (bf16,
        fp32) the step never synchronises with the device and `update_successful` is True.
        """

    @property
    def state(self) -> Dict:
        """The torch optimizer's per-param state."""
        return self.optimizer.state if self.optimizer is not None else {}

    @state.setter
    def state(self, value: Dict) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """The torch optimizer's param groups (the scheduler writes lr / weight_decay here)."""
        return self.optimizer.param_groups if self.optimizer is not None else []

    @param_groups.setter
    def param_groups(self, value: List[Dict[str, Any]]) -> None:
        self.optimizer.param_groups = value


class MixedPrecisionOptimizer(MegatronOptimizer):
    """Step for optimizers whose main params are separate from the model params.

    Subclasses provide `_collect_main_grad_data_for_unscaling`, `_copy_model_grads_to_main_grads` and
    `_get_main_params_and_model_data_float16` (the main params and the model tensors copied from them).
    """

    def __init__(
        self,
        optimizer: Optional[torch.optim.Optimizer],
        config: OptimizerConfig,
        grad_scaler: Optional[MegatronGradScaler],
        init_state_fn: Optional[Callable],
    ):
        super().__init__(optimizer, config, init_state_fn)
        if grad_scaler is None and config.fp16:
            raise ValueError("fp16 training needs a grad scaler: pass --loss-scale or leave dynamic loss scaling on")
        device = _optimizer_device(optimizer)
        self.grad_scaler = grad_scaler.to(device) if grad_scaler is not None else None
        self.found_inf = torch.zeros(1, dtype=torch.float, device=device)
        self._scale_one = torch.ones(1, dtype=torch.float, device=device)

    def get_loss_scale(self) -> torch.Tensor:
        """The grad scaler's scale, or 1.0."""
        if self.grad_scaler is None:
            return self._scale_one
        return self.grad_scaler.scale

    def reload_model_params(self) -> None:
        """Copy model params into the main params."""
        if not self.is_stub_optimizer:
            self._copy_model_params_to_main_params()

    @abstractmethod
    def _collect_main_grad_data_for_unscaling(self) -> List[torch.Tensor]:
        """Main grads to unscale and check for inf/nan."""

    @abstractmethod
    def _copy_model_grads_to_main_grads(self) -> None:
        """Fill the main grads from the model grads."""

    @abstractmethod
    def _get_main_params_and_model_data_float16(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """(the optimizer's fp32 main params, the fp16/bf16 model tensors `_copy_main_params_to_model_params`
        writes from them), pairwise."""

    def _copy_main_params_to_model_params(self, written: Sequence[torch.Tensor] = ()) -> None:
        """Write the updated main params into the model params, except those of the main params in `written`
        (the fused AdamW step already wrote them: `fused_adamw`)."""
        done = {id(param) for param in written}
        main_params, model_data = self._get_main_params_and_model_data_float16()
        pairs = [(main.data, model) for main, model in zip(main_params, model_data) if id(main) not in done]
        _multi_tensor_copy_this_to_that(this=[main for main, _ in pairs], that=[model for _, model in pairs])

    def _copy_model_params_to_main_params(self) -> None:
        """Refresh main params from the model params."""
        model_data, main_data = self._get_model_and_main_params_data_float16()
        _multi_tensor_copy_this_to_that(this=model_data, that=main_data)

    def _get_model_and_main_params_data_float16(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """(fp16/bf16 model tensors, their fp32 main tensors), pairwise: what the param copies read and write."""
        main_params, model_data = self._get_main_params_and_model_data_float16()
        return model_data, [main_param.data for main_param in main_params]

    def _unscale_main_grads_and_check_for_nan(self) -> bool:
        """Multiply main grads by 1/scale and report whether any rank of the group saw inf/nan."""
        main_grads = self._collect_main_grad_data_for_unscaling()
        self.found_inf.fill_(0.0)
        if main_grads:
            inv_scale = self.grad_scaler.inv_scale.to(self.found_inf.device)
            torch._amp_foreach_non_finite_check_and_unscale_(main_grads, self.found_inf, inv_scale)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(self.found_inf, op=dist.ReduceOp.MAX, group=self.get_grad_stats_parallel_group())
        return self.found_inf.item() > 0

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Copy model grads to main grads; with a scaler, unscale, check inf/nan and update the scale."""
        with _timed(self.config, "optimizer-copy-to-main-grad"):
            if not self.is_stub_optimizer:
                self._copy_model_grads_to_main_grads()
        if self.grad_scaler is None:
            return False
        with _timed(self.config, "optimizer-unscale-and-check-inf"):
            found_inf_flag = self._unscale_main_grads_and_check_for_nan()
        self.grad_scaler.update(found_inf_flag)
        return found_inf_flag

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Inner optimizer step, then copy main params into the model params (those the fused AdamW step
        already wrote are skipped: `fused_adamw`)."""
        written = []
        with _timed(self.config, "optimizer-inner-step"):
            if not self.is_stub_optimizer:
                written = _inner_step(self.optimizer, *self._get_main_params_and_model_data_float16())
        with _timed(self.config, "optimizer-copy-main-to-model-params"):
            if not self.is_stub_optimizer:
                self._copy_main_params_to_model_params(written)
        return True

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[StepStat], Optional[StepStat]]:
        """Skipped step on inf/nan: `(False, None, None)`; else clip, count zeros, step.

        Only the inf/nan check of a grad scaler reads a value back to the host (the skip decision).
        """
        if self.prepare_grads():
            return False, None, None
        grad_norm = 0.0
        with _timed(self.config, "optimizer-clip-main-grad"):
            if self.config.clip_grad > 0.0:
                grad_norm = self.clip_grad_norm_tensor(self.config.clip_grad, defer_to_step=True)
        with _timed(self.config, "optimizer-count-zeros"):
            num_zeros_in_grad = self.count_zeros_tensor() if self.config.log_num_zeros_in_grad else None
        success = self.step_with_ready_grads()
        return success, grad_norm, num_zeros_in_grad


class Float16OptimizerWithFloat16Params(MixedPrecisionOptimizer):
    """fp16/bf16 model params, fp32 main params inside the torch optimizer.

    On construction every fp16/bf16 param in the torch optimizer's groups is replaced by an fp32
    copy (carrying the tensor-parallel attributes); fp32 params stay as they are.
    """

    def __init__(
        self,
        optimizer: Optional[torch.optim.Optimizer],
        config: OptimizerConfig,
        grad_scaler: Optional[MegatronGradScaler],
        init_state_fn: Optional[Callable],
    ):
        super().__init__(optimizer, config, grad_scaler, init_state_fn)
        self.float16_groups: List[List[torch.Tensor]] = []
        self.fp32_from_float16_groups: List[List[torch.Tensor]] = []
        self.fp32_from_fp32_groups: List[List[torch.Tensor]] = []
        if self.is_stub_optimizer:
            return
        for param_group in self.optimizer.param_groups:
            float16_params, main_params, fp32_params = self._make_main_params(param_group)
            self.float16_groups.append(float16_params)
            self.fp32_from_float16_groups.append(main_params)
            self.fp32_from_fp32_groups.append(fp32_params)

    def _make_main_params(self, param_group: Dict[str, Any]):
        float16_params, main_params, fp32_params = [], [], []
        for index, param in enumerate(param_group["params"]):
            if not param.requires_grad:
                continue
            if param.dtype in (torch.float16, torch.bfloat16):
                main_param = param.detach().clone().float()
                _copy_param_attributes(main_param, param)
                param_group["params"][index] = main_param
                if param in self.optimizer.state:
                    self.optimizer.state[main_param] = self.optimizer.state.pop(param)
                float16_params.append(param)
                main_params.append(main_param)
            elif param.dtype == torch.float32:
                fp32_params.append(param)
            else:
                raise TypeError(
                    f"optimizer params must be torch.float16, torch.bfloat16 or torch.float32, got {param.dtype}"
                )
        return float16_params, main_params, fp32_params

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear model grads and main grads (DDP `main_grad` buffers are zeroed by the DDP wrapper)."""
        for groups in (self.float16_groups, self.fp32_from_float16_groups, self.fp32_from_fp32_groups):
            for group in groups:
                _zero_grad_group_helper(group, set_to_none)

    def _collect_main_grad_data_for_unscaling(self) -> List[torch.Tensor]:
        grads = []
        for groups in (self.fp32_from_float16_groups, self.fp32_from_fp32_groups):
            for group in groups:
                grads.extend(param.grad.data for param in group if param.grad is not None)
        return grads

    def _get_main_params_and_model_data_float16(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        main_params, model_data = [], []
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            main_params.extend(main_group)
            model_data.extend(model_param.data for model_param in model_group)
        return main_params, model_data

    def _copy_model_grads_to_main_grads(self) -> None:
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                model_grad = getattr(model_param, "main_grad", None)
                if model_grad is None:
                    model_grad = model_param.grad
                main_param.grad = model_grad.float() if model_grad is not None else None
                model_param.grad = None
        for model_group in self.fp32_from_fp32_groups:
            for model_param in model_group:
                main_grad = getattr(model_param, "main_grad", None)
                if main_grad is not None:
                    model_param.grad = main_grad

    def _model_and_main_params(self) -> List[Tuple[torch.Tensor, torch.Tensor, int, int]]:
        pairs = []
        for model_group, main_group, fp32_group in zip(self.float16_groups, self.fp32_from_float16_groups,
                                                        self.fp32_from_fp32_groups):
            pairs.extend((model, main, 0, model.numel()) for model, main in zip(model_group, main_group))
            pairs.extend((param, param, 0, param.numel()) for param in fp32_group)
        return pairs

    def sharded_state_dict(self, model_sharded_state_dict: Dict, is_loading: bool = False,
                           sharding_type: str = SHARDING_TYPE, metadata: Optional[Dict] = None,
                           **kwargs) -> Dict[str, Any]:
        """Megatron's layout: {"optimizer": the torch optimizer's sharded state (as for `FP32Optimizer`),
        "grad_scaler", "fp32_from_fp16_params": [[`optimizer.state.fp32_param.<model key>` per fp16/bf16
        param] per group]}, the fp32 main params laid out like their model params."""
        if self.is_stub_optimizer:
            return mark_for_loading({})
        ensure_state(self.optimizer, self.init_state_fn, self.config)
        param_map = param_to_sharded_map(model_sharded_state_dict)
        state: Dict[str, Any] = {"optimizer": torch_optimizer_sharded_state(self.optimizer, self._model_param_of(),
                                                                            param_map)}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        state["fp32_from_fp16_params"] = [
            [param_state_shards(model, 0, model.numel(), {"fp32_param": main.detach()}, param_map, False)
             .get("fp32_param") for model, main in zip(model_group, main_group)]
            for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups)
        ]
        return mark_for_loading(state)

    def state_dict(self) -> Dict[str, Any]:
        """`optimizer`, `grad_scaler` (when present) and `fp32_from_fp16_params` (plain tensors)."""
        state_dict = {"optimizer": _megatron_torch_state(self.optimizer)}
        if self.grad_scaler is not None:
            state_dict["grad_scaler"] = self.grad_scaler.state_dict()
        state_dict["fp32_from_fp16_params"] = [
            [param.detach() for param in group] for group in self.fp32_from_float16_groups
        ]
        return state_dict

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore optimizer state, loss scaler and the fp32 main params (also Megatron's older key names);
        after a distributed load only the common part (the tensors were loaded in place)."""
        if is_sharded_load(state_dict):
            self._load_sharded_common(state_dict)
            return
        optimizer_key = "optimizer" if "optimizer" in state_dict else "optimizer_state_dict"
        if not self.is_stub_optimizer:
            _load_torch_optimizer_state(self.optimizer, state_dict[optimizer_key])
        if "grad_scaler" not in state_dict:
            if self.config.fp16:
                logger.warning("found an old checkpoint without grad scaler state; the grad scaler is not loaded")
        elif self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        else:
            logger.warning("found grad scaler state in the checkpoint but this optimizer has no grad scaler")
        main_key = "fp32_from_fp16_params" if "fp32_from_fp16_params" in state_dict else "fp32_from_fp16"
        for current_group, saved_group in zip(self.fp32_from_float16_groups, state_dict[main_key]):
            for current_param, saved_param in zip(current_group, saved_group):
                current_param.data.copy_(saved_param.data)


class FP32Optimizer(MegatronOptimizer):
    """fp32 model params stepped in place; grads come from `main_grad` when present."""

    def __init__(
        self, optimizer: Optional[torch.optim.Optimizer], config: OptimizerConfig, init_state_fn: Optional[Callable]
    ):
        super().__init__(optimizer, config, init_state_fn)
        self._scale = torch.ones(1, dtype=torch.float, device=_optimizer_device(optimizer))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear `.grad` of every param (DDP `main_grad` buffers are zeroed by the DDP wrapper)."""
        for group in self.param_groups:
            _zero_grad_group_helper(group["params"], set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        """Always 1.0."""
        return self._scale

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Point `.grad` at `main_grad`; fp32 never overflows here, so always False."""
        with _timed(self.config, "optimizer-copy-to-main-grad"):
            for group in self.param_groups:
                for param in group["params"]:
                    main_grad = getattr(param, "main_grad", None)
                    if main_grad is not None:
                        param.grad = main_grad
        return False

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Inner optimizer step."""
        with _timed(self.config, "optimizer-inner-step"):
            if not self.is_stub_optimizer:
                _inner_step(self.optimizer)
        return True

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[StepStat], Optional[StepStat]]:
        """Clip (grad_norm is None when clipping is off), count zeros, step; never syncs with the device."""
        if self.prepare_grads():
            return False, None, None
        grad_norm = None
        with _timed(self.config, "optimizer-clip-main-grad"):
            if self.config.clip_grad > 0.0:
                grad_norm = self.clip_grad_norm_tensor(self.config.clip_grad, defer_to_step=True)
        with _timed(self.config, "optimizer-count-zeros"):
            num_zeros_in_grad = self.count_zeros_tensor() if self.config.log_num_zeros_in_grad else None
        success = self.step_with_ready_grads()
        return success, grad_norm, num_zeros_in_grad

    def reload_model_params(self) -> None:
        """Model params are the main params: nothing to do."""

    def state_dict(self) -> Dict[str, Any]:
        """The torch optimizer's state dict (kernel choices written as Megatron does)."""
        return _megatron_torch_state(self.optimizer)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore the torch optimizer's state (after a distributed load only the common part: the tensors
        were loaded in place)."""
        if is_sharded_load(state_dict):
            self._load_sharded_common(state_dict)
            return
        if not self.is_stub_optimizer:
            _load_torch_optimizer_state(self.optimizer, state_dict)


def __getattr__(name: str):
    """`ChainedOptimizer` (in `chained_optimizer.py`) through Megatron's import path (`megatron.core.reexports`)."""
    return lazy_attribute(__name__, name)
