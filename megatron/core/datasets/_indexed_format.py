"""The `.bin`/`.idx` format without torch: `DType`, the index reader/writer and `IndexedDatasetBuilder`.

`megatron.core.datasets.indexed_dataset` re-exports all of it next to `IndexedDataset` (the torch
Dataset); this module stays torch-free so `tools/preprocess_data.py` starts fast.

Byte layout (little-endian; see docs/data.md): the `.bin` is every sequence's tokens back to back.
The `.idx` is `b"MMIDIDX\\x00\\x00"`, `<Q` version 1, `<B` dtype code, `<Q` sequence count N, `<Q`
document-index length D, then int32[N] lengths, int64[N] byte pointers, int64[D] document indices,
and int8[N] modes when multimodal.

Design notes:
- Reads validate the header and every size against the file lengths, so a truncated, corrupt or
  mismatched pair fails with the file name and the problem instead of returning wrong tokens.
- The builder writes `<name>.partial` files and renames them only in `finalize`, so a crash never
  leaves a complete-looking `.bin`/`.idx` pair behind.
"""
import os
import shutil
import struct
from enum import Enum
from typing import List, Optional, Tuple, Type, Union

import numpy

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_INDEX_VERSION = 1
_HEADER_BYTES = len(_INDEX_HEADER) + 8 + 1 + 8 + 8
_PARTIAL = ".partial"


