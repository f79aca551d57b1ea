"""Checks around a save or load: `StrictHandling` of key mismatches and the integrity of a sharding
(every global tensor covered exactly once by main replicas, consistent shapes and dtypes).

Naming note (Megatron's): in `validate_integrity_and_strict_load` a *missing* key is stored in the checkpoint
but requested by no rank, an *unexpected* key is requested by this rank but absent from the checkpoint.
"""
import logging
from collections import defaultdict
from enum import Enum
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple, Union

import numpy as np

from megatron.core.dist_checkpointing.dict_utils import extract_matching_values, nested_values
from megatron.core.dist_checkpointing.mapping import (
    CheckpointingException,
    ShardedBase,
    ShardedObject,
    ShardedTensor,
    is_main_replica,
)
from megatron.core.dist_checkpointing.strategies._collectives import all_gather_object

logger = logging.getLogger(__name__)


class StrictHandling(Enum):
    """What `load` does about keys requested but absent (missing) or stored but not requested
    (unexpected)."""

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: "StrictHandling") -> bool:
        """Whether the load must compare the requested keys with the stored ones."""
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: "StrictHandling") -> bool:
        """Whether unexpected keys must be computed over the requests of all ranks."""
        return val in (
            StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL, StrictHandling.RAISE_UNEXPECTED,
            StrictHandling.RAISE_ALL, StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL,
        )

    @staticmethod
    def requires_returning_mismatch_keys(val: "StrictHandling") -> bool:
        """Whether `load` returns (state_dict, missing_keys, unexpected_keys)."""
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: Union[str, StrictHandling]) -> StrictHandling:
    """A StrictHandling from its value string (or the enum itself)."""
    if isinstance(strict, StrictHandling):
        return strict
    try:
        return StrictHandling(strict)
    except ValueError as exc:
        choices = ", ".join(s.value for s in StrictHandling)
        raise ValueError(f"strict={strict!r} is not a StrictHandling value: choose one of {choices}") from exc


def tolerates_missing(strict: StrictHandling) -> bool:
    """Strict modes in which missing keys are reported rather than fatal."""
    return strict in (StrictHandling.LOG_ALL, StrictHandling.RETURN_ALL, StrictHandling.IGNORE_ALL)


def handle_mismatches(strict: StrictHandling, missing: Set[str], unexpected: Set[str]) -> None:
    """Log or raise about missing/unexpected keys as `strict` says."""
    if strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL) and unexpected:
        raise CheckpointingException(f"unexpected keys in the checkpoint (not requested): {sorted(unexpected)}")
    if strict == StrictHandling.RAISE_ALL and missing:
        raise CheckpointingException(f"keys missing from the checkpoint: {sorted(missing)}")
    if strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL) and unexpected:
        logger.warning("unexpected keys in the checkpoint (not requested): %s", sorted(unexpected))
    if strict == StrictHandling.LOG_ALL and missing:
        logger.warning("keys missing from the checkpoint: %s", sorted(missing))


def _chunks_overlap(a: ShardedTensor, b: ShardedTensor) -> bool:
    for off_a, size_a, off_b, size_b in zip(a.global_offset, a.chunk_shape(), b.global_offset, b.chunk_shape()):
        if off_a + size_a <= off_b or off_b + size_b <= off_a:
            return False
    return True


def _validate_tensor_shards(key: str, shards: List[ShardedTensor]) -> None:
    first = shards[0]
    for shard in shards[1:]:
        if tuple(shard.global_shape) != tuple(first.global_shape) and not (
            shard.allow_shape_mismatch or first.allow_shape_mismatch
        ):
            raise CheckpointingException(
                f"ShardedTensor {key!r}: ranks disagree on the global shape ({first.global_shape} vs "
                f"{shard.global_shape})"
            )
        if shard.dtype != first.dtype:
            raise CheckpointingException(
                f"ShardedTensor {key!r}: ranks disagree on the dtype ({first.dtype} vs {shard.dtype})"
            )
    main = [s for s in shards if is_main_replica(s.replica_id)]
    if any(s.flattened_range is not None for s in main):
        covered = sum(s.flattened_range.stop - s.flattened_range.start for s in main)
    else:
        covered = sum(int(np.prod(s.chunk_shape())) for s in main)
        if len(main) <= 512:
            for i, a in enumerate(main):
                for b in main[i + 1:]:
                    if _chunks_overlap(a, b):
                        raise CheckpointingException(
                            f"ShardedTensor {key!r}: main-replica shards at offsets {a.global_offset} and "
                            f"{b.global_offset} overlap (two ranks would write the same elements; give one of "
                            f"them a non-zero replica_id)"
                        )
    total = int(np.prod(first.global_shape))
    if covered != total and not first.allow_shape_mismatch:
        raise CheckpointingException(
            f"ShardedTensor {key!r}: main-replica shards cover {covered} of the {total} elements of the "
            f"global shape {tuple(first.global_shape)} (some part has no writer, or is written twice)"
        )


def _validate_object_shards(key: str, shards: List[ShardedObject]) -> None:
    counts: Dict[str, int] = defaultdict(int)
    for shard in shards:
        if is_main_replica(shard.replica_id):
            counts[shard.unique_key] += 1
    twice = [k for k, n in counts.items() if n > 1]
    if twice:
        raise CheckpointingException(f"ShardedObject {key!r}: shards {twice} have more than one main replica")
    expected = int(np.prod(shards[0].global_shape))
    if len(counts) != expected:
        raise CheckpointingException(
            f"ShardedObject {key!r}: {len(counts)} shards have a main replica, the grid "
            f"{tuple(shards[0].global_shape)} needs {expected}"
        )


