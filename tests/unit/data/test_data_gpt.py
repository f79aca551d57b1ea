"""GPTDataset / BlendedDataset index building against the spec's algorithm and Megatron's C++ loop."""
import hashlib
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron.core.datasets import helpers
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
    _get_ltor_masks_and_position_ids,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.core.datasets.utils import Split, get_blend_from_list
from megatron.training.tokenizer.tokenizer import _NullTokenizer


def reference_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch, drop_last, extra):
    """Line-by-line port of Megatron's helpers.cpp build_sample_idx."""
    total = num_epochs * tokens_per_epoch - extra
    num_samples = total // seq_length if drop_last else -(-total // seq_length)
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    sample, doc_pos, offset = 1, 0, 0
    while sample <= num_samples:
        remaining = seq_length + extra
        while remaining != 0:
            doc_length = int(sizes[doc_idx[doc_pos]]) - offset
            remaining -= doc_length
            if remaining <= 0:
                offset += remaining + doc_length - extra
                remaining = 0
            else:
                if doc_pos == len(doc_idx) - 1:
                    offset = int(sizes[doc_idx[doc_pos]]) - extra
                    break
                doc_pos += 1
                offset = 0
        out[sample] = (doc_pos, offset)
        sample += 1
    return out


def test_sample_idx_matches_cpp_loop(monkeypatch):
    # Tiny chunks so every case crosses several chunk boundaries of the cache-blocked builder.
    monkeypatch.setattr(helpers, "_SAMPLE_CHUNK", 4)
    rng = np.random.default_rng(0)
    for trial in range(40):
        sizes = rng.integers(0 if trial % 2 else 1, 12, size=int(rng.integers(2, 30))).astype(np.int32)
        sizes[-1] = max(sizes[-1], 1)
        epochs = int(rng.integers(1, 4))
        doc_idx = np.tile(np.arange(len(sizes), dtype=np.int32), epochs)
        rng.shuffle(doc_idx)
        tokens = int(sizes.sum())
        for seq in (1, 3, 7):
            for drop_last in (True, False):
                for extra in (1, 0):
                    if epochs * tokens - extra < seq:
                        continue
                    got = helpers.build_sample_idx(sizes, doc_idx, seq, epochs, tokens, drop_last, extra)
                    want = reference_sample_idx(sizes, doc_idx, seq, epochs, tokens, drop_last, extra)
                    assert got.dtype == np.int32
                    np.testing.assert_array_equal(got, want, err_msg=f"{sizes} {seq} {drop_last} {extra}")


def reference_blending(weights, size, caps=None):
    """Line-by-line port of Megatron's helpers.cpp build_(exhaustive_)blending_indices."""
    counts = [0] * len(weights)
    live = [d for d in range(len(weights)) if caps is None or caps[d] > 0]
    index, sample = np.zeros(size, np.int64), np.zeros(size, np.int64)
    for i in range(size):
        t = float(max(i, 1))
        best, best_error = -1, -np.inf
        for d in live:
            error = weights[d] * t - counts[d]
            if error > best_error:
                best, best_error = d, error
        index[i], sample[i] = best, counts[best]
        counts[best] += 1
        if caps is not None and counts[best] == caps[best]:
            live.remove(best)
    return index, sample


def check_blend(weights, size):
    index, sample = np.zeros(size, np.int16), np.zeros(size, np.int64)
    helpers.build_blending_indices(index, sample, weights, len(weights), size, False)
    want_index, want_sample = reference_blending(list(weights), size)
    np.testing.assert_array_equal(index, want_index, err_msg=str(weights))
    np.testing.assert_array_equal(sample, want_sample, err_msg=str(weights))


def check_exhaustive(sizes):
    total = int(sum(sizes))
    index, sample = np.zeros(total, np.int16), np.zeros(total, np.int64)
    helpers.build_exhaustive_blending_indices(index, sample, sizes, len(sizes))
    weights = [s / float(total) for s in sizes]
    want_index, want_sample = reference_blending(weights, total, [int(s) for s in sizes])
    np.testing.assert_array_equal(index, want_index, err_msg=str(sizes))
    np.testing.assert_array_equal(sample, want_sample, err_msg=str(sizes))


def test_blending_matches_cpp_loop():
    """Rational and generic weights, many datasets, unnormalized weights (more in test_data_blending.py)."""
    rng = np.random.default_rng(3)
    cases = [[0.5, 0.3, 0.2], [0.25] * 4, [0.7, 0.3], list(rng.dirichlet(np.ones(3))),
             list(rng.dirichlet(np.ones(6))), list(rng.dirichlet(np.ones(60))), [2.0, 1.0]]
    for weights, size in zip(cases, [20000, 9000, 7000, 30000, 4000, 1500, 3000]):
        check_blend(weights, size)
    for sizes in ([3000, 2000, 1000], [5, 4000, 0, 1200], list(rng.integers(1, 900, size=5)), [7]):
        check_exhaustive(sizes)


