"""Index builders that Megatron implements in C++ (`helpers.cpp`), here in numpy with identical output.

Design note (sample index): sample j starts at flattened token j*S of the shuffled document stream
and reads S + add_extra_token tokens, so with the extra token consecutive samples share one boundary
token. The first row owned by each document therefore follows from the cumulative document lengths
by one shift (or integer division), and each row's (document, offset) pair, read as one int64 word,
changes from the row before by S << 32 plus one known step per document starting there: a running
sum of those steps fills the index; no per-sample loop is needed. Work runs in cache-sized chunks
of documents. The row conventions (which document a boundary is attributed to, zero-length
documents, the final partial sample) follow the C++ loop exactly; the tests compare against a
line-by-line port of that loop.

Design note (blending): the greedy rule (step i picks the dataset with the largest
`w_d*max(i,1) - count_d` in double precision, first index on ties) is sequential, but its state is
only the count vector, and a run started from a wrong count vector meets the true run after a few
steps (~8-16 in practice): the rule pulls every count back towards w*i. So the steps are cut into
segments that all run at once, one numpy pass over a `[datasets, segments]` error array per step,
each from a guessed start (w*i rounded to integers summing to i); segments whose start turns out
wrong re-run from the end of their predecessor until they meet their previous run. Every comparison
is the C++ one (`w*t - count` in double, first index on ties), so the output is bit-identical to the
C++ loop; the guesses only decide the speed (~2-4x the C++ loop's time for any weights).
"""
from typing import List, Optional, Tuple

import numpy

from megatron.core.datasets._masked_mapping import build_mapping  # helpers.cpp holds it too

_INT32_MAX = numpy.iinfo(numpy.int32).max
# Documents per build_sample_idx chunk (its temporaries stay in the CPU cache).
_SAMPLE_CHUNK = 1 << 15
# Segmented blending: below this many steps the plain loop is cheap enough; segments have at least
# _MIN_SEGMENT_STEPS steps and one step's error array at most _SEGMENT_ELEMENTS (datasets x segments),
# so it stays in cache; corrected segments are compared with their previous run at _CHECKPOINTS.
_SEGMENTED_MIN_STEPS = 4096
_MIN_SEGMENT_STEPS = 64
_SEGMENT_ELEMENTS = 1 << 16
_CHECKPOINTS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
# Correction rounds stop after _MAX_ROUNDS, or once a round leaves more than half of the previous
# round's stale segments (and more than _MIN_STALE): the rest then runs the per-step loop.
_MAX_ROUNDS = 64
_MIN_STALE = 64
# Ties are resolved row by row up to this many datasets, column by column beyond; counts are updated
# with whole-array passes up to _DENSE_UPDATE_DATASETS datasets, by indexing the chosen cells beyond.
_TIE_LOOP_DATASETS = 16
_DENSE_UPDATE_DATASETS = 8


