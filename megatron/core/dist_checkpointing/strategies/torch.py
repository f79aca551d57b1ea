"""The `torch_dist` backend: ShardedTensors and ShardedObjects written with and read by PyTorch's
distributed checkpoint engine (`torch.distributed.checkpoint`, DCP), as Megatron-LM does.

Layout: each ShardedTensor key is a DCP tensor FQN whose chunks are the main-replica shards
(`global_offset`, chunk shape; a shard with a `flattened_range` is stored N-D flattened, see
`resharding.py`); each ShardedObject is a DCP bytes item under its `unique_key`
holding `torch.save([data])` (Megatron-LM saves the list of this rank's shards of that key: one).
Files: `.metadata` (DCP's index, written by the coordinator) and `__{rank}_{k}.distcp` (data, written
by each rank).

Design notes:
- Own planners: DCP's default planners know DTensor/torch ShardedTensor, not offsets; ours turn
  (global_offset, global_shape) into write items and compute read items for any requested shard from
  whichever layout its key is stored in (`resharding.plan_reads`), which is what makes loading at
  another TP/PP/DP layout, or into another kind of optimizer, work.
- The save is split in plan / write / finish. Plan and finish are collective and run in the
  caller's thread; write touches only local files, so it can run in a background thread (async save).
- Reading is pickle-free where DCP would unpickle: `.metadata` goes through an allow-list unpickler,
  bytes items through `safe_torch_load`.
"""
import io
import os
import pickle
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_item_for_byteio,
    create_read_items_for_chunk_list,
)

from megatron.core.dist_checkpointing.mapping import CheckpointingException, ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.safe_load import safe_torch_load
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    StrategyAction,
    register_default_strategy,
)
from megatron.core.dist_checkpointing.strategies.resharding import (
    ReadPlan,
    is_nd_flattened_tensor,
    plan_reads,
    stored_data,
    stored_geometry,
)
from megatron.core.dist_checkpointing.strategies._collectives import (
    all_gather_object,
    get_rank,
    is_distributed,
)

METADATA_FNAME = ".metadata"
DEFAULT_THREAD_COUNT = 2


class TorchDistSaveShardedStrategy(AsyncSaveShardedStrategy):
    """The torch_dist save strategy; `thread_count` files are written per rank."""

    def __init__(self, backend: str = "torch_dist", version: int = 1, keep_only_main_replica: bool = True,
                 thread_count: int = DEFAULT_THREAD_COUNT, cached_metadata: bool = False,
                 separation_hint: Optional[str] = None):
        super().__init__(backend, version)
        self.keep_only_main_replica = keep_only_main_replica
        self.thread_count = thread_count
        self.cached_metadata = cached_metadata
        self.separation_hint = separation_hint


class TorchDistLoadShardedStrategy(LoadShardedStrategy):
    """The torch_dist load strategy (reads `.metadata` and the requested chunks)."""


def register_default_torch_strategies() -> None:
    """Register the torch_dist sharded and the torch common strategies (Megatron's defaults)."""
    register_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1, TorchDistLoadShardedStrategy())
    register_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1, TorchDistSaveShardedStrategy("torch_dist", 1))
    register_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1, LoadCommonStrategy())
    register_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1, SaveCommonStrategy("torch", 1))


register_default_torch_strategies()


