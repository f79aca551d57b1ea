"""build_sample_idx's two fill paths (int64 words, index pairs) and its int64 output against the C++ port."""
import numpy as np

from megatron.core.datasets import helpers
from tests.unit.data.test_data_gpt import reference_sample_idx


def random_cases(rng, count):
    for trial in range(count):
        sizes = rng.integers(0 if trial % 2 else 1, 12, size=int(rng.integers(2, 30))).astype(np.int32)
        sizes[-1] = max(sizes[-1], 1)
        epochs = int(rng.integers(1, 4))
        doc_idx = np.tile(np.arange(len(sizes), dtype=np.int32), epochs)
        rng.shuffle(doc_idx)
        for seq in (1, 2, 3, 8):
            for drop_last in (True, False):
                for extra in (1, 0):
                    if epochs * int(sizes.sum()) - extra >= seq:
                        yield sizes, doc_idx, seq, epochs, int(sizes.sum()), drop_last, extra


def test_pairs_path_and_int64_output(monkeypatch):
    monkeypatch.setattr(helpers, "_SAMPLE_CHUNK", 3)
    rng = np.random.default_rng(1)
    monkeypatch.setattr(helpers, "_fill_words", helpers._fill_pairs)
    for case in random_cases(rng, 15):
        got = helpers.build_sample_idx(*case)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, reference_sample_idx(*case))
    monkeypatch.undo()
    monkeypatch.setattr(helpers, "_SAMPLE_CHUNK", 5)
    monkeypatch.setattr(helpers, "_INT32_MAX", 4)  # every case needs the int64 index
    for case in random_cases(rng, 15):
        got = helpers.build_sample_idx(*case)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, reference_sample_idx(*case))


def test_words_path_large_lengths():
    # Offsets near 2**31 and many documents starting at one row exercise the word arithmetic.
    rng = np.random.default_rng(2)
    sizes = np.concatenate([rng.integers(0, 3, size=200), [2**31 - 10, 5, 2**30]]).astype(np.int32)
    doc_idx = rng.permutation(np.arange(len(sizes), dtype=np.int32))
    tokens = int(sizes.sum())
    for seq, extra in ((2**29, 1), (2**28 + 3, 0)):
        got = helpers.build_sample_idx(sizes, doc_idx, seq, 1, tokens, True, extra)
        np.testing.assert_array_equal(got, reference_sample_idx(sizes, doc_idx, seq, 1, tokens, True, extra))
