"""Segmented greedy blending (helpers.build_(exhaustive_)blending_indices) against a port of the C++ loop.

The segmented algorithm guesses the counts at each segment start and corrects the segments whose
guess was wrong; these cases use small segments so every run has many segments, wrong guesses,
correction rounds and ties, and compare every output element with the line-by-line port.
"""
import numpy as np
import pytest

from megatron.core.datasets import helpers
from tests.unit.data.test_data_gpt import check_blend, check_exhaustive


@pytest.fixture
def small_segments(monkeypatch):
    """Segments of 16+ steps from 256 steps on, at most 512 error cells per step: many segments."""
    monkeypatch.setattr(helpers, "_SEGMENTED_MIN_STEPS", 256)
    monkeypatch.setattr(helpers, "_MIN_SEGMENT_STEPS", 16)
    monkeypatch.setattr(helpers, "_SEGMENT_ELEMENTS", 512)
    calls = {"runs": 0, "segments": [], "corrected": 0, "loop_from": []}
    simulate, loop = helpers._SegmentedGreedy._simulate, helpers._greedy_loop

    def counting_simulate(self, columns, early_stop):
        if early_stop:
            calls["corrected"] += len(columns)
        else:
            calls["runs"] += 1
            calls["segments"].append(self.segments)
        return simulate(self, columns, early_stop)

    def counting_loop(weights, caps, counts, start, stop):
        calls["loop_from"].append(start)
        return loop(weights, caps, counts, start, stop)

    monkeypatch.setattr(helpers._SegmentedGreedy, "_simulate", counting_simulate)
    monkeypatch.setattr(helpers, "_greedy_loop", counting_loop)
    return calls


def test_random_weights_many_segments(small_segments):
    rng = np.random.default_rng(7)
    for num, size in ((2, 6000), (3, 6000), (10, 3000), (50, 1500)):
        weights = rng.random(num)
        check_blend(weights / weights.sum(), size)
        check_blend(rng.dirichlet(np.full(num, 0.3)), size)  # some tiny weights
    calls = small_segments
    assert calls["runs"] == 8 and min(calls["segments"]) > 8 and calls["corrected"] > 50 and not calls["loop_from"]


def test_ties_and_rational_weights(small_segments):
    for weights, size in (([0.25] * 4, 4000), ([1 / 3] * 3, 4000), ([0.5, 0.25, 0.25], 4000), ([0.02] * 50, 1500),
                          ([0.7, 0.3], 5000), ([0.5, 0.3, 0.2], 5000), ([0.0, 0.6, 0.4], 3000)):
        check_blend(weights, size)
    assert small_segments["runs"] == 7 and not small_segments["loop_from"]


def test_exhaustive_many_segments(small_segments):
    rng = np.random.default_rng(11)
    for sizes in ([1000, 1000, 1000], [3, 2500, 0, 700], list(rng.integers(1, 400, size=12)), [100] * 20,
                  list(rng.integers(1, 3000, size=2))):
        check_exhaustive(sizes)
    assert small_segments["runs"] == 5 and small_segments["corrected"] > 0 and not small_segments["loop_from"]


def test_unnormalized_weights_fall_back_to_the_loop(small_segments):
    # Weights summing to 3: runs from wrong guesses never meet the true one; the loop finishes exactly.
    check_blend([2.0, 1.0], 3000)
    check_blend([1.5, 1.0, 0.5], 3000)
    loop_from = small_segments["loop_from"]
    assert small_segments["runs"] == 2 and len(loop_from) == 2 and min(loop_from) > 0


def test_default_segments_and_single_dataset():
    rng = np.random.default_rng(5)
    check_blend(rng.dirichlet(np.ones(3)), 20000)
    index, sample = np.zeros(5000, np.int16), np.zeros(5000, np.int64)
    helpers.build_blending_indices(index, sample, [1.0], 1, 5000, False)
    assert not index.any() and sample.tolist() == list(range(5000))
