"""The `.bin`/`.idx` indexed dataset: `IndexedDataset` (a torch Dataset) plus the format pieces.

The byte layout, validation and the writer live in `_indexed_format` (torch-free) and are re-exported
here under Megatron's names: `DType`, `IndexedDatasetBuilder`, `get_idx_path`, `get_bin_path`.
"""
import os
from typing import Optional, Tuple, Union

import numpy
import torch

from megatron.core.datasets._indexed_format import (  # noqa: F401
    _INDEX_HEADER,
    DType,
    IndexedDatasetBuilder,
    _FileBinReader,
    _IndexReader,
    _MMapBinReader,
    get_bin_path,
    get_idx_path,
    write_index,
)

__all__ = ["DType", "IndexedDataset", "IndexedDatasetBuilder", "get_idx_path", "get_bin_path"]


class IndexedDataset(torch.utils.data.Dataset):
    """Low-level dataset over a `.bin`/`.idx` pair; item i is the i-th sequence.

    Args:
        path_prefix: the path without `.bin`/`.idx`.
        multimodal: whether the index carries a modes array.
        mmap: memory-map the `.bin` (otherwise use file reads).
    """

    def __init__(
        self,
        path_prefix: str,
        multimodal: bool = False,
        mmap: bool = True,
        object_storage_config=None,
        s3_config=None,
    ) -> None:
        super().__init__()
        if object_storage_config is not None or s3_config is not None:
            raise ValueError(
                f"IndexedDataset({path_prefix!r}): object storage (S3/MSC) datasets are not supported; "
                "copy the .bin/.idx files to a local or network file system"
            )
        self.path_prefix = None
        self.initialize(path_prefix, multimodal, mmap)

    def initialize(self, path_prefix: str, multimodal: bool, mmap: bool) -> None:
        """Open and validate the pair."""
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        idx_path, bin_path = get_idx_path(path_prefix), get_bin_path(path_prefix)
        self.index = _IndexReader(idx_path, multimodal)
        if not os.path.isfile(bin_path):
            raise FileNotFoundError(f"{bin_path}: data file not found (its index {idx_path} exists)")
        bin_size = os.path.getsize(bin_path)
        expected = 0
        if len(self.index) > 0:
            expected = int(self.index.sequence_pointers[-1]) + int(self.index.sequence_lengths[-1]) * self.index.dtype_size
        if bin_size != expected:
            raise ValueError(
                f"{bin_path}: data file has {bin_size} bytes but {idx_path} describes {expected} bytes "
                f"({len(self.index)} sequences of {numpy.dtype(self.index.dtype).name}): the pair is "
                "truncated or mismatched"
            )
        self.bin_reader = _MMapBinReader(bin_path) if mmap else _FileBinReader(bin_path)

    def __getstate__(self) -> Tuple[str, bool, bool]:
        return self.path_prefix, self.multimodal, self.mmap

    def __setstate__(self, state: Tuple[str, bool, bool]) -> None:
        self.initialize(*state)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, idx: Union[int, numpy.integer, slice]):
        """Sequence `idx` (with its mode when multimodal), or a list of sequences for a slice."""
        if isinstance(idx, (int, numpy.integer)):
            pointer, length, mode = self.index[idx]
            tokens = self.bin_reader.read(self.index.dtype, length, pointer)
            return (tokens, mode) if mode is not None else tokens
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"IndexedDataset({self.path_prefix!r}): slices must be contiguous (step 1), got {step}")
            lengths = self.index.sequence_lengths[start:stop]
            if len(lengths) == 0:
                return ([], []) if self.multimodal else []
            total = int(numpy.sum(lengths, dtype=numpy.int64))
            flat = self.bin_reader.read(self.index.dtype, total, int(self.index.sequence_pointers[start]))
            sequences = numpy.split(flat, numpy.cumsum(lengths[:-1], dtype=numpy.int64))
            if self.multimodal:
                return sequences, self.index.sequence_modes[start:stop]
            return sequences
        raise TypeError(f"Unexpected type received for idx: {type(idx)}")

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> numpy.ndarray:
        """`length` tokens of sequence `idx` starting `offset` tokens in (to the end when None)."""
        pointer, seq_length, mode = self.index[idx]
        if length is None:
            length = seq_length - offset
        if offset < 0 or length < 0 or offset + length > seq_length:
            raise IndexError(
                f"{self.path_prefix}: get({idx}, offset={offset}, length={length}) is outside the "
                f"sequence of {seq_length} tokens"
            )
        tokens = self.bin_reader.read(self.index.dtype, length, pointer + offset * self.index.dtype_size)
        return (tokens, mode) if mode is not None else tokens

    @property
    def sequence_lengths(self) -> numpy.ndarray:
        """int32 token count of every sequence."""
        return self.index.sequence_lengths

    @property
    def document_indices(self) -> numpy.ndarray:
        """int64 sequence boundaries of the documents (length = documents + 1)."""
        return self.index.document_indices

    def get_document_indices(self) -> numpy.ndarray:
        """The document indices (Megatron accessor)."""
        return self.index.document_indices

    def set_document_indices(self, document_indices: numpy.ndarray) -> None:
        """Replace the document indices in memory (the file is untouched)."""
        self.index.document_indices = document_indices

    @property
    def sequence_modes(self) -> Optional[numpy.ndarray]:
        """int8 mode of every sequence (None unless multimodal)."""
        return self.index.sequence_modes

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """True when both `<prefix>.idx` and `<prefix>.bin` exist."""
        return os.path.exists(get_idx_path(path_prefix)) and os.path.exists(get_bin_path(path_prefix))
