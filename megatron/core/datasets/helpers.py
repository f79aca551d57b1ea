"""Index builders that Megatron implements in C++ (`helpers.cpp`), here in numpy with identical output.

Design note (sample index): sample j starts at flattened token j*S of the shuffled document stream
and reads S + add_extra_token tokens, so with the extra token consecutive samples share one boundary
token. The rows owned by each document therefore follow from the cumulative document lengths by
integer division, and a histogram of those rows with its running sum gives each row's document; no
per-sample loop is needed. Work runs in cache-sized chunks of documents. The row conventions (which
document a boundary is attributed to, zero-length documents, the final partial sample) follow the C++ loop exactly; the tests compare against a line-by-line port of that loop.

Design note (blending): the greedy rule (step i picks the dataset with the largest
`w_d*max(i,1) - count_d` in double precision, first index on ties) is inherently sequential. It is
computed by speculation with exact verification: when the weights are (close to) a period L, i.e.
`w*L` is (close to) an integer vector, the choices from step i on are almost always those from step
i-L on, so a block of them is proposed, the exact errors of every proposed step are evaluated at once
(`[b, D]` numpy arrays, the same double operations as the C++), and the proposal is accepted up to
its first wrong step, whose true choice the same evaluation yields. Blends without a useful period,
or stretches where proposals keep failing, run a tight per-step loop. The output is bit-identical to
the C++ loop in every case; only the speed depends on the weights.
"""
from typing import List, Optional, Sequence

import numpy

_INT32_MAX = numpy.iinfo(numpy.int32).max
# Documents per build_sample_idx chunk (its temporaries stay in the CPU cache).
_SAMPLE_CHUNK = 1 << 15
# Speculation tuning: the largest verified block, the longest period searched, the minimum useful
# accepted run, and the loop stretch run after repeated failed proposals.
_MAX_BLOCK = 1 << 16
_MAX_PERIOD = 1 << 20
_MIN_RUN = 32
_LOOP_STRETCH = 4096
_SNAPSHOT = 256
# Beyond this many datasets one step of the loop is cheaper in numpy than in Python lists.
_NUMPY_LOOP_DATASETS = 48


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
    dtype = numpy.int64 if wide else numpy.int32
    sample_idx = numpy.empty((num_samples + 1, 2), dtype=dtype)
    sample_idx[0] = 0
    if num_samples == 0:
        return sample_idx
    filled, base = 0, 0
    for begin in range(0, n_docs, _SAMPLE_CHUNK):
        filled, base = _fill_sample_rows(
            sample_idx, sizes, document_indices, begin, min(begin + _SAMPLE_CHUNK, n_docs), base, seq, extra
        )
    if filled < num_samples:
        # Only the final partial sample (drop_last_partial_sequence=False) runs off the end.
        last = n_docs - 1
        sample_idx[filled + 1 :, 0] = last
        sample_idx[filled + 1 :, 1] = int(sizes[document_indices[last]]) - extra
    return sample_idx


def _fill_sample_rows(sample_idx, sizes, document_indices, begin, end, base, seq, extra):
    """Rows owned by documents [begin, end) of the shuffled stream; (last row written, tokens so far).

    Chunks of _SAMPLE_CHUNK documents keep every temporary in cache, which is what makes these ~8
    numpy passes as fast as the C++ loop's single pass.
    """
    num_samples = len(sample_idx) - 1
    starts = numpy.empty(end - begin + 1, dtype=numpy.int64)
    starts[0] = base
    numpy.cumsum(numpy.take(sizes, document_indices[begin:end]), out=starts[1:], dtype=numpy.int64)
    if base:
        starts[1:] += base
    # Row j (1-based) is recorded at the document holding token j*S + extra - 1 (the last token the
    # previous sample consumed). first_row[k] = ceil((starts[k] - extra + 1) / S) is the first row
    # whose token lies at or after starts[k], so document k owns rows [first_row[k], first_row[k+1]).
    first_row = starts + (seq - extra)
    first_row //= seq
    # first_row is non-decreasing: clip both ends with two binary searches instead of a full pass.
    first_row[: int(numpy.searchsorted(first_row, 1, side="left"))] = 1
    first_row[int(numpy.searchsorted(first_row, num_samples + 1, side="right")) :] = num_samples + 1
    low, high = int(first_row[0]), int(first_row[-1])
    if high > low:
        # The owner of row r is the number of documents k >= 1 with first_row[k] <= r: a histogram of
        # first rows and its running sum (cheaper than numpy.repeat's per-element copies).
        first_row -= low
        owner = numpy.cumsum(numpy.bincount(first_row[1:-1], minlength=high - low + 1)[: high - low])
        numpy.add(owner, begin, out=sample_idx[low:high, 0], casting="unsafe")
        token = numpy.arange(low * seq, high * seq, seq, dtype=numpy.int64)
        numpy.subtract(token, numpy.take(starts, owner), out=sample_idx[low:high, 1], casting="unsafe")
    return high - 1, int(starts[-1])


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
    choices = _GreedyBlend(weights, None).run(int(size))
    dataset_index[:size] = choices
    dataset_sample_index[:size] = _running_counts(choices, num_datasets)
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
    choices = _GreedyBlend(weights, sizes).run(total)
    dataset_index[:total] = choices
    dataset_sample_index[:total] = _running_counts(choices, num_datasets)


