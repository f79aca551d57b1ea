"""Entry points of distributed checkpointing: `save`, `load` and the readers of a saved directory.

A checkpoint directory holds `common.pt` (rank 0: every non-sharded leaf), the DCP files of the
sharded leaves (`.metadata`, `__{rank}_{k}.distcp`) and, written last by rank 0, `metadata.json`.
An interrupted save therefore never leaves a directory that looks complete.
"""
import logging
import os
import pickle
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import torch

from megatron.core.dist_checkpointing.core import (
    CheckpointingConfig,
    CONFIG_FNAME,
    check_is_distributed_checkpoint,
    load_config,
    save_config,
)
from megatron.core.dist_checkpointing.dict_utils import (
    dict_list_map_inplace,
    extract_matching_values,
    merge,
    nested_values,
)
from megatron.core.dist_checkpointing.mapping import (
    CheckpointingException,
    CommonStateDict,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)
from megatron.core.dist_checkpointing.safe_load import safe_torch_load
from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
from megatron.core.dist_checkpointing.strategies._collectives import (
    all_gather_object,
    barrier,
    get_rank,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import SaveCommonStrategy, backend_of
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)
from megatron.core.dist_checkpointing.utils import extract_nonpersistent, extract_sharded_base
from megatron.core.dist_checkpointing.validation import (
    StrictHandling,
    handle_mismatches,
    parse_strict_flag,
    tolerates_missing,
    validate_sharding_integrity,
)

logger = logging.getLogger(__name__)

COMMON_STATE_FNAME = "common.pt"
_SUPPORTED_BACKENDS = ("torch_dist",)


def _check_strategy(strategy: Any, kind: str) -> None:
    """Accept None, ('torch_dist'|'torch', version) tuples, or a strategy object naming that backend."""
    backend = backend_of(strategy)
    allowed = _SUPPORTED_BACKENDS if kind == "sharded" else ("torch",)
    if strategy is not None and backend not in allowed:
        raise ValueError(
            f"{kind}_strategy={strategy!r}: only the {allowed} {kind} backend is implemented; pass None "
            f"to use the default"
        )


def get_default_save_sharded_strategy(backend: str = "torch_dist", version: int = 1) -> TorchDistSaveShardedStrategy:
    """The default save strategy of `backend` (only torch_dist)."""
    return TorchDistSaveShardedStrategy(backend, version)


def get_default_save_common_strategy(backend: str = "torch", version: int = 1) -> SaveCommonStrategy:
    """The default common strategy (torch.save of common.pt)."""
    return SaveCommonStrategy(backend, version)


def get_default_load_sharded_strategy(checkpoint_dir: str) -> TorchDistLoadShardedStrategy:
    """The load strategy for the backend recorded in `checkpoint_dir/metadata.json`."""
    config = load_config(checkpoint_dir)
    if config.sharded_backend not in _SUPPORTED_BACKENDS:
        raise CheckpointingException(
            f"{checkpoint_dir} was written with the {config.sharded_backend!r} backend; only torch_dist is supported"
        )
    return TorchDistLoadShardedStrategy()


def _tensors_to_write(strategy, sharded_part: ShardedStateDict) -> Tuple[List[ShardedTensor], List[ShardedObject]]:
    tensors, objects = _main_replicas(sharded_part)
    if isinstance(strategy, FullyParallelSaveStrategyWrapper):
        every = [v for v in nested_values(sharded_part) if isinstance(v, ShardedTensor)]
        tensors = strategy.select_tensors_to_write(every)
    return tensors, objects


def _save_common(common_state: CommonStateDict, checkpoint_dir: str) -> None:
    path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
    tmp = path + ".tmp"
    torch.save(common_state, tmp)
    os.replace(tmp, path)


def _main_replicas(sharded_part: ShardedStateDict) -> Tuple[List[ShardedTensor], List[ShardedObject]]:
    tensors, objects = [], []
    for value in nested_values(sharded_part):
        if isinstance(value, ShardedTensor) and is_main_replica(value.replica_id):
            tensors.append(value)
        elif isinstance(value, ShardedObject) and is_main_replica(value.replica_id):
            objects.append(value)
    return tensors, objects


