"""`megatron.core.transformer.utils` helpers added for Megatron's surface (the SP toggle has its own file)."""
import math

import torch

from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.transformer import utils
from megatron.core.transformer.torch_layer_norm import WrappedTorchLayerNorm
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from tests.unit.transformer.model_setup import init_single_rank


def test_masks_linear_layer_and_gelu():
    i, j = torch.arange(5)[:, None], torch.arange(7)[None, :]
    # 5 queries against 7 keys, queries aligned with the last keys, window (2 left, 1 right)
    expected = ~((j >= i + 2 - 2) & (j <= i + 2 + 1))
    assert torch.equal(utils.get_sliding_window_causal_mask(5, 7, (2, 1)), expected)
    assert torch.equal(utils.get_default_causal_mask(4), torch.triu(torch.ones(4, 4, dtype=torch.bool), 1))

    layer = utils.get_linear_layer(3, 5, lambda w: torch.nn.init.constant_(w, 0.25))
    assert layer.weight.shape == (5, 3) and torch.all(layer.weight == 0.25) and torch.all(layer.bias == 0)
    untouched = utils.get_linear_layer(3, 5, lambda w: torch.nn.init.constant_(w, 9.0), perform_initialization=False)
    assert not torch.all(untouched.weight == 9.0) and torch.all(untouched.bias == 0)

    x = torch.linspace(-4, 4, 17, dtype=torch.float64)
    formula = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    torch.testing.assert_close(utils.gelu_impl(x), formula)
    assert WrappedTorchLayerNorm is WrappedTorchNorm


def test_sharded_checkpoint_helpers():
    init_single_rank()
    state = {"weight": torch.zeros(4, 3), "bias": torch.zeros(4), "norm": torch.ones(3), "_extra_state": b"te"}
    sharded = utils.make_sharded_tensors_for_checkpoint(state, "layer.", {"weight": 0, "bias": 0},
                                                        sharded_offsets=[(0, 1, 2)])
    assert set(sharded) == {"layer.weight", "layer.bias", "layer.norm", "layer._extra_state"}
    weight = sharded["layer.weight"]
    assert isinstance(weight, ShardedTensor) and weight.global_shape == (2, 4, 3) and weight.global_offset == (1, 0, 0)
    assert isinstance(sharded["layer._extra_state"], ShardedObject)
    assert utils._get_extra_state_offsets([(0, 1, 2)]) == ((2,), (1,))

    obj = utils.make_sharded_object_for_checkpoint({"a": 1}, "layer.extra", sharded_offsets=[(0, 3, 4)])
    assert isinstance(obj, ShardedObject) and obj.global_shape == (4,) and obj.global_offset == (3,)
    assert obj.replica_id == (0, 0, 0)
    plain = utils.make_sharded_object_for_checkpoint(5, "x", replica_id=7)
    assert plain.global_shape == (1,) and plain.replica_id == 7
