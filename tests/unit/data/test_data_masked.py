"""BERT and T5 masked datasets vs a reference written here from Megatron's documented algorithm.

The corpus is preprocessed in the test (`tools/preprocess_data.py --split-sentences`). The reference
re-implements `helpers.cpp:build_mapping` literally (two RNG passes are one here: both start from
`std::mt19937(seed)`; a scalar `std::mt19937_64` written from the C++ standard for the shuffle) and the
sample construction of `bert_dataset.py` / `t5_dataset.py` / `masked_dataset.py` step by step. Cache files
must carry Megatron's names, hold the description whose md5 names them, and be reused on a second build.
"""
import hashlib
import json
import os
from collections import deque

import numpy as np
import pytest

from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig
from megatron.core.datasets.utils import Split
from megatron.training.tokenizer.bert_tokenization import _BertWordPieceTokenizer
from tests.unit.data.masked_corpus import write_masked_corpus

SEED, NUM_SAMPLES = 1234, 40


def _mt64(seed):
    """Scalar std::mt19937_64 (C++ [rand.eng.mers] parameters)."""
    mask = (1 << 64) - 1
    mt = [seed & mask]
    for i in range(1, 312):
        mt.append((6364136223846793005 * (mt[-1] ^ (mt[-1] >> 62)) + i) & mask)
    index = 312
    while True:
        if index >= 312:
            for i in range(312):
                x = (mt[i] & 0xFFFFFFFF80000000) | (mt[(i + 1) % 312] & 0x7FFFFFFF)
                mt[i] = mt[(i + 156) % 312] ^ (x >> 1) ^ (0xB5026F5AA96619E9 if x & 1 else 0)
            index = 0
        y = mt[index]
        index += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000
        y ^= (y << 37) & 0xFFF7EEE000000000
        y ^= y >> 43
        yield y


def _reference_mapping(docs, sizes, num_samples, max_len, short_prob, seed, min_sent):
    rng32 = np.random.RandomState(seed)  # std::mt19937(seed): same seeding, same 32-bit words
    ratio = int(round(1.0 / short_prob)) if short_prob > 0 else 0

    def target():
        if ratio == 0:
            return max_len
        r = int(rng32.randint(0, 2**32, dtype=np.uint64))
        return 2 + r % (max_len - 1) if r % ratio == 0 else max_len

    rows = []
    while len(rows) < num_samples:
        for d in range(len(docs) - 1):
            first, last = int(docs[d]), int(docs[d + 1])
            remain = last - first
            long_sentence = remain > 1 and any(int(sizes[s]) > 512 for s in range(first, last))
            if remain < min_sent or long_sentence:
                continue
            seq_len = num_sent = 0
            start, tgt = first, target()
            for s in range(first, last):
                seq_len += int(sizes[s])
                num_sent += 1
                remain -= 1
                if (seq_len >= tgt and remain > 1 and num_sent >= min_sent) or remain == 0:
                    rows.append([start, s + 1, tgt])
                    start, tgt, seq_len, num_sent = s + 1, target(), 0, 0
    rng64 = _mt64(seed + 1)
    for i in range(len(rows) - 1, 0, -1):
        j = next(rng64) % (i + 1)
        rows[i], rows[j] = rows[j], rows[i]
    return rows


def _reference_masking(tokens, target, rng, tok, max_ngram, geometric, token_mask):
    cands = []
    for i, t in enumerate(tokens):
        if t in (tok.cls, tok.sep):
            continue
        if cands and tok.inv_vocab[t].startswith("##"):
            cands[-1].append(i)
        else:
            cands.append([i])
    n_mask = min(0.15 * target, max(1, int(round(len(tokens) * 0.15))))
    probs = np.array([1.0 / n for n in range(1, max_ngram + 1)])
    probs /= probs.sum()
    entries = [[cands[c : c + n] for n in range(1, max_ngram + 1)] for c in range(len(cands))]
    rng.shuffle(entries)
    out, masked, spans = list(tokens), [], []
    for entry in entries:
        if len(masked) >= n_mask:
            break
        n = min(rng.geometric(0.2), max_ngram) if geometric else rng.choice(np.arange(1, max_ngram + 1), p=probs)
        chosen = None
        while n > 0:
            idxs = [i for cand in entry[n - 1] for i in cand]
            n -= 1
            if n_mask >= len(masked) + len(idxs):
                chosen = idxs
                break
        if chosen is None or any(i in {p for p, _ in masked} for i in chosen):
            continue
        for i in chosen:
            replacement = token_mask(rng)
            out[i] = tokens[i] if replacement is None else replacement
            masked.append((i, tokens[i]))
        spans.append((chosen, [tokens[i] for i in chosen]))
    return out, sorted(masked), sorted(spans)


