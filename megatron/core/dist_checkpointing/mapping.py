"""What a sharded state dict is made of: `ShardedTensor`, `ShardedObject`, `ShardedTensorFactory`,
`LocalNonpersistentObject` (Megatron Core's `dist_checkpointing.mapping` names and fields).

A `ShardedTensor` is one rank's piece of a global tensor: the local `data` plus where it sits in the
global tensor (`global_offset`, `global_shape`) and which replica it is (`replica_id`; only the
all-zero replica is written). Leading `prepend_axis_num` axes are global-only axes (e.g. the stacked
layer axis) of local size 1 that the local tensor does not have.
"""
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch

from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace

ReplicaId = Union[int, Tuple[int, ...]]
StateDict = Dict[str, Any]
ShardedStateDict = Dict[str, Any]
CommonStateDict = Dict[str, Any]


class CheckpointingException(Exception):
    """A checkpoint could not be saved or loaded; the message names the key or the file."""


def is_main_replica(replica_id: ReplicaId) -> bool:
    """True for the replica that gets written: `0` or a tuple of zeros."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


class ShardedBase:
    """Common parent of everything that `dist_checkpointing.save` stores outside `common.pt`."""

    key: str
    data: object
    replica_id: ReplicaId

    def validate_metadata_integrity(self) -> None:
        """Raise CheckpointingException when the sharding metadata is inconsistent."""

    def without_data(self) -> "ShardedBase":
        """A copy holding only metadata (what is exchanged between ranks)."""
        raise NotImplementedError


@dataclass
class ShardedTensor(ShardedBase):
    """One shard of a global tensor saved under `key` (the DCP fully qualified name)."""

    key: str
    """Name of the global tensor in the checkpoint."""
    data: Optional[torch.Tensor]
    """This rank's local piece (None in metadata-only copies)."""
    dtype: torch.dtype
    """dtype of the global tensor."""
    local_shape: Tuple[int, ...]
    """Shape of `data` (without the prepended axes)."""
    global_shape: Tuple[int, ...]
    """Shape of the global tensor (prepended axes included)."""
    global_offset: Tuple[int, ...]
    """Offset of this shard in the global tensor, per global axis."""
    axis_fragmentations: Optional[Tuple[int, ...]]
    """How many shards each global axis is cut into."""
    replica_id: ReplicaId = 0
    """Which copy of this shard it is; only the all-zero replica is written."""
    prepend_axis_num: int = 0
    """Number of leading global axes the local tensor does not have (local size 1)."""
    allow_shape_mismatch: bool = False
    """Load even when the stored global shape differs (e.g. vocab padded for another TP size)."""
    flattened_range: Optional[slice] = None
    """A contiguous range of the flattened local chunk held by `data` (distributed optimizer)."""

    def __post_init__(self):
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        ndim = len(self.global_shape)
        if len(self.global_offset) != ndim:
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: global_offset {self.global_offset} and global_shape "
                f"{self.global_shape} have different lengths"
            )
        if len(self.local_shape) + self.prepend_axis_num != ndim:
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: local_shape {self.local_shape} plus {self.prepend_axis_num} "
                f"prepended axes does not match global_shape {self.global_shape}"
            )
        for axis, (offset, size) in enumerate(zip(self.global_offset, self.chunk_shape())):
            if offset < 0 or (not self.allow_shape_mismatch and offset + size > self.global_shape[axis]):
                raise CheckpointingException(
                    f"ShardedTensor {self.key!r}: shard at offset {self.global_offset} of shape "
                    f"{self.chunk_shape()} does not fit into global shape {self.global_shape} (axis {axis})"
                )
        if self.data is not None:
            if self.flattened_range is None and tuple(self.data.shape) != tuple(self.local_shape):
                raise CheckpointingException(
                    f"ShardedTensor {self.key!r}: data shape {tuple(self.data.shape)} differs from "
                    f"local_shape {self.local_shape}"
                )
            if self.flattened_range is not None and self.data.numel() != (
                self.flattened_range.stop - self.flattened_range.start
            ):
                raise CheckpointingException(
                    f"ShardedTensor {self.key!r}: data has {self.data.numel()} elements but flattened_range "
                    f"{self.flattened_range} covers {self.flattened_range.stop - self.flattened_range.start}"
                )

    def chunk_shape(self) -> Tuple[int, ...]:
        """Shape of this shard as a chunk of the global tensor (prepended axes have size 1)."""
        return (1,) * self.prepend_axis_num + tuple(self.local_shape)

    def global_slice(self) -> Tuple[Union[int, slice], ...]:
        """Index of this shard in the global tensor (prepended axes indexed by an int)."""
        prepended = tuple(self.global_offset[: self.prepend_axis_num])
        rest = tuple(
            slice(off, off + size)
            for off, size in zip(self.global_offset[self.prepend_axis_num :], self.local_shape)
        )
        return prepended + rest

    def local_chunk_offset_in_global(self) -> Tuple[int, ...]:
        """Offset of this shard counted in chunks rather than elements."""
        chunk = self.chunk_shape()
        return tuple(off // size for off, size in zip(self.global_offset, chunk))

    def max_allowed_chunks(self) -> Tuple[int, ...]:
        """Number of chunks along each axis implied by `axis_fragmentations` or the shapes."""
        if self.axis_fragmentations is not None:
            return tuple(self.axis_fragmentations)
        return tuple(g // c for g, c in zip(self.global_shape, self.chunk_shape()))

    def without_data(self) -> "ShardedTensor":
        return replace(self, data=None)

    def init_data(self, device: Union[str, torch.device], init_fn: Callable = torch.empty) -> None:
        """Allocate `data` (used when the caller only knows the sharding)."""
        if self.data is not None:
            return
        shape = self.local_shape
        if self.flattened_range is not None:
            shape = (self.flattened_range.stop - self.flattened_range.start,)
        self.data = init_fn(shape, dtype=self.dtype, device=device)

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: Tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        flattened_range: Optional[slice] = None,
        **init_kwargs,
    ) -> "ShardedTensor":
        """Shard `data` described by `(axis, rank_offset, fragments)` triples: along global `axis` the
        global tensor is cut into `fragments` equal chunks and `data` is chunk number `rank_offset`."""
        if flattened_range is not None:
            raise CheckpointingException(
                f"ShardedTensor {key!r}: use from_rank_offsets_flat for a flattened_range"
            )
        return cls._from_offsets(key, data, tuple(data.shape), rank_offsets, replica_id, prepend_axis_num,
                                 None, init_kwargs)

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: torch.Tensor,
        non_flat_local_shape: Tuple[int, ...],
        *rank_offsets: Tuple[int, int, int],
        flattened_range: slice,
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        **init_kwargs,
    ) -> "ShardedTensor":
        """Like `from_rank_offsets` for a 1-D `data` that is `flattened_range` of the local chunk."""
        return cls._from_offsets(key, data, tuple(non_flat_local_shape), rank_offsets, replica_id,
                                 prepend_axis_num, flattened_range, init_kwargs)

    @classmethod
    def _from_offsets(cls, key, data, local_shape, rank_offsets, replica_id, prepend_axis_num,
                      flattened_range, init_kwargs):
        ndim = len(local_shape) + prepend_axis_num
        global_offset = [0] * ndim
        fragments = [1] * ndim
        global_shape = [1] * prepend_axis_num + list(local_shape)
        seen = set()
        for axis, rank_offset, fragm in rank_offsets:
            if axis in seen or not 0 <= axis < ndim or not 0 <= rank_offset < fragm:
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: invalid rank offset (axis={axis}, offset={rank_offset}, "
                    f"fragments={fragm}) for a {ndim}-d global tensor (axes must be unique and in range)"
                )
            seen.add(axis)
            chunk = 1 if axis < prepend_axis_num else local_shape[axis - prepend_axis_num]
            global_shape[axis] = chunk * fragm
            global_offset[axis] = rank_offset * chunk
            fragments[axis] = fragm
        dtype = init_kwargs.pop("dtype", data.dtype if data is not None else None)
        return cls(key, data, dtype, tuple(local_shape), tuple(global_shape), tuple(global_offset),
                   tuple(fragments), replica_id, prepend_axis_num, flattened_range=flattened_range,
                   **init_kwargs)

    def __str__(self):
        return f"{self.__class__.__name__}(key={self.key!r})"