def test_blending_greedy_rule():
    weights = [0.5, 0.3, 0.2]
    index = np.zeros(50, np.int16)
    sample = np.zeros(50, np.int64)
    helpers.build_blending_indices(index, sample, weights, 3, 50, False)
    counts = [0, 0, 0]
    for i in range(50):
        errors = [w * max(i, 1) - c for w, c in zip(weights, counts)]
        d = int(np.argmax(errors))
        assert index[i] == d and sample[i] == counts[d]
        counts[d] += 1
    assert counts == [25, 15, 10]
    index = np.zeros(9, np.int16)
    sample = np.zeros(9, np.int64)
    helpers.build_exhaustive_blending_indices(index, sample, [5, 3, 1], 3)
    for d, n in enumerate([5, 3, 1]):
        assert sorted(sample[index == d].tolist()) == list(range(n))


def write_corpus(prefix, docs):
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for d in docs:
        b.add_document(np.array(d), [len(d)])
    b.finalize(prefix + ".idx")


def make_config(tmp_path, blend=None, **kwargs):
    defaults = dict(
        random_seed=1234, sequence_length=8, blend=blend, split="969,30,1",
        tokenizer=_NullTokenizer(100), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, path_to_cache=str(tmp_path / "cache"),
    )
    defaults.update(kwargs)
    return GPTDatasetConfig(**defaults)