class DType(Enum):
    """The numpy dtype codes stored in the `.idx` header."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, value: Type[numpy.number]) -> int:
        """The header code of a numpy dtype."""
        return cls[numpy.dtype(value).name].value

    @classmethod
    def dtype_from_code(cls, value: int) -> Type[numpy.number]:
        """The numpy dtype of a header code."""
        return getattr(numpy, cls(value).name)

    @staticmethod
    def size(key: Union[int, Type[numpy.number]]) -> int:
        """Bytes per element of a dtype or header code."""
        if isinstance(key, int):
            return numpy.dtype(DType.dtype_from_code(key)).itemsize
        return numpy.dtype(key).itemsize

    @staticmethod
    def optimal_dtype(cardinality: Optional[int]) -> Type[numpy.number]:
        """uint16 when the (unpadded) vocab size is below 65500, else int32."""
        if cardinality is not None and cardinality < 65500:
            return numpy.uint16
        return numpy.int32


def get_idx_path(path_prefix: str) -> str:
    """`<prefix>.idx`."""
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    """`<prefix>.bin`."""
    return path_prefix + ".bin"


def write_index(idx_path: str, dtype, sequence_lengths, document_indices, sequence_modes=None) -> None:
    """Write an `.idx` file for the given arrays (pointers are derived from the lengths)."""
    lengths = numpy.asarray(sequence_lengths, dtype=numpy.int32)
    itemsize = DType.size(dtype)
    pointers = numpy.zeros(len(lengths), dtype=numpy.int64)
    if len(lengths) > 1:
        numpy.cumsum(lengths[:-1], dtype=numpy.int64, out=pointers[1:])
    pointers *= itemsize
    doc_idx = numpy.asarray(document_indices, dtype=numpy.int64)
    with open(idx_path, "wb") as out:
        out.write(_INDEX_HEADER)
        out.write(struct.pack("<Q", _INDEX_VERSION))
        out.write(struct.pack("<B", DType.code_from_dtype(dtype)))
        out.write(struct.pack("<Q", len(lengths)))
        out.write(struct.pack("<Q", len(doc_idx)))
        out.write(lengths.tobytes(order="C"))
        out.write(pointers.tobytes(order="C"))
        out.write(doc_idx.tobytes(order="C"))
        if sequence_modes is not None:
            out.write(numpy.asarray(sequence_modes, dtype=numpy.int8).tobytes(order="C"))


class _IndexReader:
    """Parse and validate an `.idx` file; arrays are views into a memory map of the file."""

    def __init__(self, idx_path: str, multimodal: bool) -> None:
        if not os.path.isfile(idx_path):
            raise FileNotFoundError(f"{idx_path}: index file not found")
        file_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as stream:
            header = stream.read(_HEADER_BYTES)
        if len(header) < _HEADER_BYTES:
            raise ValueError(f"{idx_path}: truncated index header ({file_size} bytes, need {_HEADER_BYTES})")
        if header[: len(_INDEX_HEADER)] != _INDEX_HEADER:
            raise ValueError(f"{idx_path}: not a Megatron index file (bad magic {header[:9]!r})")
        version, code, count, doc_count = struct.unpack("<QBQQ", header[len(_INDEX_HEADER):])
        if version != _INDEX_VERSION:
            raise ValueError(f"{idx_path}: unsupported index version {version} (expected {_INDEX_VERSION})")
        try:
            self.dtype = DType.dtype_from_code(code)
        except ValueError:
            raise ValueError(f"{idx_path}: unknown dtype code {code} in the index header") from None
        self.dtype_size = DType.size(self.dtype)
        self.sequence_count = count
        self.document_count = doc_count
        body = 12 * count + 8 * doc_count
        expected = _HEADER_BYTES + body + (count if multimodal else 0)
        if file_size != expected:
            hint = ""
            if file_size == expected + count and not multimodal:
                hint = " (it looks multimodal: open it with multimodal=True)"
            elif multimodal and file_size == expected - count:
                hint = " (it has no modes array: open it with multimodal=False)"
            raise ValueError(
                f"{idx_path}: index size is {file_size} bytes but its header ({count} sequences, "
                f"{doc_count} document-index entries, multimodal={multimodal}) needs {expected}: "
                f"the file is truncated, corrupt or of another kind{hint}"
            )
        self._buffer = numpy.memmap(idx_path, mode="r", order="C") if file_size > 0 else None
        offset = _HEADER_BYTES
        self.sequence_lengths = self._view(numpy.int32, count, offset)
        offset += 4 * count
        self.sequence_pointers = self._view(numpy.int64, count, offset)
        offset += 8 * count
        self.document_indices = self._view(numpy.int64, doc_count, offset)
        offset += 8 * doc_count
        self.sequence_modes = self._view(numpy.int8, count, offset) if multimodal else None
        if doc_count < 1 or self.document_indices[0] != 0 or self.document_indices[-1] != count:
            raise ValueError(
                f"{idx_path}: corrupt document index (must start at 0 and end at the sequence count "
                f"{count}; got {doc_count} entries)"
            )

    def _view(self, dtype, count: int, offset: int) -> numpy.ndarray:
        return numpy.frombuffer(self._buffer, dtype=dtype, count=count, offset=offset)

    def __len__(self) -> int:
        return self.sequence_count

    def __getitem__(self, idx: int) -> Tuple[int, int, Optional[int]]:
        mode = self.sequence_modes[idx] if self.sequence_modes is not None else None
        return int(self.sequence_pointers[idx]), int(self.sequence_lengths[idx]), mode


class _MMapBinReader:
    """Reads tokens from a memory map of the `.bin`."""

    def __init__(self, bin_path: str) -> None:
        size = os.path.getsize(bin_path)
        self._buffer = numpy.memmap(bin_path, mode="r", order="C") if size > 0 else numpy.zeros(0, numpy.uint8)

    def read(self, dtype, count: int, offset: int) -> numpy.ndarray:
        return numpy.frombuffer(self._buffer, dtype=dtype, count=count, offset=offset)


class _FileBinReader:
    """Reads tokens with plain file reads (`--no-mmap-bin-files`)."""

    def __init__(self, bin_path: str) -> None:
        self._path = bin_path

    def read(self, dtype, count: int, offset: int) -> numpy.ndarray:
        out = numpy.empty(count, dtype=dtype)
        with open(self._path, "rb", buffering=0) as stream:
            stream.seek(offset)
            got = stream.readinto(memoryview(out).cast("B"))
        if got != out.nbytes:
            raise ValueError(f"{self._path}: short read at byte {offset} ({got} of {out.nbytes} bytes)")
        return out


class IndexedDatasetBuilder:
    """Write a `.bin`/`.idx` pair.

    Args:
        bin_path: the `.bin` path to produce (written as `<bin_path>.partial` until `finalize`).
        dtype: token dtype.
        multimodal: also write a modes array.
    """

    def __init__(self, bin_path: str, dtype: Type[numpy.number] = numpy.int32, multimodal: bool = False) -> None:
        self.bin_path = bin_path
        self._partial_bin = bin_path + _PARTIAL
        self.data_file = open(self._partial_bin, "wb")
        self.dtype = dtype
        self.multimodal = multimodal
        self._lengths: List[numpy.ndarray] = []
        self._num_sequences = 0
        self.document_indices: List[int] = [0]
        self._modes: List[numpy.ndarray] = []

    @property
    def sequence_lengths(self) -> numpy.ndarray:
        """Lengths of the sequences written so far."""
        return numpy.concatenate(self._lengths) if self._lengths else numpy.zeros(0, numpy.int32)

    def _append_lengths(self, lengths, modes=None) -> None:
        lengths = numpy.asarray(lengths, dtype=numpy.int32).reshape(-1)  # [n] or [n, 1] -> [n]
        self._lengths.append(lengths)
        self._num_sequences += len(lengths)
        if self.multimodal:
            if modes is None:
                modes = numpy.zeros(len(lengths), dtype=numpy.int8)
            self._modes.append(numpy.asarray(modes, dtype=numpy.int8).reshape(-1))  # [n] -> [n]

    def _write_tokens(self, tokens) -> int:
        if hasattr(tokens, "numpy") and not isinstance(tokens, numpy.ndarray):
            tokens = tokens.numpy()  # a torch.Tensor
        array = numpy.asarray(tokens, dtype=self.dtype)
        self.data_file.write(array.tobytes(order="C"))
        return array.size

    def add_item(self, tensor, mode: int = 0) -> None:
        """Append one sequence."""
        count = self._write_tokens(tensor)
        self._append_lengths([count], [mode])

    def add_document(self, tensor, lengths: List[int], modes: Optional[List[int]] = None) -> None:
        """Append one document: `tensor` holds its sequences back to back, `lengths` their sizes."""
        count = self._write_tokens(tensor)
        lengths = numpy.asarray(lengths, dtype=numpy.int64)
        if int(lengths.sum()) != count:
            raise ValueError(f"add_document: lengths sum to {int(lengths.sum())} but the tensor has {count} tokens")
        self._append_lengths(lengths, modes)
        self.document_indices.append(self._num_sequences)

    def add_documents(self, tokens: numpy.ndarray, sequence_lengths: numpy.ndarray, sequences_per_document: numpy.ndarray) -> None:
        """Bulk form of `add_document` for many documents at once (the preprocessing fast path)."""
        count = self._write_tokens(tokens)
        sequence_lengths = numpy.asarray(sequence_lengths, dtype=numpy.int64)
        if int(sequence_lengths.sum()) != count:
            raise ValueError(f"add_documents: lengths sum to {int(sequence_lengths.sum())} but there are {count} tokens")
        ends = self._num_sequences + numpy.cumsum(numpy.asarray(sequences_per_document, dtype=numpy.int64))
        self._append_lengths(sequence_lengths)
        if len(ends) and ends[-1] != self._num_sequences:
            raise ValueError("add_documents: sequences_per_document does not sum to the number of sequences")
        self.document_indices.extend(ends.tolist())

    def end_document(self) -> None:
        """Close the current document after `add_item` calls."""
        self.document_indices.append(self._num_sequences)

    def add_index(self, path_prefix: str) -> None:
        """Append a whole existing dataset (same dtype) at `path_prefix`."""
        index = _IndexReader(get_idx_path(path_prefix), multimodal=self.multimodal)
        if index.dtype != self.dtype:
            raise ValueError(
                f"{get_idx_path(path_prefix)}: dtype {numpy.dtype(index.dtype).name} differs from the "
                f"builder's {numpy.dtype(self.dtype).name}; merge datasets of one dtype"
            )
        offset = self._num_sequences
        self._append_lengths(numpy.array(index.sequence_lengths), index.sequence_modes)
        self.document_indices.extend((offset + index.document_indices[1:]).tolist())
        with open(get_bin_path(path_prefix), "rb") as stream:
            shutil.copyfileobj(stream, self.data_file, 16 * 1024 * 1024)

    def finalize(self, idx_path: str) -> None:
        """Write the index and move both files into place (`.bin` first, then `.idx`)."""
        self.data_file.close()
        partial_idx = idx_path + _PARTIAL
        modes = numpy.concatenate(self._modes) if self.multimodal and self._modes else None
        if self.multimodal and modes is None:
            modes = numpy.zeros(0, dtype=numpy.int8)
        write_index(partial_idx, self.dtype, self.sequence_lengths, self.document_indices, modes)
        if os.path.exists(idx_path):
            os.remove(idx_path)
        os.replace(self._partial_bin, self.bin_path)
        os.replace(partial_idx, idx_path)

    def abort(self) -> None:
        """Close and delete the partial files (used when preprocessing fails)."""
        self.data_file.close()
        for path in (self._partial_bin,):
            if os.path.exists(path):
                os.remove(path)
