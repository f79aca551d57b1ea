"""`.bin/.idx` compatibility: files written from the documented layout read back, and ours match it."""
import os
import struct

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7, np.uint16: 8}


def spec_write(prefix, dtype, docs, modes=None):
    """Write a pair straight from the spec table (docs = list of documents = list of sequences)."""
    seqs = [np.asarray(s, dtype=dtype) for d in docs for s in d]
    lengths = np.array([len(s) for s in seqs], dtype=np.int32)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.array([int(lengths[:i].sum()) * itemsize for i in range(len(seqs))], dtype=np.int64)
    doc_idx = np.array([0] + list(np.cumsum([len(d) for d in docs])), dtype=np.int64)
    with open(prefix + ".bin", "wb") as f:
        for s in seqs:
            f.write(s.tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", CODES[dtype]))
        f.write(struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(doc_idx)))
        f.write(lengths.tobytes() + pointers.tobytes() + doc_idx.tobytes())
        if modes is not None:
            f.write(np.asarray(modes, dtype=np.int8).tobytes())
    return seqs, doc_idx


def spec_read(prefix):
    """An independent reader following the spec table."""
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, n, d = struct.unpack("<QBQQ", raw[9:34])
    assert version == 1
    dtype = {v: k for k, v in CODES.items()}[code]
    lengths = np.frombuffer(raw, np.int32, n, 34)
    pointers = np.frombuffer(raw, np.int64, n, 34 + 4 * n)
    doc_idx = np.frombuffer(raw, np.int64, d, 34 + 12 * n)
    data = open(prefix + ".bin", "rb").read()
    seqs = [np.frombuffer(data, dtype, int(l), int(p)) for l, p in zip(lengths, pointers)]
    return dtype, seqs, doc_idx


DOCS = [[[5, 6, 7], [8]], [[9, 10]], [[1], [2, 3], [4, 4, 4, 4]]]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_spec_files_read_and_builder_matches_spec_bytes(tmp_path, dtype):
    ref = str(tmp_path / "ref")
    seqs, doc_idx = spec_write(ref, dtype, DOCS)
    for mmap in (True, False):
        ds = IndexedDataset(ref, mmap=mmap)
        assert len(ds) == len(seqs) == 6
        assert ds.sequence_lengths.tolist() == [3, 1, 2, 1, 2, 4]
        assert ds.document_indices.tolist() == doc_idx.tolist() == [0, 2, 3, 6]
        for i, s in enumerate(seqs):
            assert ds[i].dtype == dtype and ds[i].tolist() == s.tolist()
        assert [x.tolist() for x in ds[1:4]] == [[8], [9, 10], [1]]
        assert ds.get(5, offset=1, length=2).tolist() == [4, 4]
        assert ds.get(0, offset=1).tolist() == [6, 7]
        with pytest.raises(IndexError):
            ds.get(1, offset=0, length=2)
    ours = str(tmp_path / "ours")
    builder = IndexedDatasetBuilder(ours + ".bin", dtype=dtype)
    for doc in DOCS[:2]:
        builder.add_document(np.concatenate([np.array(s) for s in doc]), [len(s) for s in doc])
    for s in DOCS[2]:
        builder.add_item(np.array(s))
    builder.end_document()
    builder.finalize(ours + ".idx")
    for ext in (".bin", ".idx"):
        assert open(ours + ext, "rb").read() == open(ref + ext, "rb").read()
    got_dtype, got_seqs, got_doc_idx = spec_read(ours)
    assert got_dtype == dtype and got_doc_idx.tolist() == [0, 2, 3, 6]
    # Bulk path and merging produce the same bytes.
    bulk = str(tmp_path / "bulk")
    b = IndexedDatasetBuilder(bulk + ".bin", dtype=dtype)
    flat = [t for d in DOCS for s in d for t in s]
    b.add_documents(np.array(flat), [len(s) for d in DOCS for s in d], [len(d) for d in DOCS])
    b.finalize(bulk + ".idx")
    assert open(bulk + ".idx", "rb").read() == open(ref + ".idx", "rb").read()
    merged = str(tmp_path / "merged")
    m = IndexedDatasetBuilder(merged + ".bin", dtype=dtype)
    m.add_index(ref)
    m.add_index(ours)
    m.finalize(merged + ".idx")
    md = IndexedDataset(merged)
    assert md.document_indices.tolist() == [0, 2, 3, 6, 8, 9, 12]
    assert [x.tolist() for x in md[6:8]] == [[5, 6, 7], [8]]