def test_gpt_dataset_indices_samples_cache_and_hash(tmp_path):
    rng = np.random.default_rng(1)
    docs = [list(rng.integers(1, 99, size=int(rng.integers(1, 20)))) + [100] for _ in range(40)]
    prefix = str(tmp_path / "corpus")
    write_corpus(prefix, docs)
    config = make_config(tmp_path, blend=([prefix], None))
    low = IndexedDataset(prefix)
    indices = np.arange(0, 39, dtype=np.int32)
    T = int(low.sequence_lengths[indices].sum())
    num_samples = (T - 1) // 8 * 2 + 3  # three epochs, small final one -> separate final epoch
    ds = GPTDataset(low, prefix, indices, num_samples, Split.train, config)
    E = 3
    assert E * T >= num_samples * 8 + 1 > (E - 1) * T
    last = num_samples - ((E - 1) * T - 1) // 8
    assert last < int(0.8 * ((T - 1) // 8))
    rs = np.random.RandomState(1234)
    first = np.tile(indices, E - 1).astype(np.int32)
    rs.shuffle(first)
    final = indices.copy()
    rs.shuffle(final)
    np.testing.assert_array_equal(ds.document_index, np.concatenate([first, final]))
    want_sample = reference_sample_idx(low.sequence_lengths, ds.document_index, 8, E, T, True, 1)
    np.testing.assert_array_equal(ds.sample_index, want_sample)
    n_first = ((E - 1) * T - 1) // 8
    s1 = np.arange(n_first, dtype=np.uint32)
    rs.shuffle(s1)
    s2 = np.arange(n_first, len(want_sample) - 1, dtype=np.uint32)
    rs.shuffle(s2)
    np.testing.assert_array_equal(ds.shuffle_index, np.concatenate([s1, s2]))
    assert ds.shuffle_index.dtype == np.uint32 and len(ds) == (E * T - 1) // 8
    stream = np.concatenate([low[d] for d in ds.document_index]).astype(np.int64)
    for i in range(len(ds)):
        j = int(ds.shuffle_index[i])
        item = ds[i]
        window = stream[j * 8 : j * 8 + 9]  # consecutive samples share one boundary token
        assert item["tokens"].tolist() == window[:-1].tolist()
        assert item["labels"].tolist() == window[1:].tolist()
    # Cache file names and the md5 of Megatron's description.
    expected = {
        "class": "GPTDataset", "dataset_path": prefix, "num_samples": num_samples, "index_split": "train",
        "random_seed": 1234, "sequence_length": 8, "split": "969,30,1",
        "split_matrix": [[0, 0.969], [0.969, 0.999], [0.999, 1.0]],
        "tokenizer": {"class": "_NullTokenizer", "tokenizer_path": [None], "vocab_size": "100"},
    }
    description = json.dumps(expected, indent=4)
    assert ds.unique_description == description
    md5 = hashlib.md5(description.encode()).hexdigest()
    for affix in ("description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy"):
        assert os.path.isfile(tmp_path / "cache" / f"{md5}-GPTDataset-train-{affix}")
    again = GPTDataset(low, prefix, indices, num_samples, Split.train, config)
    assert not again.built_anew_on_cache_miss
    np.testing.assert_array_equal(again.sample_index, ds.sample_index)
    # Default cache dir lives under the prefix.
    config2 = make_config(tmp_path, blend=([prefix], None), path_to_cache=None)
    GPTDataset(low, prefix, indices, None, Split.valid, config2)
    assert os.path.isdir(os.path.join(prefix, "cache", "GPTDataset_indices"))


def test_masks_and_pad_handling():
    eod = 9
    data = torch.tensor([1, 2, eod, 3, 4, eod, 5, 6])
    att, loss, pos = _get_ltor_masks_and_position_ids(data, eod, True, True, True, True)
    assert pos.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert loss.tolist() == [1, 1, 0, 1, 1, 0, 1, 1]
    ref = torch.tril(torch.ones(8, 8))
    for i in (2, 5):
        ref[i + 1 :, : i + 1] = 0
    assert att.dtype == torch.bool and att.shape == (1, 8, 8)
    assert torch.equal(att[0], ref < 0.5)
    att, loss, pos = _get_ltor_masks_and_position_ids(data, eod, False, False, False, False)
    assert att is None and pos.tolist() == list(range(8)) and loss.sum() == 8


class _PadTokenizer(_NullTokenizer):
    @property
    def pad(self):
        return 7


def test_pad_tokens_masked_and_mock_vocab_check(tmp_path):
    prefix = str(tmp_path / "p")
    write_corpus(prefix, [[1, 7, 2, 3, 100], [4, 5, 6, 100]])
    config = make_config(tmp_path, blend=([prefix], None), tokenizer=_PadTokenizer(100), create_attention_mask=False)
    ds = GPTDataset(IndexedDataset(prefix), prefix, np.arange(2, dtype=np.int32), None, Split.train, config)
    for i in range(len(ds)):
        item = ds[i]
        assert "attention_mask" not in item
        raw = ds._query_document_sample_shuffle_indices(i)[0]
        assert item["loss_mask"].tolist() == [0.0 if x == 7 else 1.0 for x in raw[1:]]
        assert 7 not in item["tokens"].tolist()
    with pytest.raises(ValueError, match="--vocab-size 4094"):
        mock = GPTDatasetConfig(random_seed=1, sequence_length=8, tokenizer=_NullTokenizer(128),
                                reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
        BlendedMegatronDatasetBuilder(MockGPTDataset, [10, 10, 10], lambda: True, mock).build()


def test_blended_builder_and_blend_parsing(tmp_path):
    rng = np.random.default_rng(2)
    prefixes = []
    for k in range(2):
        prefix = str(tmp_path / f"c{k}")
        write_corpus(prefix, [list(rng.integers(1, 99, size=15)) + [100] for _ in range(30)])
        prefixes.append(prefix)
    assert get_blend_from_list(["0.3", prefixes[0], "0.7", prefixes[1]]) == (prefixes, [0.3, 0.7])
    assert get_blend_from_list([prefixes[0], prefixes[1]]) == (prefixes, None)
    assert get_blend_from_list([prefixes[0]]) == ([prefixes[0]], None)
    config = make_config(tmp_path, blend=(prefixes, [0.3, 0.7]), split="90,10,0", mid_level_dataset_surplus=0.005)
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [40, 10, None], lambda: True, config).build()
    assert test is None and isinstance(train, BlendedDataset) and len(train) == 12 + 28
    assert train.datasets[0].num_samples == int(np.ceil(12 * 1.005))
    counts = [0, 0]
    for i in range(len(train)):
        errors = [w * max(i, 1) - c for w, c in zip(train.weights, counts)]
        d = int(np.argmax(errors))
        assert train.dataset_index[i] == d
        counts[d] += 1
    item = train[5]
    assert int(item["dataset_id"]) == int(train.dataset_index[5]) and item["tokens"].shape == (8,)
    cache = os.listdir(tmp_path / "cache")
    assert any(f.endswith("-BlendedDataset-train-dataset_index.npy") for f in cache)
    per_split = make_config(tmp_path, blend=None, split=None,
                            blend_per_split=[(prefixes, None), ([prefixes[1]], None), None])
    tr, va, te = BlendedMegatronDatasetBuilder(GPTDataset, [20, 5, 0], lambda: True, per_split).build()
    assert isinstance(tr, BlendedDataset) and isinstance(va, GPTDataset) and te is None
    with pytest.raises(ValueError, match="split"):
        make_config(tmp_path, blend=(prefixes, None), split=None)


def test_mock_gpt_dataset():
    from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

    config = GPTDatasetConfig(random_seed=5, sequence_length=16, tokenizer=_NullTokenizer(4096),
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    assert config.mock and config.split == "1,1,1"
    low = MockGPTLowLevelDataset(config.tokenizer)
    lengths = np.random.default_rng(0).integers(1, 4096, size=100000, dtype=np.int32)
    np.testing.assert_array_equal(low.sequence_lengths, lengths)
    assert low[0].tolist() == list(range(1, int(lengths[0]))) + [4096]
    ds = MockGPTDataset(low, None, np.arange(50, dtype=np.int32), 20, Split.train, config)
    item = ds[3]
    assert item["tokens"].dtype == torch.int64 and item["tokens"].shape == (16,)
    assert item["attention_mask"].dtype == torch.bool and item["attention_mask"].shape == (1, 16, 16)
    assert item["loss_mask"].dtype == torch.float32 and item["position_ids"].dtype == torch.int64
    assert torch.equal(item["labels"][:-1], item["tokens"][1:])
