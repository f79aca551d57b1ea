"""Microbatch calculator: constant mode, ramp-up formula, decrease-if-needed, errors, global API."""
import math

import pytest

from megatron.core import num_microbatches_calculator as nmc
from megatron.core.num_microbatches_calculator import (
    ConstantNumMicroBatchesCalculator,
    RampupBatchsizeNumMicroBatchesCalculator,
)


@pytest.fixture(autouse=True)
def _fresh_calculator():
    nmc.destroy_num_microbatches_calculator()
    yield
    nmc.destroy_num_microbatches_calculator()


def test_global_api_constant_and_reconfigure():
    with pytest.raises(RuntimeError, match="not initialized"):
        nmc.get_num_microbatches()
    nmc.init_num_microbatches_calculator(0, None, 32, 2, 4)
    assert nmc.get_num_microbatches() == 4
    assert nmc.get_current_global_batch_size() == 32
    assert nmc.get_current_running_global_batch_size() == 32
    assert nmc.get_micro_batch_size() == 2
    nmc.update_num_microbatches(10_000)
    assert nmc.get_num_microbatches() == 4
    # Megatron asserts on a second init: code catching AssertionError (or RuntimeError) sees it, and
    # the first calculator stays in place.
    with pytest.raises(AssertionError, match="already initialized"):
        nmc.init_num_microbatches_calculator(0, None, 16, 1, 4)
    with pytest.raises(RuntimeError, match="already initialized"):
        nmc.init_num_microbatches_calculator(0, None, 32, 2, 4)
    assert nmc.get_num_microbatches() == 4 and nmc.get_micro_batch_size() == 2
    nmc.reconfigure_num_microbatches_calculator(0, None, 16, 1, 2)
    assert nmc.get_num_microbatches() == 8 and nmc.get_micro_batch_size() == 1
    nmc.unset_num_microbatches_calculator()
    with pytest.raises(RuntimeError):
        nmc.get_current_global_batch_size()


def test_constant_divisibility_and_decrease():
    with pytest.raises(ValueError) as err:
        ConstantNumMicroBatchesCalculator(30, 2, 4, False, 0)
    message = str(err.value)
    assert "--global-batch-size (30)" in message and "--micro-batch-size (2)" in message
    assert "--decrease-batch-size-if-needed" in message
    calc = ConstantNumMicroBatchesCalculator(30, 2, 4, True, 0)
    assert calc.get() == 3
    assert calc.get_current_global_batch_size() == 30
    assert calc.get_current_running_global_batch_size() == 24
    with pytest.raises(ValueError, match="0 microbatches"):
        ConstantNumMicroBatchesCalculator(6, 2, 4, True, 0)
    with pytest.raises(ValueError, match="--micro-batch-size"):
        ConstantNumMicroBatchesCalculator(8, 0, 4, False, 0)


def _rampup_expected(consumed, start, incr, samples, gbs):
    if consumed > samples:
        return gbs
    per_increment = samples / ((gbs - start) / incr)
    return start + math.floor(consumed / per_increment) * incr


def test_rampup_formula_and_global_update():
    start, incr, samples, gbs, mbs, dp = 8, 8, 1000, 64, 2, 4
    nmc.init_num_microbatches_calculator(0, [start, incr, samples], gbs, mbs, dp)
    assert nmc.get_current_global_batch_size() == 8 and nmc.get_num_microbatches() == 1
    for consumed in (0, 1, 142, 143, 500, 999, 1000, 1001, 5000):
        nmc.update_num_microbatches(consumed, consistency_check=True)
        expected = _rampup_expected(consumed, start, incr, samples, gbs)
        assert nmc.get_current_global_batch_size() == expected, consumed
        assert nmc.get_num_microbatches() == expected // (mbs * dp)
    nmc.update_num_microbatches(143)
    assert nmc.get_current_global_batch_size() == 16


def test_rampup_consistency_and_decrease_if_needed():
    calc = RampupBatchsizeNumMicroBatchesCalculator(48, 4, 2, False, 0, 12, 12, 300)
    calc.update(0, consistency_check=False)
    with pytest.raises(ValueError, match="not divisible"):
        calc.update(0, consistency_check=True)
    calc.update(100, consistency_check=True)
    assert calc.get_current_global_batch_size() == 24 and calc.get() == 3
    lenient = RampupBatchsizeNumMicroBatchesCalculator(48, 4, 2, True, 0, 12, 12, 300)
    lenient.update(0, consistency_check=True)
    assert lenient.get_current_global_batch_size() == 12
    assert lenient.get_current_running_global_batch_size() == 8 and lenient.get() == 1
    lenient.update(250, consistency_check=True)
    assert lenient.get_current_global_batch_size() == 36
    assert lenient.get_current_running_global_batch_size() == 32 and lenient.get() == 4


def test_rampup_errors():
    with pytest.raises(ValueError, match="--rampup-batch-size takes 3 values"):
        nmc.init_num_microbatches_calculator(0, [8, 8], 64, 2, 4)
    with pytest.raises(ValueError, match="must be >= the --rampup-batch-size start"):
        RampupBatchsizeNumMicroBatchesCalculator(16, 2, 1, False, 0, 32, 8, 100)
    with pytest.raises(ValueError, match="divisible by the --rampup-batch-size increment"):
        RampupBatchsizeNumMicroBatchesCalculator(64, 2, 1, False, 0, 8, 10, 100)
    flat = RampupBatchsizeNumMicroBatchesCalculator(32, 2, 1, False, 0, 32, 8, 100)
    assert flat.get_current_global_batch_size() == 32 and flat.get() == 16