def _running_counts(choices: numpy.ndarray, num_datasets: int) -> numpy.ndarray:
    """For each position, how many earlier positions chose the same dataset."""
    within = numpy.empty(len(choices), dtype=numpy.int64)
    if num_datasets <= 16:
        for d in range(num_datasets):
            mask = choices == d
            within[mask] = numpy.arange(numpy.count_nonzero(mask), dtype=numpy.int64)
        return within
    order = numpy.argsort(choices, kind="stable")
    first = numpy.zeros(num_datasets + 1, dtype=numpy.int64)
    numpy.cumsum(numpy.bincount(choices, minlength=num_datasets), out=first[1:])
    within[order] = numpy.arange(len(choices), dtype=numpy.int64) - first[choices[order]]
    return within


def _useful_periods(weights: numpy.ndarray, size: int) -> numpy.ndarray:
    """Periods L (ascending) with w*L ever closer to an integer vector, each usable for speculation.

    A proposal from a period whose distance to the integers is delta stays right for ~1/delta steps,
    so only record-setting periods with delta below 1/(2*_MIN_RUN) are kept; a longer period is used
    once enough steps exist to copy from.
    """
    limit = min(_MAX_PERIOD, size // 8)
    if limit < 1 or len(weights) < 2:
        return numpy.zeros(0, dtype=numpy.int64)
    periods = numpy.arange(1, limit + 1, dtype=numpy.float64)
    distance = numpy.zeros(limit)
    for w in weights:
        scaled = periods * w
        numpy.maximum(distance, numpy.abs(scaled - numpy.rint(scaled)), out=distance)
    running = numpy.minimum.accumulate(distance)
    records = numpy.flatnonzero((distance <= running) & (numpy.r_[numpy.inf, running[:-1]] > distance))
    records = records[distance[records] * (2 * _MIN_RUN) <= 1.0]
    return records.astype(numpy.int64) + 1


class _GreedyBlend:
    """Exact greedy blending, optionally with per-dataset capacities (the exhaustive variant).

    Args:
        weights: float64 weights, one per dataset.
        caps: int64 sample counts per dataset (a dataset leaves the competition once it reaches its
            count, like the C++ `std::set` of unspent datasets), or None for no limit.
    """

    def __init__(self, weights: numpy.ndarray, caps: Optional[numpy.ndarray]) -> None:
        self.weights = weights
        self.caps = caps
        self.num = len(weights)
        self.counts = numpy.zeros(self.num, dtype=numpy.int64)
        self.live = numpy.ones(self.num, dtype=bool) if caps is None else caps > 0
        # snapshots[s] = counts before step s*_SNAPSHOT, filled lazily to pick the best period.
        self.snapshots = numpy.zeros((1, self.num), dtype=numpy.int64)

    def run(self, size: int) -> numpy.ndarray:
        """The dataset chosen at each of `size` steps (int16, like Megatron's dataset_index)."""
        out = numpy.empty(size, dtype=numpy.int16)
        if size == 0:
            return out
        if self.num == 1:
            out[:] = 0
            return out
        periods = _useful_periods(self.weights, size)
        pos, block, failures, period = 0, _MIN_RUN, 0, size
        while pos < size:
            usable = int(numpy.searchsorted(periods, pos, side="right"))
            if usable == 0 or failures >= 4:
                if usable:
                    stop = min(size, pos + _LOOP_STRETCH)
                else:
                    stop = size if len(periods) == 0 else min(size, int(periods[0]))
                self._loop(out, pos, stop)
                pos, failures, block = stop, 0, _MIN_RUN
                continue
            if failures or period > pos:
                period = self._closest_period(out, pos, periods[:usable])
            b = min(block, size - pos, max(_MAX_BLOCK // self.num, _MIN_RUN))
            # Step pos + j is proposed to repeat step pos + j - period.
            proposal = numpy.tile(out[pos - period : pos], -(-b // period))[:b]
            accepted = self._speculate(out, pos, proposal)
            pos += accepted
            if accepted == b:
                block, failures = block * 2, 0
            else:
                block = max(_MIN_RUN, 2 * accepted)
                failures = 0 if accepted >= _MIN_RUN // 2 else failures + 1
        return out

    def _counts_before(self, out: numpy.ndarray, step: int) -> numpy.ndarray:
        """Per-dataset counts of out[:step] (step <= the steps already written)."""
        have = len(self.snapshots)
        need = step // _SNAPSHOT + 1
        if need > have:
            segments = out[(have - 1) * _SNAPSHOT : (need - 1) * _SNAPSHOT].astype(numpy.int64)
            rows = len(segments) // _SNAPSHOT
            segments = segments.reshape(rows, _SNAPSHOT)  # [rows * K] -> [rows, K]
            segments += (numpy.arange(rows, dtype=numpy.int64) * self.num)[:, None]
            per_row = numpy.bincount(segments.ravel(), minlength=rows * self.num)
            per_row = per_row.reshape(rows, self.num)  # [rows * D] -> [rows, D]
            fresh = numpy.cumsum(per_row, axis=0) + self.snapshots[-1]
            self.snapshots = numpy.concatenate([self.snapshots, fresh])
        base = step // _SNAPSHOT
        tail = out[base * _SNAPSHOT : step].astype(numpy.int64)
        return self.snapshots[base] + numpy.bincount(tail, minlength=self.num)

    def _closest_period(self, out: numpy.ndarray, pos: int, candidates: numpy.ndarray) -> int:
        """The candidate L whose state shift w*L - (counts now - counts L steps ago) is smallest now."""
        best, best_shift = int(candidates[-1]), numpy.inf
        for period in candidates[::-1].tolist():
            moved = self.counts - self._counts_before(out, pos - period)
            shift = float(numpy.abs(self.weights * period - moved).max())
            if shift < best_shift:
                best, best_shift = period, shift
        return best

    def _speculate(self, out: numpy.ndarray, pos: int, proposal: numpy.ndarray) -> int:
        """Verify `proposal` for steps pos...; write the exact prefix (+ the corrected step); its length."""
        b = len(proposal)
        steps = numpy.arange(pos, pos + b, dtype=numpy.float64)
        steps[0] = max(steps[0], 1.0)
        picked = proposal[:, None] == numpy.arange(self.num, dtype=proposal.dtype)[None, :]  # [b, D]
        before = numpy.cumsum(picked, axis=0, dtype=numpy.int64)
        before -= picked
        before += self.counts
        errors = steps[:, None] * self.weights[None, :]  # [b, D], w*t exactly as the C++ computes it
        errors -= before
        if not self.live.all():
            errors[:, ~self.live] = -numpy.inf
        truth = numpy.argmax(errors, axis=1)
        wrong = numpy.flatnonzero(truth != proposal)
        accepted = int(wrong[0]) + 1 if len(wrong) else b
        if self.caps is not None:
            rows = numpy.arange(accepted)
            spent = numpy.flatnonzero(before[rows, truth[:accepted]] + 1 == self.caps[truth[:accepted]])
            if len(spent):
                accepted = int(spent[0]) + 1
        chosen = truth[:accepted]
        out[pos : pos + accepted] = chosen
        self.counts += numpy.bincount(chosen, minlength=self.num)
        if self.caps is not None:
            self.live &= self.counts < self.caps
        return accepted

    def _loop(self, out: numpy.ndarray, start: int, stop: int) -> None:
        """The C++ loop, one step at a time (Python lists for few datasets, numpy for many)."""
        if self.num > _NUMPY_LOOP_DATASETS:
            self._loop_numpy(out, start, stop)
            return
        weights: List[float] = self.weights.tolist()
        counts: List[int] = self.counts.tolist()
        caps: Optional[Sequence[int]] = None if self.caps is None else self.caps.tolist()
        live = [d for d in range(self.num) if self.live[d]]
        live_weights = [weights[d] for d in live]
        chosen = []
        for i in range(start, stop):
            t = float(i) if i > 1 else 1.0
            errors = [w * t - counts[d] for w, d in zip(live_weights, live)]
            best = live[errors.index(max(errors))]
            chosen.append(best)
            counts[best] += 1
            if caps is not None and counts[best] == caps[best]:
                index = live.index(best)
                del live[index], live_weights[index]
        out[start:stop] = chosen
        self.counts[:] = counts
        if self.caps is not None:
            self.live = self.counts < self.caps

    def _loop_numpy(self, out: numpy.ndarray, start: int, stop: int) -> None:
        counts = self.counts.astype(numpy.float64)
        errors = numpy.empty(self.num)
        for i in range(start, stop):
            numpy.multiply(self.weights, float(max(i, 1)), out=errors)
            errors -= counts
            if self.caps is not None:
                errors[~self.live] = -numpy.inf
            best = int(errors.argmax())
            out[i] = best
            counts[best] += 1
            if self.caps is not None and counts[best] == self.caps[best]:
                self.live[best] = False
        self.counts[:] = counts.astype(numpy.int64)
