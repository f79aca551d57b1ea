"""Plain `torch.distributed.checkpoint` save/load of a nested state dict: Megatron's `torch_dcp` format.

Megatron-LM writes this format with `torch.distributed.checkpoint.save(state_dict, FileSystemWriter(dir))`:
the directory holds only DCP's `.metadata` and `__{rank}_{k}.distcp` files. Everything of the state dict
lives there, the non-tensor leaves (args, iteration, scheduler, param groups) as DCP bytes items; there is
no `common.pt` and no `metadata.json`. DTensors (FSDP2 parameters and optimizer state) are stored by
global shape and offsets, so they load at another data-parallel size; plain tensors with the same key
on several ranks are treated as replicas and written once.

Design note (no unrestricted unpickling): DCP's default load planner unpickles bytes items with no type
restriction. Our planner reads them with `safe_torch_load` (the checkpoint allow-list),
and `.metadata` goes through the allow-list unpickler of the torch_dist backend.
"""
import io
import warnings
from typing import Any, Dict, Optional, Set

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from megatron.core.dist_checkpointing.mapping import CheckpointingException
from megatron.core.dist_checkpointing.safe_load import safe_torch_load
from megatron.core.dist_checkpointing.strategies._collectives import is_distributed
from megatron.core.dist_checkpointing.strategies.torch import (
    DEFAULT_THREAD_COUNT,
    SafeFileSystemReader,
    check_data_files,
    read_dcp_metadata,
)


class SafeBytesLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner with bytes items read by the checkpoint allow-list loader."""

    def __init__(self, checkpoint_dir: str, allow_partial_load: bool = False):
        super().__init__(allow_partial_load=allow_partial_load)
        self._checkpoint_dir = checkpoint_dir

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = safe_torch_load(value, name=f"{self._checkpoint_dir} item {fqn!r}")
        if self.flatten_state_dict:
            # Planner state set up by DefaultLoadPlanner: the request before flattening and the fqn -> path map.
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def save_state_dict(state_dict: Dict[str, Any], checkpoint_dir: str,
                    thread_count: int = DEFAULT_THREAD_COUNT) -> None:
    """Collective: write `state_dict` with DCP into `checkpoint_dir` (`.metadata` is written last)."""
    writer = dcp.FileSystemWriter(checkpoint_dir, thread_count=thread_count, sync_files=True, overwrite=True)
    with warnings.catch_warnings():
        # A fresh temp dir is written every time; DCP's "existing checkpoint" warning does not apply.
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        dcp.save(state_dict, storage_writer=writer, no_dist=not is_distributed())


def stored_keys(checkpoint_dir: str, metadata: Optional[Metadata] = None) -> Set[str]:
    """The flattened keys (`model.embedding.word_embeddings.weight`, `iteration`, ...) a checkpoint holds."""
    metadata = metadata if metadata is not None else read_dcp_metadata(checkpoint_dir)
    return set(metadata.state_dict_metadata)


def load_state_dict(state_dict: Dict[str, Any], checkpoint_dir: str, no_dist: Optional[bool] = None) -> Dict[str, Any]:
    """Fill `state_dict` from a DCP checkpoint: tensors and DTensors in place, other leaves replaced by the
    stored values (placeholders such as None are fine). Every requested key must exist; raises
    CheckpointingException naming the directory and the missing keys, or the damaged file."""
    metadata = read_dcp_metadata(checkpoint_dir)
    check_data_files(checkpoint_dir, metadata)
    planner = SafeBytesLoadPlanner(checkpoint_dir)
    no_dist = not is_distributed() if no_dist is None else no_dist
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp.load(state_dict, storage_reader=SafeFileSystemReader(checkpoint_dir), planner=planner,
                     no_dist=no_dist)
    except CheckpointingException:
        raise
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        text = str(exc)
        if "Missing key in checkpoint state_dict" in text:
            wanted = _flat_keys(state_dict)
            missing = sorted(wanted - stored_keys(checkpoint_dir, metadata))
            text = f"keys missing from the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}"
        raise CheckpointingException(f"reading the torch_dcp checkpoint {checkpoint_dir} failed: {text}") from exc
    return state_dict


def _flat_keys(state_dict: Dict[str, Any]) -> Set[str]:
    flat, _ = flatten_state_dict(state_dict)
    return set(flat)


__all__ = ["SafeBytesLoadPlanner", "save_state_dict", "load_state_dict", "stored_keys"]
