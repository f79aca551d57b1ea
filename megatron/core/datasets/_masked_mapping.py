"""`build_mapping`: the sample index of the masked (BERT/T5) datasets, as Megatron's `helpers.cpp` builds it.

A row is (first sentence, one past the last sentence, target length). Documents are walked in order,
epoch after epoch (whole epochs: the sample count is checked only at the start of an epoch); a document is
used when it has at least `min_num_sent` sentences and, if it has more than one, none longer than 512
tokens. Target lengths come from `std::mt19937(seed)`: with `ratio = round(1 / short_seq_prob)` a draw `r`
with `r % ratio == 0` asks for a short sample of `2 + r % (max_seq_length - 1)` tokens. Rows are then
shuffled by Fisher-Yates with `std::mt19937_64(seed + 1)`.

`std::mt19937(seed)` is numpy's legacy `RandomState(seed)` (same seeding, same raw 32-bit words);
`std::mt19937_64` has no numpy twin and is implemented here (vectorised state refill).
"""
from typing import Iterator, List

import numpy

LONG_SENTENCE_LEN = 512

_MASK64 = (1 << 64) - 1
_NN, _MM = 312, 156
_MATRIX_A = numpy.uint64(0xB5026F5AA96619E9)
_UPPER = numpy.uint64(0xFFFFFFFF80000000)
_LOWER = numpy.uint64(0x7FFFFFFF)


class MT19937_64:
    """`std::mt19937_64`: 64-bit Mersenne Twister with the C++ standard's seeding and tempering."""

    def __init__(self, seed: int) -> None:
        state = [seed & _MASK64]
        for i in range(1, _NN):
            prev = state[-1]
            state.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & _MASK64)
        self._state = numpy.array(state, dtype=numpy.uint64)
        self._buffer = numpy.empty(0, dtype=numpy.uint64)
        self._pos = 0

    def _twist(self) -> None:
        mt = self._state

        def step(lo, hi, nxt, far):
            y = (mt[lo:hi] & _UPPER) | (nxt & _LOWER)
            mag = numpy.where((y & numpy.uint64(1)) == 1, _MATRIX_A, numpy.uint64(0))
            mt[lo:hi] = far ^ (y >> numpy.uint64(1)) ^ mag

        # i < NN-MM reads old words only; later i read words already refilled (i + MM - NN < i)
        step(0, _NN - _MM, mt[1 : _NN - _MM + 1].copy(), mt[_MM:_NN].copy())
        step(_NN - _MM, _NN - 1, mt[_NN - _MM + 1 : _NN].copy(), mt[0 : _MM - 1].copy())
        step(_NN - 1, _NN, mt[0:1].copy(), mt[_MM - 1 : _MM].copy())
        x = mt.copy()
        x ^= (x >> numpy.uint64(29)) & numpy.uint64(0x5555555555555555)
        x ^= (x << numpy.uint64(17)) & numpy.uint64(0x71D67FFFEDA60000)
        x ^= (x << numpy.uint64(37)) & numpy.uint64(0xFFF7EEE000000000)
        x ^= x >> numpy.uint64(43)
        self._buffer, self._pos = x, 0

    def __call__(self) -> int:
        if self._pos >= len(self._buffer):
            self._twist()
        value = int(self._buffer[self._pos])
        self._pos += 1
        return value


class _MT19937:
    """`std::mt19937(seed)`: raw 32-bit words, drawn from numpy in blocks."""

    def __init__(self, seed: int) -> None:
        self._rng = numpy.random.RandomState(seed & 0xFFFFFFFF)
        self._words: Iterator[int] = iter(())

    def __call__(self) -> int:
        value = next(self._words, None)
        if value is None:
            self._words = iter(self._rng.randint(0, 1 << 32, size=4096, dtype=numpy.uint32).tolist())
            value = next(self._words)
        return value


def _target_len(ratio: int, max_seq_length: int, rng32: _MT19937) -> int:
    if ratio == 0:
        return max_seq_length
    r = rng32()
    if r % ratio == 0:
        return 2 + r % (max_seq_length - 1)
    return max_seq_length


def _usable(sizes, first: int, last: int, min_num_sent: int) -> bool:
    count = last - first
    if count < min_num_sent:
        return False
    return count <= 1 or int(sizes[first:last].max()) <= LONG_SENTENCE_LEN


def _one_epoch(docs, sizes, ratio: int, max_seq_length: int, min_num_sent: int, rng32, rows: List[tuple]) -> None:
    for doc in range(len(docs) - 1):
        first, last = int(docs[doc]), int(docs[doc + 1])
        if not _usable(sizes, first, last, min_num_sent):
            continue
        seq_len = num_sent = 0
        remaining = last - first
        start = first
        target = _target_len(ratio, max_seq_length, rng32)
        for sent in range(first, last):
            seq_len += int(sizes[sent])
            num_sent += 1
            remaining -= 1
            if (seq_len >= target and remaining > 1 and num_sent >= min_num_sent) or remaining == 0:
                rows.append((start, sent + 1, target))
                start = sent + 1
                target = _target_len(ratio, max_seq_length, rng32)
                seq_len = num_sent = 0


def build_mapping(docs, sizes, num_epochs: int, max_num_samples, max_seq_length: int, short_seq_prob: float,
                  seed: int, verbose: bool, min_num_sent: int) -> numpy.ndarray:
    """[n, 3] (first sentence, end sentence, target length) rows, shuffled; uint32 (uint64 past 2^32 sentences).

    `docs` holds the sentence index of every document start plus the end; `sizes` the sentence lengths;
    `verbose` (Megatron prints statistics) is accepted and ignored."""
    docs = numpy.asarray(docs, dtype=numpy.int64)
    sizes = numpy.asarray(sizes)
    ratio = int(round(1.0 / short_seq_prob)) if short_seq_prob > 0 else 0
    limit = numpy.iinfo(numpy.uint64).max if max_num_samples is None else int(max_num_samples)
    rng32 = _MT19937(seed)
    rows: List[tuple] = []
    for _ in range(num_epochs):
        if len(rows) >= limit:
            break
        before = len(rows)
        _one_epoch(docs, sizes, ratio, max_seq_length, min_num_sent, rng32, rows)
        if len(rows) == before:
            raise ValueError(
                f"build_mapping: no document of this split has at least {min_num_sent} sentence(s) of at most "
                f"{LONG_SENTENCE_LEN} tokens, so no sample can be built (Megatron's loop would never end): "
                "preprocess the corpus with --split-sentences, or use --bert-no-binary-head for one-sentence "
                "documents.")
    dtype = numpy.uint64 if sizes.size > numpy.iinfo(numpy.uint32).max else numpy.uint32
    maps = numpy.array(rows, dtype=dtype).reshape(-1, 3)  # n x (first, end, target) -> [n, 3]
    rng64 = MT19937_64(seed + 1)
    for i in range(len(maps) - 1, 0, -1):
        j = rng64() % (i + 1)
        maps[[i, j]] = maps[[j, i]]
    return maps


__all__ = ["build_mapping", "MT19937_64", "LONG_SENTENCE_LEN"]
