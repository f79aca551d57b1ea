"""Filters and key rewrites over sharded state dicts (Megatron Core's `dist_checkpointing.utils`)."""
from typing import Tuple

from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, extract_matching_values
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)


def extract_sharded_tensors(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """(ShardedTensor leaves, everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedTensor))


def extract_sharded_tensors_and_factories(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """(ShardedTensor and ShardedTensorFactory leaves, everything else)."""
    return extract_matching_values(
        sharded_state_dict, lambda v: isinstance(v, (ShardedTensor, ShardedTensorFactory))
    )


def extract_sharded_tensors_or_nonpersistent(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """(ShardedTensor, factory and LocalNonpersistentObject leaves, everything else)."""
    return extract_matching_values(
        sharded_state_dict,
        lambda v: isinstance(v, (ShardedTensor, LocalNonpersistentObject, ShardedTensorFactory)),
    )


def extract_sharded_base(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """(every ShardedBase leaf, everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedBase))


def extract_nonpersistent(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """(LocalNonpersistentObject leaves, everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject))


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepend `prefix` to the key of every sharded leaf, in place."""

    def _add_prefix(x):
        if isinstance(x, (ShardedTensor, ShardedObject, ShardedTensorFactory)):
            x.key = f"{prefix}{x.key}"
        return x

    dict_list_map_inplace(_add_prefix, sharded_state_dict)


def replace_prefix_for_sharding(sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str) -> None:
    """Replace `old_prefix` by `new_prefix` in the key of every sharded leaf, in place.

    Raises ValueError naming the key when a key does not start with `old_prefix`.
    """

    def _replace(x):
        if isinstance(x, (ShardedTensor, ShardedObject, ShardedTensorFactory)):
            if not x.key.startswith(old_prefix):
                raise ValueError(f"sharded key {x.key!r} does not start with the prefix {old_prefix!r}")
            x.key = f"{new_prefix}{x.key[len(old_prefix):]}"
        return x

    dict_list_map_inplace(_replace, sharded_state_dict)


def apply_prefix_mapping(sharded_state_dict: ShardedStateDict, prefix_map: dict) -> None:
    """Rewrite keys by the first matching prefix in `prefix_map` (old -> new), in place."""

    def _replace(x):
        if isinstance(x, (ShardedTensor, ShardedObject, ShardedTensorFactory)):
            for old, new in prefix_map.items():
                if x.key.startswith(old):
                    x.key = f"{new}{x.key[len(old):]}"
                    break
        return x

    dict_list_map_inplace(_replace, sharded_state_dict)