class _RestrictedMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` allowing only the DCP metadata classes and torch enums it holds."""

    _MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner", "torch.distributed.checkpoint._extension")
    _TORCH_TYPES = (torch.dtype, torch.layout, torch.memory_format)
    _EXTRA = (("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("pathlib", "PosixPath"),
              ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
              ("pathlib", "Path"))

    def find_class(self, module, name):
        if module in self._MODULES:
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, self._TORCH_TYPES) or value is torch.Size:
                return value
        if (module, name) in self._EXTRA:
            return super().find_class(module, name)
        if module == "builtins" and name in ("set", "frozenset", "slice", "tuple", "list", "dict"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not allowed in a DCP .metadata file")


class SafeFileSystemReader(dcp.FileSystemReader):
    """FileSystemReader whose `.metadata` is read by the allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = os.path.join(str(self.path), METADATA_FNAME)
        if not os.path.isfile(path):
            raise CheckpointingException(f"{path} is missing: the DCP index of the checkpoint was not written")
        try:
            with open(path, "rb") as f:
                metadata = _RestrictedMetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
            raise CheckpointingException(f"{path} is truncated or corrupt: {exc}") from exc
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_dcp_metadata(checkpoint_dir: str) -> Metadata:
    """The DCP index (`.metadata`) of a checkpoint directory."""
    return SafeFileSystemReader(checkpoint_dir).read_metadata()


def check_data_files(checkpoint_dir: str, metadata: Metadata) -> None:
    """Raise CheckpointingException naming any `.distcp` file that is missing or shorter than the
    index says (a truncated write)."""
    needed: Dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for relative_path, size in sorted(needed.items()):
        path = os.path.join(checkpoint_dir, relative_path)
        if not os.path.isfile(path):
            raise CheckpointingException(f"checkpoint data file {path} is missing")
        actual = os.path.getsize(path)
        if actual < size:
            raise CheckpointingException(
                f"checkpoint data file {path} is truncated: {actual} bytes, the index needs {size}"
            )


class _ShardedSavePlanner(DefaultSavePlanner):
    """Write items from ShardedTensor offsets and ShardedObject bytes."""

    def __init__(self, tensors: List[Tuple[ShardedTensor, torch.Tensor]], objects: List[ShardedObject]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._tensors = {(sh.key, stored_geometry(sh)[1]): (sh, data) for sh, data in tensors}
        self._objects = {obj.unique_key: obj for obj in objects}

    def create_local_plan(self) -> SavePlan:
        items = []
        for (key, offset), (sharded, data) in self._tensors.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=data.size())
            items.append(WriteItem(
                index=MetadataIndex(key, torch.Size(offset)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(data),
                                            size=torch.Size(stored_geometry(sharded)[0])),
            ))
        for unique_key in self._objects:
            items.append(WriteItem(index=MetadataIndex(unique_key), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            # Megatron-LM's layout: a list of the rank's shards of this unique key (always one).
            torch.save([self._objects[write_item.index.fqn].data], buffer)
            buffer.seek(0)
            return buffer
        return self._tensors[(write_item.index.fqn, tuple(write_item.index.offset))][1]


@dataclass
class SavePlanState:
    """What a planned save carries from its plan step to its write and finish steps."""

    checkpoint_dir: str
    """Target directory."""
    writer: dcp.FileSystemWriter
    """DCP storage writer."""
    planner: _ShardedSavePlanner
    """Our save planner."""
    local_plan: SavePlan
    """This rank's final plan."""
    metadata: Optional[Metadata]
    """The global DCP index (kept on the coordinator)."""
    nd_flattened_shapes: Dict[str, Tuple[int, ...]] = field(default_factory=dict)
    """Model-space global shape of every key stored N-D flattened (all ranks' keys)."""
    write_results: List[Any] = field(default_factory=list)
    """This rank's write results (filled by the write step)."""


def stage_tensor(data: torch.Tensor, copy: bool) -> torch.Tensor:
    """A contiguous CPU tensor with `data`'s values (a private copy when `copy`)."""
    staged = data.detach().to("cpu", copy=copy)
    return staged.contiguous()


def plan_save(checkpoint_dir: str, tensors: List[ShardedTensor], objects: List[ShardedObject],
              copy_to_cpu: bool, thread_count: int = DEFAULT_THREAD_COUNT) -> SavePlanState:
    """Collective: build the global DCP plan for this rank's main-replica shards."""
    staged = [(sh, stored_data(sh, stage_tensor(sh.data, copy_to_cpu))) for sh in tensors]
    rank = get_rank()
    is_coordinator = rank == 0
    writer = dcp.FileSystemWriter(checkpoint_dir, thread_count=thread_count, sync_files=True, overwrite=True)
    planner = _ShardedSavePlanner(staged, objects)
    planner.set_up_planner({}, storage_meta=writer.storage_meta(), is_coordinator=is_coordinator)
    writer.set_up_storage_writer(is_coordinator, rank=rank, use_collectives=True)
    with warnings.catch_warnings():
        # Re-saving into a directory is deliberate: save() removed its metadata.json first.
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        local_plan = writer.prepare_local_plan(planner.create_local_plan())
    flattened = {sh.key: tuple(sh.global_shape) for sh in tensors if is_nd_flattened_tensor(sh)}
    all_plans, all_flattened = zip(*all_gather_object((local_plan, flattened)))
    global_plans, metadata = planner.create_global_plan(list(all_plans))
    global_plans = writer.prepare_global_plan(global_plans)
    final_plan = planner.finish_plan(global_plans[rank])
    nd_shapes = {key: shape for shapes in all_flattened for key, shape in shapes.items()}
    return SavePlanState(checkpoint_dir, writer, planner, final_plan, metadata if is_coordinator else None,
                         nd_shapes)


def write_planned(state: SavePlanState) -> None:
    """Local only (no collectives): write this rank's `.distcp` files."""
    future = state.writer.write_data(state.local_plan, state.planner)
    future.wait()
    state.write_results = future.value()


def finish_save(state: SavePlanState) -> None:
    """Collective: gather write results; the coordinator writes `.metadata`."""
    all_results = all_gather_object(state.write_results)
    if state.metadata is not None:
        # Megatron-LM's per-tensor extras, as its centrally planned saves write them: the model-space global
        # shape of every N-D flattened key (its reformulating loader reads it), nothing for the others.
        state.metadata.mcore_data = {
            key: ({"nd_reformulated_orig_global_shape": state.nd_flattened_shapes[key]}
                  if key in state.nd_flattened_shapes else {})
            for key, item in state.metadata.state_dict_metadata.items() if isinstance(item, TensorStorageMetadata)
        }
        state.writer.finish(metadata=state.metadata, results=all_results)


class _ShardedLoadPlanner(DefaultLoadPlanner):
    """Read items for the planned chunk reads; bytes items through the safe loader."""

    def __init__(self, reads: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor], objects: List[ShardedObject],
                 checkpoint_dir: str):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._reads = reads
        self._objects = {obj.unique_key: obj for obj in objects}
        self._checkpoint_dir = checkpoint_dir
        self.loaded_objects: Dict[str, Any] = {}

    def create_local_plan(self) -> LoadPlan:
        items = []
        for (key, offset), target in self._reads.items():
            stored = self.metadata.state_dict_metadata[key]
            # A shard of a vocabulary padded for another TP size may reach past the stored tensor.
            sizes = [min(o + s, g) - o for o, s, g in zip(offset, target.shape, stored.size)]
            if any(s <= 0 for s in sizes):
                continue
            chunk = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(sizes))
            items.extend(create_read_items_for_chunk_list(key, stored, [chunk]))
        for unique_key in self._objects:
            index = MetadataIndex(unique_key)
            items.append(_create_read_item_for_byteio(index, 0, index, 0, 0))
        return LoadPlan(items)

    def resolve_tensor(self, read_item):
        index = read_item.dest_index
        target = self._reads[(index.fqn, tuple(index.offset))]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            target = target.narrow(dim, start, length)
        return target

    def commit_tensor(self, read_item, tensor) -> None:
        """Data was copied into a view of the target already."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        where = f"{self._checkpoint_dir} item {fqn!r}"
        self.loaded_objects[fqn] = unwrap_object_shards(safe_torch_load(value, name=where), where)


def unwrap_object_shards(stored: Any, where: str) -> Any:
    """The data of a stored ShardedObject: Megatron-LM stores `[data]`; files this framework wrote before it
    matched that layout store `data` itself (never a list, except the RNG state, which callers accept both
    ways)."""
    if not isinstance(stored, list):
        return stored
    if len(stored) != 1:
        raise CheckpointingException(f"{where} holds {len(stored)} object shards; a ShardedObject item holds one")
    return stored[0]


def validate_request_against_metadata(tensors: List[ShardedTensor], metadata: Metadata) -> None:
    """Raise CheckpointingException when a requested tensor is stored as something else than a tensor
    (the stored shape is checked against the request when the reads are planned)."""
    for sharded in tensors:
        if not isinstance(metadata.state_dict_metadata.get(sharded.key), TensorStorageMetadata):
            raise CheckpointingException(f"checkpoint item {sharded.key!r} is not a tensor")


def request_id(sharded: ShardedTensor) -> Tuple[str, Tuple[int, ...], Optional[int]]:
    """Identifies one requested shard: key, global offset and (flattened shards) the range start."""
    start = sharded.flattened_range.start if is_nd_flattened_tensor(sharded) else None
    return sharded.key, tuple(sharded.global_offset), start


def _plan_tensor_reads(tensors: List[ShardedTensor], metadata: Metadata) -> Tuple[ReadPlan, list]:
    plan, targets = ReadPlan(), []
    for sharded in tensors:
        sharded.init_data("cpu")
        data = sharded.data if sharded.data.is_contiguous() else sharded.data.contiguous()
        plan_reads(plan, sharded, data, tuple(metadata.state_dict_metadata[sharded.key].size))
        targets.append((sharded, data))
    return plan, targets


def load_sharded(checkpoint_dir: str, tensors: List[ShardedTensor], objects: List[ShardedObject],
                 metadata: Metadata) -> Tuple[Dict[Tuple, torch.Tensor], Dict[str, Any]]:
    """Collective: read the requested shards, from whichever layout each key is stored in
    (`resharding.plan_reads`). Returns ({request_id: tensor}, {unique_key: object})."""
    validate_request_against_metadata(tensors, metadata)
    for obj in objects:
        if not isinstance(metadata.state_dict_metadata.get(obj.unique_key), BytesStorageMetadata):
            raise CheckpointingException(f"checkpoint item {obj.unique_key!r} is not a stored object")
    check_data_files(checkpoint_dir, metadata)
    plan, targets = _plan_tensor_reads(tensors, metadata)
    planner = _ShardedLoadPlanner(plan.reads, objects, checkpoint_dir)
    reader = SafeFileSystemReader(checkpoint_dir)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp.load({}, storage_reader=reader, planner=planner, no_dist=not is_distributed())
    except CheckpointingException:
        raise
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        raise CheckpointingException(f"reading the checkpoint {checkpoint_dir} failed: {exc}") from exc
    for finish in plan.finishers:
        finish()
    loaded = {}
    for sharded, data in targets:
        if data.data_ptr() != sharded.data.data_ptr():
            sharded.data.copy_(data)
        loaded[request_id(sharded)] = sharded.data
    return loaded, planner.loaded_objects