def validate_sharding_integrity(global_metadata: Iterable[Iterable[ShardedBase]]) -> None:
    """Check, over all ranks' metadata, that each key is consistently and completely sharded."""
    by_key: Dict[Tuple[type, str], List[ShardedBase]] = defaultdict(list)
    for rank_metadata in global_metadata:
        for sharded in rank_metadata:
            by_key[(type(sharded), sharded.key)].append(sharded)
    for (kind, key), shards in by_key.items():
        if kind is ShardedTensor:
            _validate_tensor_shards(key, shards)
        elif kind is ShardedObject:
            _validate_object_shards(key, shards)


def determine_global_metadata(sharded_state_dict) -> Tuple[List[ShardedBase], List[List[ShardedBase]]]:
    """(this rank's data-less sharded items, every rank's), exchanged with an all-gather (collective)."""
    local_metadata = [sharded.without_data() for sharded in nested_values(sharded_state_dict)
                      if isinstance(sharded, ShardedBase)]
    return local_metadata, all_gather_object(local_metadata)


def _determine_missing_and_unexpected_keys(ckpt_sharded_metadata: Dict[str, Any], local_metadata,
                                           global_metadata=None) -> Tuple[Set[str], Set[str]]:
    """(missing, unexpected) keys, see the module note; missing ones only when `global_metadata` is given."""
    stored = {sharded.key for sharded in ckpt_sharded_metadata.values()}
    unexpected = {sharded.key for sharded in local_metadata} - stored
    missing: Set[str] = set()
    if global_metadata is not None:
        missing = stored - {sharded.key for rank_metadata in global_metadata for sharded in rank_metadata}
    return missing, unexpected


def adjust_non_strict_load(sharded_state_dict, sharded_keys_to_remove: Set[str]):
    """`sharded_state_dict` without the sharded items whose key is in `sharded_keys_to_remove`."""
    if not sharded_keys_to_remove:
        return sharded_state_dict
    kept, _ = extract_matching_values(
        sharded_state_dict, lambda v: not (isinstance(v, ShardedBase) and v.key in sharded_keys_to_remove))
    return kept


def maybe_report_missing_and_unexpected_keys(missing_keys: Set[str], unexpected_keys: Set[str],
                                             raise_error: bool = True) -> None:
    """Raise (CheckpointingException) or log a warning about the keys, when there are any."""
    if not missing_keys and not unexpected_keys:
        return
    parts = []
    if unexpected_keys:
        parts.append(f"keys requested but not in the checkpoint (unexpected): {sorted(unexpected_keys)}")
    if missing_keys:
        parts.append(f"keys in the checkpoint but not requested (missing): {sorted(missing_keys)}")
    message = "; ".join(parts)
    if raise_error:
        raise CheckpointingException(message)
    logger.warning(message)


_SKIP_MISSING = (StrictHandling.ASSUME_OK_UNEXPECTED, StrictHandling.LOG_UNEXPECTED,
                 StrictHandling.RAISE_UNEXPECTED, StrictHandling.RETURN_UNEXPECTED)


def validate_integrity_and_strict_load(sharded_state_dict, strict: StrictHandling, validate_access_integrity: bool,
                                       local_metadata: Optional[List[ShardedBase]] = None,
                                       global_metadata: Optional[List[List[ShardedBase]]] = None,
                                       ckpt_sharded_metadata: Optional[Dict[str, Any]] = None):
    """Megatron's pre-load check: returns (state dict without its unexpected keys, missing keys, unexpected keys).

    When `strict` needs a comparison with the checkpoint (every mode but `assume_ok_unexpected`),
    `ckpt_sharded_metadata` (e.g. `load_sharded_metadata(dir)`) is required: unexpected keys (requested here,
    not stored) are dropped from the state dict, missing ones (stored, requested by no rank) are computed from
    `global_metadata` for the `*_all` modes only; then the keys are raised about (`raise_*`), logged (`log_*`)
    or cleared (`ignore_all`). `validate_access_integrity` also checks that the ranks' requests together
    shard every key consistently (`validate_sharding_integrity`; gathers the metadata when not given).
    """
    strict = parse_strict_flag(strict)
    missing_keys: Set[str] = set()
    unexpected_keys: Set[str] = set()
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        if ckpt_sharded_metadata is None:
            raise CheckpointingException("Cannot verify checkpoint mismatch with ckpt_sharded_metadata=None.")
        if local_metadata is None:
            local_metadata = [sharded.without_data() for sharded in nested_values(sharded_state_dict)
                              if isinstance(sharded, ShardedBase)]
        missing_keys, unexpected_keys = _determine_missing_and_unexpected_keys(
            ckpt_sharded_metadata, local_metadata, None if strict in _SKIP_MISSING else global_metadata)
        sharded_state_dict = adjust_non_strict_load(sharded_state_dict, unexpected_keys)
        if strict == StrictHandling.IGNORE_ALL:
            missing_keys, unexpected_keys = set(), set()
        elif strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
            maybe_report_missing_and_unexpected_keys(missing_keys, unexpected_keys, True)
        elif strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
            maybe_report_missing_and_unexpected_keys(missing_keys, unexpected_keys, False)
    if validate_access_integrity:
        if global_metadata is None:
            local_metadata, global_metadata = determine_global_metadata(sharded_state_dict)
        validate_sharding_integrity(global_metadata)
    return sharded_state_dict, missing_keys, unexpected_keys