def _validate_global(sharded_part: ShardedStateDict) -> None:
    local = [v.without_data() for v in nested_values(sharded_part) if isinstance(v, (ShardedTensor, ShardedObject))]
    for value in nested_values(sharded_part):
        if isinstance(value, (ShardedTensor, ShardedObject)):
            value.validate_metadata_integrity()
    validate_sharding_integrity(all_gather_object(local))


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    sharded_strategy=None,
    common_strategy=None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check=None,
    content_metadata: Optional[dict] = None,
) -> Optional[AsyncRequest]:
    """Save a sharded state dict into `checkpoint_dir` (collective over all ranks).

    Non-sharded leaves go to `common.pt` (rank 0), sharded leaves to DCP files (main replicas only),
    and `metadata.json` last. With `async_sharded_save` the data is staged to CPU and an
    AsyncRequest is returned: its background work writes the files and its finalize steps write
    `.metadata` and `metadata.json`.
    """
    _check_strategy(sharded_strategy, "sharded")
    _check_strategy(common_strategy, "common")
    rank = get_rank()
    os.makedirs(checkpoint_dir, exist_ok=True)
    if rank == 0 and os.path.exists(os.path.join(checkpoint_dir, CONFIG_FNAME)):
        os.remove(os.path.join(checkpoint_dir, CONFIG_FNAME))
    apply_factories(sharded_state_dict)
    _, state_dict = extract_nonpersistent(sharded_state_dict)
    sharded_part, common_state = extract_sharded_base(state_dict)
    if content_metadata is not None:
        common_state["content_metadata"] = content_metadata
    if validate_access_integrity:
        _validate_global(sharded_part)
    if preprocess_common_before_consistancy_check is not None:
        preprocess_common_before_consistancy_check(common_state)
    if rank == 0:
        _save_common(common_state, checkpoint_dir)
    tensors, objects = _tensors_to_write(sharded_strategy, sharded_part)
    thread_count = getattr(getattr(sharded_strategy, "base_strategy", sharded_strategy), "thread_count",
                           torch_strategy.DEFAULT_THREAD_COUNT)
    state = torch_strategy.plan_save(checkpoint_dir, tensors, objects, copy_to_cpu=async_sharded_save,
                                     thread_count=thread_count)

    def finalize():
        torch_strategy.finish_save(state)
        barrier()
        if rank == 0:
            save_config(CheckpointingConfig("torch_dist", 1, "torch", 1), checkpoint_dir)
        barrier()

    request = AsyncRequest(torch_strategy.write_planned, (state,), [finalize])
    if async_sharded_save:
        return request
    request.execute_sync()
    return None


def load_common_state_dict(checkpoint_dir: str) -> StateDict:
    """The non-sharded part (`common.pt`), read with the restricted unpickler."""
    return safe_torch_load(os.path.join(checkpoint_dir, COMMON_STATE_FNAME), map_location="cpu")


def _requested_keys(tensors: List[ShardedTensor], objects: List[ShardedObject]) -> Set[str]:
    return {t.key for t in tensors} | {o.unique_key for o in objects}


def _all_sharded(sharded_part: ShardedStateDict) -> Tuple[List[ShardedTensor], List[ShardedObject]]:
    tensors = [v for v in nested_values(sharded_part) if isinstance(v, ShardedTensor)]
    objects = [v for v in nested_values(sharded_part) if isinstance(v, ShardedObject)]
    return tensors, objects


def _check_mismatch(strict: StrictHandling, tensors, objects, stored_keys: Set[str]) -> Tuple[Set[str], Set[str]]:
    requested = _requested_keys(tensors, objects)
    missing = requested - stored_keys
    unexpected: Set[str] = set()
    if StrictHandling.requires_global_app_metadata(strict):
        everyone = set().union(*all_gather_object(sorted(requested)))
        unexpected = stored_keys - everyone
    if missing and not tolerates_missing(strict):
        raise CheckpointingException(f"keys missing from the checkpoint: {sorted(missing)}")
    handle_mismatches(strict, missing, unexpected)
    return missing, unexpected


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    sharded_strategy=None,
    common_strategy=None,
    validate_access_integrity: bool = True,
    strict: Union[str, StrictHandling] = StrictHandling.ASSUME_OK_UNEXPECTED,
) -> Union[StateDict, Tuple[StateDict, Set[str], Set[str]]]:
    """Load the shards `sharded_state_dict` asks for (any TP/PP/DP layout) plus `common.pt`.

    Returns the common state merged with the loaded sharded leaves (tensors are loaded in place into
    the ShardedTensors' data when given). With strict=return_unexpected/return_all returns
    (state_dict, missing_keys, unexpected_keys). `validate_access_integrity` is accepted for
    compatibility: every requested key is checked against the stored index regardless.
    """
    _check_strategy(sharded_strategy, "sharded")
    _check_strategy(common_strategy, "common")
    strict = parse_strict_flag(strict)
    config = load_config(checkpoint_dir)
    if config.sharded_backend not in _SUPPORTED_BACKENDS:
        raise CheckpointingException(
            f"{checkpoint_dir} was written with the {config.sharded_backend!r} backend; only torch_dist is supported"
        )
    common_state = load_common_state_dict(checkpoint_dir)
    factories, _ = extract_matching_values(
        sharded_state_dict, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True
    )
    apply_factories(sharded_state_dict)
    nonpersistent, state_dict = extract_nonpersistent(sharded_state_dict)
    sharded_part, _ = extract_sharded_base(state_dict)
    tensors, objects = _all_sharded(sharded_part)
    metadata = torch_strategy.read_dcp_metadata(checkpoint_dir)
    missing, unexpected = _check_mismatch(strict, tensors, objects, set(metadata.state_dict_metadata))
    if missing:
        sharded_part, _ = extract_matching_values(
            sharded_part,
            lambda v: (v.unique_key if isinstance(v, ShardedObject) else v.key) not in missing,
        )
        tensors, objects = _all_sharded(sharded_part)
    loaded_tensors, loaded_objects = torch_strategy.load_sharded(checkpoint_dir, tensors, objects, metadata)

    def _fill(value):
        if isinstance(value, ShardedTensor):
            return loaded_tensors[torch_strategy.request_id(value)]
        if isinstance(value, ShardedObject):
            return loaded_objects[value.unique_key]
        return value

    dict_list_map_inplace(_fill, sharded_part)
    merge(common_state, sharded_part)
    dict_list_map_inplace(lambda x: x.unwrap(), nonpersistent)
    merge(common_state, nonpersistent)
    if factories:
        common_state = apply_factory_merges(common_state, factories)
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return common_state, missing, unexpected
    return common_state


