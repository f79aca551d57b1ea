"""`ChainedOptimizer`: several Megatron optimizers (e.g. dense and expert-parallel params) stepped as one,
with one global grad norm. Also importable as `megatron.core.optimizer.optimizer.ChainedOptimizer`
(Megatron's path)."""
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, defer_clip_to_fused_adam
from megatron.core.optimizer.optimizer import MegatronOptimizer, StepStat
from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding


class ChainedOptimizer(MegatronOptimizer):
    """Several Megatron optimizers stepped together, with one combined grad norm.

    The combined norm is `sqrt(sum(norm_i ** 2))` over the chained optimizers, each norm reduced
    over its own group (model-parallel for dense params, expert model-parallel for experts).
    """

    def __init__(self, chained_optimizers: List[MegatronOptimizer]):
        if not chained_optimizers:
            raise ValueError("ChainedOptimizer needs at least one optimizer")
        self.model_chunks = []
        self.config = getattr(chained_optimizers[0], "config", None)
        for optimizer in chained_optimizers:
            for model_chunk in getattr(optimizer, "model_chunks", []):
                if not any(model_chunk is known for known in self.model_chunks):
                    self.model_chunks.append(model_chunk)
        self.chained_optimizers = chained_optimizers
        self.optimizer = None
        self.init_state_fn = None

    @property
    def is_stub_optimizer(self) -> bool:
        """True when every chained optimizer is a stub."""
        return all(getattr(opt, "is_stub_optimizer", False) for opt in self.chained_optimizers)

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """Concatenated param groups of all chained optimizers."""
        return [group for opt in self.chained_optimizers for group in opt.param_groups]

    @property
    def state(self) -> Dict:
        """Merged per-param state of all chained optimizers."""
        merged = {}
        for opt in self.chained_optimizers:
            merged.update(opt.state)
        return merged

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear grads in every chained optimizer."""
        for opt in self.chained_optimizers:
            opt.zero_grad(set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        """The first optimizer's loss scale."""
        return self.chained_optimizers[0].get_loss_scale()

    def reload_model_params(self) -> None:
        """Reload main params in every chained optimizer."""
        for opt in self.chained_optimizers:
            opt.reload_model_params()

    def state_dict(self) -> List[Dict[str, Any]]:
        """One state dict per chained optimizer."""
        return [opt.state_dict() for opt in self.chained_optimizers]

    def sharded_state_dict(self, model_sharded_state_dict: Dict, is_loading: bool = False, **kwargs):
        """The single optimizer's sharded state, or (Megatron's layout) {index: sharded state of optimizer
        `index`, its keys prefixed with `chained_{index}.`} of several chained optimizers."""
        if len(self.chained_optimizers) == 1:
            return self.chained_optimizers[0].sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
        result = {}
        for index, opt in enumerate(self.chained_optimizers):
            state = opt.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
            add_prefix_for_sharding(state, f"chained_{index}.")
            result[index] = state
        return result

    def load_state_dict(self, state_dict) -> None:
        """Restore from a list (or an index-keyed dict) of per-optimizer state dicts (one optimizer: its own)."""
        if len(self.chained_optimizers) == 1 and isinstance(state_dict, dict) and 0 not in state_dict:
            self.chained_optimizers[0].load_state_dict(state_dict)
            return
        if len(self.chained_optimizers) != len(state_dict):
            raise RuntimeError(
                f"expected {len(self.chained_optimizers)} entries in the state dict, got {len(state_dict)}: the "
                "checkpoint was saved with a different set of optimizers (e.g. with or without expert parallelism)"
            )
        if isinstance(state_dict, dict):
            state_dict = [value for _, value in sorted(state_dict.items())]
        for opt, state in zip(self.chained_optimizers, state_dict):
            opt.load_state_dict(state)

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Prepare every optimizer's grads; True if any found inf/nan."""
        found_inf_flag = False
        for opt in self.chained_optimizers:
            found_inf_flag |= opt.prepare_grads()
        return found_inf_flag

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Step every optimizer; with overlapped param gather, start chunk 0's gather right after its step."""
        success = True
        for index, opt in enumerate(self.chained_optimizers):
            success &= opt.step_with_ready_grads()
            if self.config.overlap_param_gather_with_optimizer_step and index == 0:
                if len(opt.model_chunks) != 1:
                    raise RuntimeError("overlapping the param gather with the step needs one model chunk per optimizer")
                opt.model_chunks[0].start_param_sync(force_dispatch=True)
        return success

    def get_parameters(self) -> List[torch.Tensor]:
        """Params of all chained optimizers."""
        return [param for opt in self.chained_optimizers for param in opt.get_parameters()]

    @torch.no_grad()
    def get_grad_norm_tensor(self) -> torch.Tensor:
        """sqrt of the sum of the squared per-optimizer norms, as a 0-dim device tensor."""
        norms = [opt.get_grad_norm_tensor() for opt in self.chained_optimizers]
        device = norms[0].device
        squares = torch.stack([norm.to(device=device, dtype=torch.float64) ** 2 for norm in norms])
        return squares.sum().sqrt()

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """sqrt of the sum of the squared per-optimizer norms."""
        return self.get_grad_norm_tensor().item()

    def count_zeros_tensor(self) -> torch.Tensor:
        """Sum of the per-optimizer zero counts, as a 0-dim device tensor."""
        counts = [opt.count_zeros_tensor() for opt in self.chained_optimizers]
        device = counts[0].device
        return torch.stack([count.to(device) for count in counts]).sum()

    def count_zeros(self) -> float:
        """Sum of the per-optimizer zero counts."""
        return self.count_zeros_tensor().item()

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[StepStat], Optional[StepStat]]:
        """Common inf check, one global norm for clipping all optimizers, then every step.

        The global norm and the clip coefficient stay on the device (see `MegatronOptimizer.step`).
        """
        if self.prepare_grads():
            return False, None, None
        grad_norm = self.get_grad_norm_tensor()
        for opt in self.chained_optimizers:
            if getattr(opt, "is_stub_optimizer", False):
                continue
            params, clip, decoupled = opt.get_parameters(), opt.config.clip_grad, opt.config.use_precision_aware_optimizer
            if params and clip > 0.0 and not defer_clip_to_fused_adam(opt.optimizer, clip, grad_norm, decoupled):
                clip_grad_by_total_norm_fp32(params, clip, grad_norm, decoupled)
        num_zeros_in_grad = 0
        for opt in self.chained_optimizers:
            if opt.config.log_num_zeros_in_grad:
                num_zeros_in_grad = num_zeros_in_grad + opt.count_zeros_tensor()
        update_successful = self.step_with_ready_grads()
        return update_successful, grad_norm, num_zeros_in_grad

    def start_param_sync(self, model_index: int, *unused) -> None:
        """Forward to every chained optimizer."""
        for opt in self.chained_optimizers:
            opt.start_param_sync(model_index, *unused)

    def save_parameter_state(self, filename: str) -> None:
        """Write the distributed optimizers' sharded state as one list (None for the others) on DP rank 0."""
        states, save = [], False
        for opt in self.chained_optimizers:
            if not hasattr(opt, "get_parameter_state_dp_zero"):
                states.append(None)
                continue
            state = opt.get_parameter_state_dp_zero()
            if dist.get_rank(opt.data_parallel_group) == 0:
                states.append(state)
                save = True
            else:
                states.append(None)
        if save:
            torch.save(states, filename)

    def load_parameter_state(self, filename: str, *, update_legacy_format: bool = False) -> None:
        """Read the list written by `save_parameter_state` on DP rank 0 and scatter each entry."""
        states = None
        for index, opt in enumerate(self.chained_optimizers):
            if not hasattr(opt, "load_parameter_state_from_dp_zero"):
                continue
            if states is None and dist.get_rank(opt.data_parallel_group) == 0:
                states = torch.load(filename, map_location="cpu", weights_only=True)
            state = states[index] if states else None
            opt.load_parameter_state_from_dp_zero(state, update_legacy_format=update_legacy_format)
