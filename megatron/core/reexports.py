"""Every compatibility re-export of `megatron.core`, in one table.

Megatron Core 0.13.1's users import names from paths where our layering does not define them: package
facades (`from megatron.core import parallel_state`, `from megatron.core.transformer import
TransformerConfig`), names that live higher in the import graph than the module Megatron exposes them
from (`megatron.core.utils.get_pg_size`), or a class moved to its own module
(`megatron.core.optimizer.optimizer.ChainedOptimizer`). Each such name is resolved lazily (PEP 562): the
module's `__getattr__` calls `lazy_attribute`, which imports the target on first use, so importing the
module stays cheap and never climbs the layering. Each entry still hides an edge of the import graph from
readers and tools; listing them all here makes those edges visible, and the import-graph test
(`tests/unit/test_code_rules.py`) checks that every entry resolves and that no module outside this table
defines a `__getattr__`.

`SHIM_MODULES` lists the modules that exist only to keep a Megatron import path, with where their names
live. This module imports nothing of megatron (it sits below everything that uses it).
"""
import importlib
import sys
from typing import Any, Dict, List

# module -> {name: "target.module" (the module itself) or "target.module:attribute"}
LAZY_ATTRIBUTES: Dict[str, Dict[str, str]] = {
    "megatron.core": {
        "mpu": "megatron.core.parallel_state",
        "parallel_state": "megatron.core.parallel_state",
        "tensor_parallel": "megatron.core.tensor_parallel",
        "dist_checkpointing": "megatron.core.dist_checkpointing",
        "utils": "megatron.core.utils",
        "ModelParallelConfig": "megatron.core.model_parallel_config:ModelParallelConfig",
        "DistributedDataParallel": "megatron.core.distributed:DistributedDataParallel",
        "InferenceParams": "megatron.core.inference_params:InferenceParams",
        "Timers": "megatron.core.timers:Timers",
    },
    # Megatron exposes these from `megatron.core.utils`, the bottom of our graph; they live higher up.
    "megatron.core.utils": {
        "get_pg_size": "megatron.core.process_groups_config:get_pg_size",
        "get_pg_rank": "megatron.core.process_groups_config:get_pg_rank",
        "get_tensor_model_parallel_group_if_none":
            "megatron.core.process_groups_config:get_tensor_model_parallel_group_if_none",
        "make_tp_sharded_tensor_for_checkpoint":
            "megatron.core.tensor_parallel.utils:make_tp_sharded_tensor_for_checkpoint",
        "make_sharded_tensor_for_checkpoint": "megatron.core.tensor_parallel.utils:make_sharded_tensor_for_checkpoint",
        "GlobalMemoryBuffer": "megatron.core.parallel_state:GlobalMemoryBuffer",
        "log_on_each_pipeline_stage": "megatron.core.parallel_logging:log_on_each_pipeline_stage",
        "check_param_hashes_across_dp_replicas":
            "megatron.core.distributed.param_hashes:check_param_hashes_across_dp_replicas",
        "StragglerDetector": "megatron.core.straggler_detector:StragglerDetector",
        "drain_embedding_wgrad_compute": "megatron.core.tensor_parallel.wgrad_deferral:drain_embedding_wgrad_compute",
        "get_batch_on_this_cp_rank": "megatron.core.context_parallel.batch:get_batch_on_this_cp_rank",
    },
    "megatron.core.transformer": {
        "MegatronModule": "megatron.core.transformer.module:MegatronModule",
        "ModuleSpec": "megatron.core.transformer.spec_utils:ModuleSpec",
        "build_module": "megatron.core.transformer.spec_utils:build_module",
        "TransformerConfig": "megatron.core.transformer.transformer_config:TransformerConfig",
        "MLATransformerConfig": "megatron.core.transformer.transformer_config:MLATransformerConfig",
        "TransformerLayer": "megatron.core.transformer.transformer_layer:TransformerLayer",
        "TransformerLayerSubmodules": "megatron.core.transformer.transformer_layer:TransformerLayerSubmodules",
    },
    "megatron.core.distributed": {
        "DistributedDataParallel": "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel",
        "DistributedDataParallelConfig":
            "megatron.core.distributed.distributed_data_parallel_config:DistributedDataParallelConfig",
        "TorchFullyShardedDataParallel":
            "megatron.core.distributed.torch_fully_sharded_data_parallel:TorchFullyShardedDataParallel",
        "ParamAndGradBuffer": "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBuffer",
        "partition_buckets": "megatron.core.distributed.param_and_grad_buffer:partition_buckets",
    },
    "megatron.core.pipeline_parallel": {
        "get_forward_backward_func": "megatron.core.pipeline_parallel.schedules:get_forward_backward_func",
    },
    # the save/load entry points pull in torch.distributed.checkpoint
    "megatron.core.dist_checkpointing": {
        name: f"megatron.core.dist_checkpointing.serialization:{name}"
        for name in ("save", "load", "load_common_state_dict", "load_tensors_metadata", "load_sharded_metadata",
                     "load_plain_tensors", "load_content_metadata", "remove_sharded_tensors")
    },
    # `ChainedOptimizer` lives in `chained_optimizer.py`, which imports this module.
    "megatron.core.optimizer.optimizer": {
        "ChainedOptimizer": "megatron.core.optimizer.chained_optimizer:ChainedOptimizer",
    },
}

# Modules that only keep a Megatron import path: module -> where its names live, and why they live there.
SHIM_MODULES: Dict[str, str] = {
    "megatron.core.models.common.embeddings.rope_utils":
        "megatron.core.transformer.rope_utils (attention, in the transformer package, must not import models)",
}


def reexported_names(module_name: str) -> List[str]:
    """The names `module_name` re-exports lazily (for its `__all__`)."""
    return list(LAZY_ATTRIBUTES.get(module_name, {}))


def lazy_attribute(module_name: str, name: str) -> Any:
    """`module_name.name` from the table (a module's PEP 562 `__getattr__` delegates here); the value is then
    cached on the module, so the next access does not come back."""
    target = LAZY_ATTRIBUTES.get(module_name, {}).get(name)
    if target is None:
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
    target_module, _, attribute = target.partition(":")
    value = importlib.import_module(target_module)
    if attribute:
        value = getattr(value, attribute)
    setattr(sys.modules[module_name], name, value)
    return value


__all__ = ["LAZY_ATTRIBUTES", "SHIM_MODULES", "lazy_attribute", "reexported_names"]
