"""Explicit process-group bundles passed to core modules, and the one place `None` groups are resolved.

Core layers take optional `tp_group=` / `model_comm_pgs=` / `grad_comm_pgs=` arguments. When a caller
passes None, the layer calls one of the resolvers below, which fall back to `parallel_state`.
"""
from typing import Any, List, Optional

import torch.distributed as dist

from megatron.core import parallel_state

_MODEL_GROUP_GETTERS = {
    "tp": lambda: parallel_state.get_tensor_model_parallel_group(check_initialized=False),
    "pp": lambda: parallel_state.get_pipeline_model_parallel_group(check_initialized=False),
    "mp": lambda: parallel_state.get_model_parallel_group(check_initialized=False),
    "embd": lambda: parallel_state.get_embedding_group(check_initialized=False),
    "pos_embd": lambda: parallel_state.get_position_embedding_group(check_initialized=False),
    "cp": lambda: parallel_state.get_context_parallel_group(check_initialized=False),
    "tp_cp": lambda: parallel_state.get_tensor_and_context_parallel_group(check_initialized=False),
    "hcp": lambda: parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False),
    "ep": lambda: parallel_state.get_expert_model_parallel_group(check_initialized=False),
    "expt_tp": lambda: parallel_state.get_expert_tensor_parallel_group(check_initialized=False),
    "tp_ep": lambda: parallel_state.get_expert_tensor_and_model_parallel_group(check_initialized=False),
    "tp_ep_pp": lambda: parallel_state.get_expert_tensor_model_pipeline_parallel_group(check_initialized=False),
}

_GRAD_GROUP_GETTERS = {
    "dp": lambda: parallel_state.get_data_parallel_group(),
    "dp_cp": lambda: parallel_state.get_data_parallel_group(with_context_parallel=True),
    "expt_dp": lambda: parallel_state.get_expert_data_parallel_group(check_initialized=False),
    "intra_dp_cp": lambda: parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True),
    "intra_expt_dp": lambda: parallel_state.get_expert_data_parallel_group(
        check_initialized=False, partial_expert_data_parallel=True
    ),
    "inter_dist_opt": lambda: parallel_state.get_inter_distributed_optimizer_instance_group(check_initialized=False),
}


class _ProcessGroupBundle:
    """Attribute bag of process groups; unknown names are rejected so typos fail loudly."""

    _GETTERS: dict = {}

    def __init__(self, **groups: Any) -> None:
        for name, group in groups.items():
            if name not in self._GETTERS:
                raise ValueError(
                    f"{type(self).__name__}: unknown process group {name!r}; known: {sorted(self._GETTERS)}"
                )
            setattr(self, name, group)

    @classmethod
    def use_mpu_process_groups(cls, required_pgs: Optional[List[str]] = None):
        """A bundle filled from `parallel_state` (all known groups, or only `required_pgs`)."""
        names = list(cls._GETTERS) if required_pgs is None else list(required_pgs)
        unknown = [n for n in names if n not in cls._GETTERS]
        if unknown:
            raise ValueError(f"{cls.__name__}.use_mpu_process_groups: unknown groups {unknown}; known: {sorted(cls._GETTERS)}")
        return cls(**{name: cls._GETTERS[name]() for name in names})

    def __repr__(self) -> str:
        present = sorted(k for k in vars(self) if not k.startswith("_"))
        return f"{type(self).__name__}({', '.join(present)})"


class ModelCommProcessGroups(_ProcessGroupBundle):
    """Process groups used by a model's forward/backward: tp, pp, mp, embd, pos_embd, cp, tp_cp, hcp,
    ep, expt_tp, tp_ep, tp_ep_pp."""

    _GETTERS = _MODEL_GROUP_GETTERS


ProcessGroupCollection = ModelCommProcessGroups


class GradCommProcessGroups(_ProcessGroupBundle):
    """Process groups used for gradient reduction and the optimizer: dp, dp_cp, expt_dp, intra_dp_cp,
    intra_expt_dp, inter_dist_opt."""

    _GETTERS = _GRAD_GROUP_GETTERS


def get_pg_size(group=None) -> int:
    """Size of `group`; 1 when torch.distributed is not initialised or the group is None."""
    if not dist.is_available() or not dist.is_initialized() or group is None:
        return 1
    return dist.get_world_size(group=group)


def get_pg_rank(group=None) -> int:
    """This process's rank in `group`; 0 when torch.distributed is not initialised or the group is None."""
    if not dist.is_available() or not dist.is_initialized() or group is None:
        return 0
    return dist.get_rank(group=group)


def get_tensor_model_parallel_group_if_none(tp_group=None, is_expert: bool = False, check_initialized: bool = True):
    """`tp_group` if given, else the expert or dense TP group of `parallel_state`.

    Returns None (meaning "TP size 1") when model parallel is not initialised and torch.distributed is
    not running, so a single-process model needs no setup.
    """
    if tp_group is not None:
        return tp_group
    if is_expert:
        group = parallel_state.get_expert_tensor_parallel_group(check_initialized=False)
    else:
        group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
    if group is None and check_initialized and dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            raise RuntimeError(
                "tensor model parallel group is not initialized: call parallel_state.initialize_model_parallel() "
                "or pass tp_group= explicitly"
            )
    return group


resolve_tp_group = get_tensor_model_parallel_group_if_none


def get_model_comm_pgs_if_none(model_comm_pgs: Optional[ModelCommProcessGroups] = None, required_pgs=None):
    """`model_comm_pgs` if given, else a bundle from `parallel_state` (limited to `required_pgs` if given)."""
    if model_comm_pgs is not None:
        return model_comm_pgs
    return ModelCommProcessGroups.use_mpu_process_groups(required_pgs)


def get_grad_comm_pgs_if_none(grad_comm_pgs: Optional[GradCommProcessGroups] = None, required_pgs=None):
    """`grad_comm_pgs` if given, else a bundle from `parallel_state` (limited to `required_pgs` if given)."""
    if grad_comm_pgs is not None:
        return grad_comm_pgs
    return GradCommProcessGroups.use_mpu_process_groups(required_pgs)