@dataclass
class ShardedObject(ShardedBase):
    """A picklable object saved per shard (RNG states, rerun state), stored as a DCP bytes item."""

    key: str
    """Name of the object in the checkpoint."""
    data: object
    """The object itself."""
    global_shape: Tuple[int, ...]
    """Shape of the grid of shards (e.g. (PP, TP) for RNG states)."""
    global_offset: Tuple[int, ...]
    """This shard's position in the grid."""
    replica_id: ReplicaId = 0
    """Which copy this is; only the all-zero replica is written."""

    def validate_metadata_integrity(self) -> None:
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"ShardedObject {self.key!r}: global_offset {self.global_offset} and global_shape "
                f"{self.global_shape} have different lengths"
            )

    def without_data(self) -> "ShardedObject":
        return replace(self, data=None)

    @property
    def unique_key(self) -> str:
        """The DCP item name: `{key}/shard_{offsets}_{shape}` with dot-joined numbers."""
        offsets = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{offsets}_{shape}"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> "ShardedObject":
        """A data-less ShardedObject parsed back from its `unique_key`."""
        key, shard = unique_key.rsplit("/shard_", 1)
        offsets, shape = shard.split("_")
        return cls(key, None, tuple(int(x) for x in shape.split(".")),
                   tuple(int(x) for x in offsets.split(".")), replica_id)

    def __str__(self):
        return f"{self.__class__.__name__}(key={self.key!r})"