def test_multimodal_and_dtype_helpers(tmp_path):
    ref = str(tmp_path / "mm")
    spec_write(ref, np.int32, DOCS, modes=[0, 1, 0, 2, 1, 0])
    ds = IndexedDataset(ref, multimodal=True)
    assert ds.sequence_modes.tolist() == [0, 1, 0, 2, 1, 0]
    tokens, mode = ds[3]
    assert tokens.tolist() == [1] and mode == 2
    ours = str(tmp_path / "mm2")
    b = IndexedDatasetBuilder(ours + ".bin", dtype=np.int32, multimodal=True)
    for doc, modes in zip(DOCS, [[0, 1], [0], [2, 1, 0]]):
        for s, md in zip(doc, modes):
            b.add_item(np.array(s), mode=md)
        b.end_document()
    b.finalize(ours + ".idx")
    assert open(ours + ".idx", "rb").read() == open(ref + ".idx", "rb").read()
    with pytest.raises(ValueError, match="multimodal=True"):
        IndexedDataset(ref, multimodal=False)
    assert DType.optimal_dtype(65499) == np.uint16 and DType.optimal_dtype(65500) == np.int32
    assert DType.code_from_dtype(np.uint16) == 8 and DType.dtype_from_code(4) == np.int32
    assert DType.size(np.int64) == 8 and DType.size(8) == 2


def test_corrupt_truncated_and_partial_files_fail_clearly(tmp_path):
    ref = str(tmp_path / "c")
    spec_write(ref, np.uint16, DOCS)
    raw_idx = open(ref + ".idx", "rb").read()
    raw_bin = open(ref + ".bin", "rb").read()
    cases = [
        (raw_idx[:-3], raw_bin, "truncated"),
        (b"XXXXXXXXX" + raw_idx[9:], raw_bin, "bad magic"),
        (raw_idx[:9] + struct.pack("<Q", 2) + raw_idx[17:], raw_bin, "version"),
        (raw_idx[:17] + bytes([42]) + raw_idx[18:], raw_bin, "dtype code"),
        (raw_idx, raw_bin[:-2], "mismatched"),
        (raw_idx[:10], raw_bin, "truncated index header"),
    ]
    for idx_bytes, bin_bytes, message in cases:
        with open(ref + ".idx", "wb") as f:
            f.write(idx_bytes)
        with open(ref + ".bin", "wb") as f:
            f.write(bin_bytes)
        with pytest.raises(ValueError, match=message) as err:
            IndexedDataset(ref)
        assert "c.idx" in str(err.value) or "c.bin" in str(err.value)
    with open(ref + ".idx", "wb") as f:
        f.write(raw_idx)
    os.remove(ref + ".bin")
    with pytest.raises(FileNotFoundError, match="c.bin"):
        IndexedDataset(ref)
    out = str(tmp_path / "partial")
    b = IndexedDatasetBuilder(out + ".bin", dtype=np.uint16)
    b.add_item(np.array([1, 2]))
    b.end_document()
    assert not IndexedDataset.exists(out) and not os.path.exists(out + ".bin")
    b.finalize(out + ".idx")
    assert IndexedDataset.exists(out) and not os.path.exists(out + ".bin.partial")
    with pytest.raises(ValueError, match="dtype"):
        IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.int32).add_index(out)
