"""Tear down the one-rank process group that some compatibility tests build models in."""
import pytest

from tests.unit.transformer.model_setup import teardown_single_rank


@pytest.fixture(autouse=True)
def _single_rank_teardown():
    yield
    teardown_single_rank()