def load_tensors_metadata(checkpoint_dir: str, sharded_strategy=None) -> Dict[str, ShardedTensor]:
    """{key: data-less ShardedTensor of the whole global tensor} for every stored tensor."""
    load_config(checkpoint_dir)
    metadata = torch_strategy.read_dcp_metadata(checkpoint_dir)
    result = {}
    for key, item in metadata.state_dict_metadata.items():
        if hasattr(item, "chunks"):
            shape = tuple(item.size)
            result[key] = ShardedTensor(key, None, item.properties.dtype, shape, shape, (0,) * len(shape),
                                        (1,) * len(shape))
    return result


def load_sharded_metadata(checkpoint_dir: str, sharded_strategy=None) -> Dict[str, Any]:
    """Data-less ShardedTensors (whole tensors) and ShardedObjects of every stored item."""
    result: Dict[str, Any] = dict(load_tensors_metadata(checkpoint_dir))
    metadata = torch_strategy.read_dcp_metadata(checkpoint_dir)
    for key, item in metadata.state_dict_metadata.items():
        if not hasattr(item, "chunks") and "/shard_" in key:
            obj = ShardedObject.empty_from_unique_key(key)
            result[obj.unique_key] = obj
    return result


def load_plain_tensors(checkpoint_dir: str) -> StateDict:
    """{key: whole global tensor} for every stored tensor (single process or every rank)."""
    metadata = load_tensors_metadata(checkpoint_dir)
    request = {key: sharded for key, sharded in metadata.items()}
    loaded = load(request, checkpoint_dir, validate_access_integrity=False)
    return {key: loaded[key] for key in metadata}


def load_content_metadata(checkpoint_dir: Optional[str] = None, *, preloaded_state_dict: Optional[dict] = None):
    """The `content_metadata` saved with the checkpoint (None when absent)."""
    state = preloaded_state_dict if preloaded_state_dict is not None else load_common_state_dict(checkpoint_dir)
    return state.get("content_metadata")


def remove_sharded_tensors(checkpoint_dir: str, key_prefix: str) -> None:
    """Drop every stored item whose key starts with `key_prefix` from the DCP index (rank 0 only;
    the bytes stay in the data files)."""
    metadata = torch_strategy.read_dcp_metadata(checkpoint_dir)
    metadata.state_dict_metadata = {
        k: v for k, v in metadata.state_dict_metadata.items() if not k.startswith(key_prefix)
    }
    if metadata.storage_data:
        metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if not k.fqn.startswith(key_prefix)}
    path = os.path.join(checkpoint_dir, torch_strategy.METADATA_FNAME)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(metadata, f)
    os.replace(tmp, path)


__all__ = [
    "save", "load", "load_common_state_dict", "load_tensors_metadata", "load_sharded_metadata",
    "load_plain_tensors", "load_content_metadata", "remove_sharded_tensors", "check_is_distributed_checkpoint",
    "get_default_save_sharded_strategy", "get_default_save_common_strategy", "get_default_load_sharded_strategy",
    "COMMON_STATE_FNAME",
]