def _bert_reference(row, idx, data, tok, seq_length):
    first, end, target = row
    rng = np.random.RandomState((SEED + idx) % 2**32)
    sents = [list(map(int, data[i])) for i in range(first, end)]
    pivot = rng.randint(1, len(sents)) if len(sents) >= 3 else 1
    swapped = rng.random() < 0.5
    a, b = sum(sents[:pivot], []), sum(sents[pivot:], [])
    if swapped:
        a, b = b, a
    truncated = len(a) + len(b) > target
    while len(a) + len(b) > target:
        seg = a if len(a) > len(b) else b
        seg.pop(0 if rng.random() < 0.5 else -1)
    tokens = [tok.cls] + a + [tok.sep] + ((b + [tok.sep]) if b else [])
    types = [0] * (len(a) + 2) + ([1] * (len(b) + 1) if b else [])
    vocab_ids = list(tok.inv_vocab.keys())

    def token_mask(r):
        if r.random() < 0.8:
            return tok.mask
        return vocab_ids[r.randint(0, len(vocab_ids))] if r.random() >= 0.5 else None

    tokens_m, masked, _ = _reference_masking(tokens, target, rng, tok, 3, False, token_mask)
    pad = seq_length - len(tokens_m)
    labels = np.full(seq_length, -1)
    loss_mask = np.zeros(seq_length, dtype=np.int64)
    for p, original in masked:
        labels[p], loss_mask[p] = original, 1
    return dict(text=tokens_m + [tok.pad] * pad, types=types + [tok.pad] * pad, labels=labels.tolist(),
                is_random=int(swapped), padding_mask=[1] * len(tokens_m) + [tok.pad] * pad,
                loss_mask=loss_mask.tolist(), truncated=int(truncated))