@dataclass
class ShardedTensorFactory(ShardedBase):
    """Builds the sharded tensors of one entry at save/load time and merges them back after a load.

    `build_fn(key, data, replica_id, flattened_range)` returns a sharded state dict;
    `merge_fn(loaded_sub_state_dict)` turns the loaded result back into the module's tensor.
    """

    key: str
    """Key prefix of the built tensors."""
    data: torch.Tensor
    """The module's tensor."""
    build_fn: Callable
    """(key, data, replica_id, flattened_range) -> sharded state dict."""
    merge_fn: Callable
    """Loaded sharded state dict -> tensor."""
    replica_id: ReplicaId = 0
    """Replica id passed to build_fn."""
    flattened_range: Optional[slice] = None
    """Flattened range passed to build_fn."""

    def build(self) -> ShardedStateDict:
        """Run build_fn."""
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def without_data(self) -> "ShardedTensorFactory":
        return replace(self, data=None)


@dataclass
class LocalNonpersistentObject:
    """A value that is not saved: on load it is put back from the caller's state dict as is."""

    obj: Any
    """The wrapped value."""

    def unwrap(self) -> Any:
        """The wrapped value."""
        return self.obj


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replace every ShardedTensorFactory in place by the sharded state dict it builds."""

    def _build(x):
        return x.build() if isinstance(x, ShardedTensorFactory) else x

    dict_list_map_inplace(_build, sharded_state_dict)


def apply_factory_merges(x1: Any, x2: Any, key: Tuple = ()) -> Any:
    """Walk the loaded `x1` next to the original `x2`; where `x2` holds a factory, merge x1 with it."""
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    if isinstance(x1, list) and isinstance(x2, dict):
        for i, v2 in x2.items():
            x1[i] = apply_factory_merges(x1[i], v2, key + (i,))
        return x1
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k not in x1:
                raise CheckpointingException(f"factory merge: key {key + (k,)} missing from the loaded state")
            x1[k] = apply_factory_merges(x1[k], v2, key + (k,))
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise CheckpointingException(f"factory merge: list lengths differ at {key}: {len(x1)} vs {len(x2)}")
        for i, v2 in enumerate(x2):
            x1[i] = apply_factory_merges(x1[i], v2, key + (i,))
    return x1