def build_sample_idx(
    sizes: numpy.ndarray,
    document_indices: numpy.ndarray,
    sequence_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: bool = True,
) -> numpy.ndarray:
    """[num_samples + 1, 2] array of (position in document_indices, token offset) sample starts."""
    extra = int(add_extra_token_to_sequence)
    seq = int(sequence_length)
    total_tokens = int(num_epochs) * int(tokens_per_epoch)
    if drop_last_partial_sequence:
        num_samples = (total_tokens - extra) // seq
    else:
        num_samples = -(-(total_tokens - extra) // seq)
    num_samples = max(num_samples, 0)
    sizes = numpy.asarray(sizes)
    document_indices = numpy.asarray(document_indices)
    n_docs = len(document_indices)
    wide = n_docs > _INT32_MAX or (len(sizes) > 0 and int(sizes.max()) > _INT32_MAX)
    sample_idx = numpy.empty((num_samples + 1, 2), dtype=numpy.int64 if wide else numpy.int32)
    sample_idx[0] = 0
    if num_samples == 0:
        return sample_idx
    # int32 pairs on a little-endian machine are filled as one int64 word per row (see _fill_words).
    fill = _fill_words if not wide and numpy.little_endian and seq < (1 << 30) else _fill_pairs
    filled, base = 0, 0
    for begin in range(0, n_docs, _SAMPLE_CHUNK):
        end = min(begin + _SAMPLE_CHUNK, n_docs)
        lengths = numpy.take(sizes, document_indices[begin:end])
        starts = numpy.empty(end - begin + 1, dtype=numpy.int64)  # token starts within the chunk
        starts[0] = 0
        numpy.cumsum(lengths, out=starts[1:])
        first, low = _first_rows(starts, base, seq, extra, num_samples)
        rows = int(first[-1])
        if rows > 0:
            fill(sample_idx, lengths, starts, first, low, rows, begin, base, seq)
            filled = low + rows - 1
        base += int(starts[-1])
    if filled < num_samples:
        # Only the final partial sample (drop_last_partial_sequence=False) runs off the end.
        last = n_docs - 1
        sample_idx[filled + 1 :, 0] = last
        sample_idx[filled + 1 :, 1] = int(sizes[document_indices[last]]) - extra
    return sample_idx


def _first_rows(starts: numpy.ndarray, base: int, seq: int, extra: int, num_samples: int) -> Tuple[numpy.ndarray, int]:
    """(first row owned by each document of the chunk minus `low`, `low`), clipped to the chunk's rows.

    Row j (1-based) is recorded at the document holding token j*S + extra - 1 (the last token the
    previous sample consumed), so document k owns the rows from ceil((base + starts[k] - extra + 1) / S)
    on; `low` is that row for the chunk's first document (at least 1).
    """
    offset = base + seq - extra
    low = max(1, offset // seq)
    first = starts + (offset - low * seq)  # low*seq is a multiple of S: the floor below is exact
    if seq & (seq - 1) == 0:
        first >>= seq.bit_length() - 1
    else:
        first //= seq
    top = num_samples + 1 - low
    # first is non-decreasing: clip both ends with two binary searches instead of a full pass.
    first[: int(numpy.searchsorted(first, 0, side="left"))] = 0
    first[int(numpy.searchsorted(first, top, side="right")) :] = top
    return first, low


def _fill_pairs(sample_idx, lengths, starts, first, low, rows, begin, base, seq) -> None:
    """Rows [low, low + rows): the owner of row r is the number of documents k >= 1 with first[k] <= r,
    a histogram of first rows and its running sum."""
    owner = numpy.cumsum(numpy.bincount(first[1:-1], minlength=rows + 1)[:rows])
    numpy.add(owner, begin, out=sample_idx[low : low + rows, 0], casting="unsafe")
    token = numpy.arange(low * seq - base, (low + rows) * seq - base, seq, dtype=numpy.int64)
    numpy.subtract(token, numpy.take(starts, owner), out=sample_idx[low : low + rows, 1], casting="unsafe")


def _fill_words(sample_idx, lengths, starts, first, low, rows, begin, base, seq) -> None:
    """Rows [low, low + rows) of an int32 index, each [document, offset] pair read as one little-endian
    int64 word = document + (offset << 32).

    Consecutive rows differ by S << 32 (the offset advances by S), plus, for every document k that
    starts at that row, the change of owner from k-1 to k: +1 on the document and -length[k-1] on the
    offset. So the words are the running sum of those steps after the first row's word; every partial
    sum is a true word, so nothing wraps.
    """
    words = sample_idx.view(numpy.int64).reshape(-1)[low : low + rows]  # [R+1, 2] int32 -> [R+1] int64
    steps = numpy.full(rows + 1, seq << 32, dtype=numpy.int64)
    later = int(numpy.searchsorted(first, 1, side="left"))  # documents whose first row is after `low`
    owner = later - 1  # the owner of row `low`
    change = numpy.left_shift(lengths[owner : len(first) - 2], 32, dtype=numpy.int64)
    numpy.subtract(1, change, out=change)
    numpy.add.at(steps, first[later:-1], change)  # several documents can start at one row
    steps[0] = (begin + owner) + ((low * seq - base - int(starts[owner])) << 32)
    numpy.cumsum(steps[:rows], out=words)


def build_blending_indices(
    dataset_index: numpy.ndarray,
    dataset_sample_index: numpy.ndarray,
    weights,
    num_datasets: int,
    size: int,
    verbose: bool = False,
) -> None:
    """Greedy blend: at step i pick the dataset with the largest weight*max(i,1) - count (first on ties)."""
    weights = numpy.asarray(weights, dtype=numpy.float64)[:num_datasets]
    choices, within = _greedy_choices(weights, None, int(size))
    dataset_index[:size] = choices
    dataset_sample_index[:size] = within
    if verbose:
        achieved = numpy.bincount(choices, minlength=num_datasets) / max(int(size), 1)
        print(" > sample ratios:")
        for d in range(num_datasets):
            print(f"   dataset {d}, input: {weights[d]:0.6f}, achieved: {achieved[d]:0.6f}")


def build_exhaustive_blending_indices(
    dataset_index: numpy.ndarray, dataset_sample_index: numpy.ndarray, sizes, num_datasets: int
) -> None:
    """Greedy blend that draws every sample of every dataset exactly once (weights = sizes / total)."""
    sizes = numpy.asarray(sizes, dtype=numpy.int64)[:num_datasets]
    total = int(sizes.sum())
    weights = sizes / float(total) if total else numpy.zeros(num_datasets)
    choices, within = _greedy_choices(weights, sizes, total)
    dataset_index[:total] = choices
    dataset_sample_index[:total] = within


def _greedy_choices(
    weights: numpy.ndarray, caps: Optional[numpy.ndarray], size: int
) -> Tuple[numpy.ndarray, numpy.ndarray]:
    """(dataset chosen at each of `size` steps as int16, like Megatron's dataset_index; how many times
    that dataset was chosen before, as int64).

    `caps` (the exhaustive variant) are per-dataset sample counts: a dataset leaves the competition
    once it reaches its count, like the C++ `std::set` of unspent datasets.
    """
    if len(weights) == 1:
        return numpy.zeros(size, dtype=numpy.int16), numpy.arange(size, dtype=numpy.int64)
    if size < _SEGMENTED_MIN_STEPS:
        counts = [0] * len(weights)
        choices, within = _greedy_loop(weights, caps, counts, 0, size)
        return numpy.asarray(choices, dtype=numpy.int16), numpy.asarray(within, dtype=numpy.int64)
    return _SegmentedGreedy(weights, caps, size).run()


def _greedy_loop(
    weights: numpy.ndarray, caps: Optional[numpy.ndarray], counts: List[int], start: int, stop: int
) -> Tuple[List[int], List[int]]:
    """The C++ loop one step at a time from `counts` at step `start` (updates `counts`): the choices
    and each choice's count before it."""
    live = [d for d in range(len(weights)) if caps is None or counts[d] < caps[d]]
    live_weights = [float(weights[d]) for d in live]
    chosen, within = [], []
    for i in range(start, stop):
        t = float(i) if i > 1 else 1.0
        errors = [w * t - counts[d] for w, d in zip(live_weights, live)]
        best = live[errors.index(max(errors))]
        chosen.append(best)
        within.append(counts[best])
        counts[best] += 1
        if caps is not None and counts[best] == caps[best]:
            index = live.index(best)
            del live[index], live_weights[index]
    return chosen, within


class _SegmentedGreedy:
    """Exact greedy blending, vectorized across segments of the step range (see the module notes).

    The steps are cut into S segments of L steps. Each segment starts from a guess of the counts at its
    first step (the weights times the step, rounded to integers that sum to the step) and all S segments
    run the C++ rule at once, one step per numpy pass over a `[D, S]` error array. A segment is exact
    once its start equals the end of the exact segment before it; segments whose start was wrong
    re-run from the corrected start and stop as soon as their counts meet the previous run's counts at
    a checkpoint (from there on the previous picks are the true ones). Segment 0 starts exactly (all
    zero), so every round makes at least one more segment exact; in practice wrong guesses meet the
    true run within ~8-16 steps and one correction round finishes.
    """

    def __init__(self, weights: numpy.ndarray, caps: Optional[numpy.ndarray], size: int) -> None:
        self.weights = weights
        self.caps = None if caps is None else caps.astype(numpy.float64)[:, None]  # [D] -> [D, 1]
        self.size = size
        num = len(weights)
        self.segments = max(1, min(size // _MIN_SEGMENT_STEPS, max(_SEGMENT_ELEMENTS // num, 1)))
        self.length = -(-size // self.segments)
        self.starts = numpy.arange(self.segments, dtype=numpy.int64) * self.length
        self.picks = numpy.empty((self.length, self.segments), dtype=numpy.int16)  # [L, S]
        self.within = numpy.empty((self.length, self.segments), dtype=numpy.int64)  # [L, S]
        self.start_counts = _guess_counts(weights, caps, self.starts)  # [D, S]
        self.end_counts = numpy.empty_like(self.start_counts)
        self.snapshots = {c: numpy.empty_like(self.start_counts) for c in _CHECKPOINTS if c < self.length}

    def run(self) -> Tuple[numpy.ndarray, numpy.ndarray]:
        """(choices, counts before each choice) of all steps."""
        self._simulate(numpy.arange(self.segments), early_stop=False)
        previous = None
        for _ in range(_MAX_ROUNDS):
            stale = self._stale()
            if len(stale) == 0:
                break
            if previous is not None and len(stale) * 2 > previous and len(stale) > _MIN_STALE:
                break  # corrections are not converging (e.g. unnormalized weights)
            previous = len(stale)
            self.start_counts[:, stale] = self.end_counts[:, stale - 1]
            self._simulate(stale, early_stop=True)
        choices = self.picks.T.reshape(-1)[: self.size]  # [L, S] -> [S * L]
        within = self.within.T.reshape(-1)[: self.size]  # [L, S] -> [S * L]
        stale = self._stale()
        if len(stale):
            # Finish one step at a time from the first segment whose start is not exact.
            first = int(stale[0])
            counts = [int(c) for c in self.end_counts[:, first - 1]]
            begin = int(self.starts[first])
            caps = None if self.caps is None else self.caps[:, 0]
            choices[begin:], within[begin:] = _greedy_loop(self.weights, caps, counts, begin, self.size)
        return choices, within

    def _stale(self) -> numpy.ndarray:
        """Segments whose start differs from the end of the segment before them."""
        return numpy.flatnonzero((self.start_counts[:, 1:] != self.end_counts[:, :-1]).any(axis=0)) + 1

    def _simulate(self, columns: numpy.ndarray, early_stop: bool) -> None:
        """Run segments `columns` from their start counts for L steps (or until they meet the last run)."""
        counts = numpy.ascontiguousarray(self.start_counts[:, columns])  # [D, n], a copy
        steps = self.starts[columns].astype(numpy.float64)
        kernel = _GreedyStep(self.weights, self.caps, len(columns))
        for j in range(self.length):
            if j in self.snapshots:
                if early_stop:
                    moving = (counts != self.snapshots[j][:, columns]).any(axis=0)
                    if not moving.all():
                        columns, steps = columns[moving], steps[moving]
                        counts = numpy.ascontiguousarray(counts[:, moving])  # the kernel updates a flat view
                        if len(columns) == 0:
                            return
                        kernel = _GreedyStep(self.weights, self.caps, len(columns))
                self.snapshots[j][:, columns] = counts
            picked, before = kernel(numpy.maximum(steps, 1.0) if j < 2 else steps, counts)
            if len(columns) == self.segments:
                self.picks[j], self.within[j] = picked, before
            else:
                self.picks[j, columns], self.within[j, columns] = picked, before
            steps += 1.0
        self.end_counts[:, columns] = counts


class _GreedyStep:
    """One step of the C++ rule for n independent states (counts `[D, n]` float64, updated in place)."""

    def __init__(self, weights: numpy.ndarray, caps: Optional[numpy.ndarray], n: int) -> None:
        num = len(weights)
        self.weights = weights
        self.caps = caps
        self.errors = numpy.empty((num, n))
        self.best = numpy.empty(n)
        self.picked = numpy.empty((num, n), dtype=bool)
        self.spent = numpy.empty((num, n), dtype=bool) if caps is not None else None
        self.labels = numpy.arange(num, dtype=numpy.int16)[:, None]  # [D] -> [D, 1]
        self.scratch = numpy.empty((num, n), dtype=numpy.int16)
        self.index = numpy.empty(n, dtype=numpy.int16)
        self.column = numpy.arange(n, dtype=numpy.intp)
        self.flat = numpy.empty(n, dtype=numpy.intp)
        self.before = numpy.empty(n)
        self.seen = numpy.empty(n, dtype=bool)
        self.later = numpy.empty(n, dtype=bool)

    def __call__(self, steps: numpy.ndarray, counts: numpy.ndarray) -> Tuple[numpy.ndarray, numpy.ndarray]:
        """(chosen dataset, its count before this step) per state."""
        errors, picked = self.errors, self.picked
        numpy.multiply.outer(self.weights, steps, out=errors)  # w*t exactly as the C++ computes it
        errors -= counts
        if self.caps is not None:
            numpy.greater_equal(counts, self.caps, out=self.spent)
            errors[self.spent] = -numpy.inf
        errors.max(axis=0, out=self.best)
        numpy.equal(errors, self.best, out=picked)
        if numpy.count_nonzero(picked) != picked.shape[1]:
            self._keep_first(picked)
        numpy.multiply(picked, self.labels, out=self.scratch)
        self.scratch.sum(axis=0, out=self.index)
        if len(picked) <= _DENSE_UPDATE_DATASETS:
            numpy.multiply(counts, picked, out=errors)
            errors.sum(axis=0, out=self.before)
            counts += picked
            return self.index, self.before
        numpy.multiply(self.index, picked.shape[1], out=self.flat, dtype=numpy.intp)  # cell of each choice in [D, n]
        self.flat += self.column
        flat_counts = counts.reshape(-1)  # [D, n] -> [D * n]
        numpy.take(flat_counts, self.flat, out=self.before)
        flat_counts[self.flat] += 1.0
        return self.index, self.before

    def _keep_first(self, picked: numpy.ndarray) -> None:
        """Tied maxima keep only their first dataset (the C++ replaces its best only on a larger error)."""
        if len(picked) > _TIE_LOOP_DATASETS:
            tied = numpy.flatnonzero(numpy.count_nonzero(picked, axis=0) != 1)
            first = picked[:, tied].argmax(axis=0)
            picked[:, tied] = False
            picked[first, tied] = True
            return
        seen, later = self.seen, self.later
        numpy.copyto(seen, picked[0])
        for row in picked[1:]:
            numpy.greater(row, seen, out=later)  # picked here and not before
            seen |= row
            row[...] = later


def _guess_counts(weights: numpy.ndarray, caps: Optional[numpy.ndarray], starts: numpy.ndarray) -> numpy.ndarray:
    """Counts after `starts` steps if the blend were exactly proportional: weights*step rounded to
    integers summing to step (largest remainders), capped by `caps`; `[D, S]` float64."""
    total = float(weights.sum())
    share = weights / total if total > 0 else numpy.full(len(weights), 1.0 / len(weights))
    ideal = numpy.multiply.outer(share, starts.astype(numpy.float64))  # [D, S]
    counts = numpy.floor(ideal)
    missing = starts - counts.sum(axis=0)
    rank = numpy.argsort(numpy.argsort(counts - ideal, axis=0, kind="stable"), axis=0, kind="stable")
    counts += rank < missing[None, :]
    if caps is not None:
        numpy.minimum(counts, caps.astype(numpy.float64)[:, None], out=counts)
    return counts