def _t5_reference(row, idx, data, tok, enc_len, dec_len):
    first, end, target = row
    rng = np.random.RandomState((SEED + idx) % 2**32)
    tokens = [int(t) for i in range(first, end) for t in data[i]]
    truncated = len(tokens) > target
    tokens = tokens[:target]
    tokens_m, _, spans = _reference_masking(tokens, target, rng, tok, 10, True, lambda r: tok.mask)
    sentinels = deque(tok.additional_special_tokens_ids)
    enc, dec_in, dec_out, start = [], [tok.bos], [], 0
    for idxs, labels in spans:
        s = sentinels.popleft()
        enc += tokens_m[start : idxs[0]] + [s]
        dec_in += [s] + labels
        dec_out += [s] + labels
        start = idxs[-1] + 1
    enc += tokens_m[start:]
    dec_out.append(tok.eos)
    return dict(text_enc=enc + [tok.pad] * (enc_len - len(enc)), text_dec=dec_in + [tok.pad] * (dec_len - len(dec_in)),
                labels=dec_out + [-1] * (dec_len - len(dec_out)),
                loss_mask=[1] * len(dec_in) + [0] * (dec_len - len(dec_in)), truncated=int(truncated),
                enc_mask=[1] * len(enc) + [0] * (enc_len - len(enc)),
                dec_mask=[1] * len(dec_in) + [0] * (dec_len - len(dec_in)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_masked_corpus(str(tmp_path_factory.mktemp("masked")))


def _common(tok, cache):
    return dict(random_seed=SEED, split="90,5,5", path_to_cache=cache, tokenizer=tok, masking_probability=0.15,
                short_sequence_probability=0.1, masking_do_full_word=True, masking_do_permutation=False,
                masking_use_longer_ngrams=False)


def _split_docs(data):
    n = len(data.document_indices) - 1
    return np.arange(0, int(round(0.9 * n)))


def _check_cache(ds, cache, class_name):
    described = os.path.join(cache, f"{ds.unique_description_hash}-{class_name}-description.txt")
    assert os.path.isfile(described)
    assert os.path.isfile(os.path.join(cache, f"{ds.unique_description_hash}-{class_name}-sample_index.npy"))
    text = open(described).read()
    assert hashlib.md5(text.encode()).hexdigest() == ds.unique_description_hash
    return list(json.loads(text))


def test_bert_samples_equal_reference_and_cache_is_reused(corpus, tmp_path):
    vocab, prefix = corpus
    tok = _BertWordPieceTokenizer(vocab, lower_case=True)
    data = IndexedDataset(prefix)
    cache = str(tmp_path / "cache")
    config = BERTMaskedWordPieceDatasetConfig(sequence_length=32, blend=([prefix], None), masking_max_ngram=3,
                                              masking_use_geometric_distribution=False, classification_head=True,
                                              **_common(tok, cache))
    docs = _split_docs(data)
    ds = BERTMaskedWordPieceDataset(data, prefix, docs, NUM_SAMPLES, Split.train, config)
    assert ds.built_anew_on_cache_miss
    rows = _reference_mapping(data.document_indices[np.append(docs, docs[-1] + 1)], data.sequence_lengths,
                              NUM_SAMPLES, 29, 0.1, SEED, 2)
    assert ds.sample_index.tolist() == rows and ds.sample_index.dtype == np.uint32
    assert any(r[2] < 29 for r in rows), "no short sample: the short-sequence branch went untested"
    for idx in range(len(ds)):
        got = ds[idx]
        want = _bert_reference(rows[idx], idx, data, tok, 32)
        assert {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in got.items()} == want, idx
    keys = _check_cache(ds, cache, "BERTMaskedWordPieceDataset")
    assert keys == ["class", "dataset_path", "num_samples", "index_split", "random_seed", "sequence_length", "split",
                    "split_matrix", "tokenizer", "masking_probability", "short_sequence_probability",
                    "masking_max_ngram", "masking_do_full_word", "masking_do_permutation",
                    "masking_use_longer_ngrams", "masking_use_geometric_distribution", "classification_head"]
    again = BERTMaskedWordPieceDataset(data, prefix, docs, NUM_SAMPLES, Split.train, config)
    assert not again.built_anew_on_cache_miss and np.array_equal(again.sample_index, ds.sample_index)


def test_t5_samples_equal_reference_and_cache_is_reused(corpus, tmp_path):
    vocab, prefix = corpus
    tok = _BertWordPieceTokenizer(vocab, lower_case=False, vocab_extra_ids=30)
    data = IndexedDataset(prefix)
    cache = str(tmp_path / "cache")
    config = T5MaskedWordPieceDatasetConfig(sequence_length=48, sequence_length_decoder=32, blend=([prefix], None),
                                            masking_max_ngram=10, masking_use_geometric_distribution=True,
                                            **_common(tok, cache))
    docs = _split_docs(data)
    ds = T5MaskedWordPieceDataset(data, prefix, docs, NUM_SAMPLES, Split.train, config)
    rows = _reference_mapping(data.document_indices[np.append(docs, docs[-1] + 1)], data.sequence_lengths,
                              NUM_SAMPLES, 46, 0.1, SEED, 1)
    assert ds.sample_index.tolist() == rows
    spans = 0
    for idx in range(len(ds)):
        got = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in ds[idx].items()}
        assert got == _t5_reference(rows[idx], idx, data, tok, 48, 32), idx
        spans += sum(t in tok.additional_special_tokens_ids for t in got["text_enc"])
    assert spans > len(ds)  # spans were corrupted
    keys = _check_cache(ds, cache, "T5MaskedWordPieceDataset")
    assert keys[-1] == "sequence_length_decoder" and "classification_head" not in keys
    again = T5MaskedWordPieceDataset(data, prefix, docs, NUM_SAMPLES, Split.train, config)
    assert not again.built_anew_on_cache_miss and np.array_equal(again.sample_index, ds.sample_index)
