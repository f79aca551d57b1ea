"""The `.bin`/`.idx` indexed dataset: `IndexedDataset` (a torch Dataset) plus the format pieces.

The byte layout, validation and the writer live in `_indexed_format` (torch-free) and are re-exported
here under Megatron's names: `DType`, `IndexedDatasetBuilder`, `get_idx_path`, `get_bin_path`.
`_IndexWriter` is Megatron's streaming `.idx` writer (a context manager); it writes the bytes the builder writes.
"""
import os
import struct
from typing import List, Optional, Tuple, Type, Union

import numpy
import torch

from megatron.core.datasets._indexed_format import (  # noqa: F401
    _INDEX_HEADER,
    _INDEX_VERSION,
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


class _IndexWriter:
    """Writes an `.idx` file: the header on `__enter__`, the arrays in `write`, closed on `__exit__`.

    Args:
        idx_path: where to write.
        dtype: the numpy dtype of the tokens in the matching `.bin` (sets the pointers' byte stride).
    """

    def __init__(self, idx_path: str, dtype: Type[numpy.number]) -> None:
        self.idx_path = idx_path
        self.dtype = dtype
        self.idx_writer = None

    def __enter__(self) -> "_IndexWriter":
        self.idx_writer = open(self.idx_path, "wb")
        self.idx_writer.write(_INDEX_HEADER)
        self.idx_writer.write(struct.pack("<Q", _INDEX_VERSION))
        self.idx_writer.write(struct.pack("<B", DType.code_from_dtype(self.dtype)))
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> Optional[bool]:
        self.idx_writer.close()
        return None

    def write(self, sequence_lengths: List[int], sequence_modes: Optional[List[int]],
              document_indices: List[int]) -> None:
        """Counts, then int32 lengths, int64 byte pointers, int64 document indices and (multimodal) int8 modes."""
        self.idx_writer.write(struct.pack("<Q", len(sequence_lengths)))
        self.idx_writer.write(struct.pack("<Q", len(document_indices)))
        self.idx_writer.write(numpy.asarray(sequence_lengths, dtype=numpy.int32).tobytes(order="C"))
        pointers = numpy.asarray(self._sequence_pointers(sequence_lengths), dtype=numpy.int64)
        self.idx_writer.write(pointers.tobytes(order="C"))
        self.idx_writer.write(numpy.asarray(document_indices, dtype=numpy.int64).tobytes(order="C"))
        if sequence_modes is not None:
            self.idx_writer.write(numpy.asarray(sequence_modes, dtype=numpy.int8).tobytes(order="C"))

    def _sequence_pointers(self, sequence_lengths: List[int]) -> List[int]:
        """Byte offset of every sequence in the `.bin`: running sum of the previous lengths times the item size."""
        itemsize = DType.size(self.dtype)
        pointers, current = [], 0
        for length in sequence_lengths:
            pointers.append(current)
            current += int(length) * itemsize
        return pointers


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
