"""Tear down the one-rank process group of the inference tests after each test (see model_setup.py)."""
import pytest

from tests.unit.transformer.model_setup import teardown_single_rank


@pytest.fixture(autouse=True)
def _single_rank_teardown():
    yield
    teardown_single_rank()
