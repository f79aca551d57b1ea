"""Spec of a GPT MoE block (Megatron Core's `get_moe_module_spec` / `get_moe_module_spec_for_backend`).

The MoE layer's experts come from the backend (`grouped_mlp_modules`: GroupedMLP with grouped GEMM, else a
SequentialMLP of column/row-parallel linears) and its shared experts are a `SharedExpertMLP` of the backend's
linears with the gate off (as in Megatron's shipped spec).
"""
from typing import Optional

from megatron.core.extensions.transformer_engine import import_transformer_engine
from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider, TECompatibleLocalSpecProvider
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec


def _te_backend() -> BackendSpecProvider:
    """TESpecProvider when Transformer Engine imports, else the native modules in TE's layout."""
    try:
        import_transformer_engine()
    except ImportError:
        return TECompatibleLocalSpecProvider()
    return TESpecProvider()


def get_moe_module_spec(
    use_te: Optional[bool] = True,
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    moe_use_legacy_grouped_gemm: Optional[bool] = False,
) -> ModuleSpec:
    """MoE block spec of the Transformer Engine backend (`use_te`) or the local one."""
    backend = _te_backend() if use_te else LocalSpecProvider()
    return get_moe_module_spec_for_backend(backend=backend, num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                           moe_use_legacy_grouped_gemm=moe_use_legacy_grouped_gemm)


def get_moe_module_spec_for_backend(
    backend: BackendSpecProvider,
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    moe_use_legacy_grouped_gemm: Optional[bool] = False,
    use_te_activation_func: bool = False,
) -> ModuleSpec:
    """MoE block spec built from `backend`'s modules."""
    if num_experts is None:
        raise ValueError("get_moe_module_spec_for_backend needs num_experts (the MoE layer's expert count).")
    mlp = MLPSubmodules(linear_fc1=backend.column_parallel_linear(), linear_fc2=backend.row_parallel_linear())
    expert_module, expert_submodule = backend.grouped_mlp_modules(bool(moe_grouped_gemm),
                                                                  bool(moe_use_legacy_grouped_gemm))
    experts = ModuleSpec(module=expert_module, submodules=expert_submodule)
    shared_experts = ModuleSpec(module=SharedExpertMLP, params={"gate": False}, submodules=mlp)
    return ModuleSpec(module=MoELayer, submodules=MoESubmodules(experts=experts, shared_experts=shared_experts))


__all__ = ["get_moe_module_spec", "get_moe_module_spec_for_backend"]
