"""Layer placement over pipeline stages: counts and offsets for even, VPP, uneven, accounted and layout splits.

Pure: parallel_state's world-size/rank setters stand in for real process groups.
"""
import pytest
import torch

from megatron.core import parallel_state
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset


def _placement(pp, vpp=None, **kwargs):
    """[(vp, pp_rank, offset, count)] over every stage, read through parallel_state's setters."""
    config = TransformerConfig(hidden_size=16, num_attention_heads=2, pipeline_model_parallel_size=pp,
                               virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.float32, **kwargs)
    parallel_state.set_pipeline_model_parallel_world_size(pp)
    result = []
    for vp in range(config.virtual_pipeline_model_parallel_size or 1):
        for rank in range(pp):
            parallel_state.set_pipeline_model_parallel_rank(rank)
            vp_stage = vp if config.virtual_pipeline_model_parallel_size else None
            result.append((vp, rank, get_transformer_layer_offset(config, vp_stage), get_num_layers_to_build(config, vp_stage)))
    return result


def _check_contiguous(placement, num_layers):
    position = 0
    for _, _, offset, count in placement:
        assert offset == position, placement
        position += count
    assert position == num_layers


@pytest.fixture(autouse=True)
def _reset_setters():
    yield
    parallel_state.set_pipeline_model_parallel_world_size(None)
    parallel_state.set_pipeline_model_parallel_rank(None)


def test_even_and_virtual_pipeline():
    assert _placement(4, num_layers=8) == [(0, r, 2 * r, 2) for r in range(4)]
    vpp = _placement(2, vpp=2, num_layers=8)
    assert [(o, c) for _, _, o, c in vpp] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    vpp3 = _placement(2, vpp=3, num_layers=12)
    for vp, rank, offset, count in vpp3:
        assert offset == vp * 12 // 3 + rank * 12 // (2 * 3) and count == 2
    _check_contiguous(vpp3, 12)


def test_uneven_first_and_last_stage():
    placement = _placement(4, num_layers=10, num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=3)
    assert [(o, c) for _, _, o, c in placement] == [(0, 1), (1, 3), (4, 3), (7, 3)]
    only_first = _placement(3, num_layers=7, num_layers_in_first_pipeline_stage=3)
    assert [(o, c) for _, _, o, c in only_first] == [(0, 3), (3, 2), (5, 2)]
    uneven_vpp = _placement(3, vpp=2, num_layers=12, num_layers_in_first_pipeline_stage=2,
                            num_layers_in_last_pipeline_stage=2)
    assert [c for _, _, _, c in uneven_vpp] == [1, 4, 1, 1, 4, 1]
    _check_contiguous(uneven_vpp, 12)


def test_embedding_and_loss_accounting():
    placement = _placement(4, num_layers=6, account_for_embedding_in_pipeline_split=True,
                           account_for_loss_in_pipeline_split=True)
    assert [(o, c) for _, _, o, c in placement] == [(0, 1), (1, 2), (3, 2), (5, 1)]
    with_vpp = _placement(2, vpp=2, num_layers=7, account_for_embedding_in_pipeline_split=True)
    assert [c for _, _, _, c in with_vpp] == [1, 2, 2, 2]
    _check_contiguous(with_vpp, 7)


def test_layout_placement():
    placement = _placement(2, num_layers=5, pipeline_model_parallel_layout="Et|(tt|)*2,L")
    assert [(vp, r, o, c) for vp, r, o, c in placement] == [(0, 0, 0, 1), (0, 1, 1, 2), (1, 0, 3, 2), (1, 1, 5, 0)]
    single = _placement(1, num_layers=3)
    assert single == [(0, 0, 0, 3)]
