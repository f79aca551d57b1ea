"""Optimizer state in model space: the flat-range -> box split, and a round trip of an FP32 optimizer's
sharded state in Megatron's layout (a SwiGLU-style factory, a stacked layer axis) through save/load in one
process."""
import math

import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.optimizer import FP32Optimizer, OptimizerConfig
from megatron.core.optimizer.sharded_state import flat_range_to_boxes, model_space_state_shards, param_to_sharded_map
from megatron.core.transformer.sharded import apply_swiglu_sharded_factory


def test_flat_range_to_boxes_cover_every_range_exactly_once():
    for shape in [(7,), (3, 5), (2, 3, 4), (4, 1, 6)]:
        numel = math.prod(shape)
        for start in range(numel):
            for stop in range(start, numel + 1):
                covered = torch.zeros(shape, dtype=torch.int64)
                flat = start
                for box_flat, offset, box_shape in flat_range_to_boxes(shape, start, stop):
                    assert box_flat == flat, "boxes come in flat order without gaps"
                    index = tuple(slice(o, o + s) for o, s in zip(offset, box_shape))
                    covered[index] += 1
                    flat += math.prod(box_shape)
                assert flat == stop
                expected = torch.zeros(numel, dtype=torch.int64)
                expected[start:stop] = 1
                assert torch.equal(covered.view(-1), expected), (shape, start, stop)


def _model_sd(fc1, norm):
    fc1_st = ShardedTensor.from_rank_offsets("layers.fc1.weight", fc1, (0, 0, 1), (1, 0, 1), prepend_axis_num=1)
    return {"fc1": apply_swiglu_sharded_factory(fc1_st, ((0, 0, 1),)),
            "norm": ShardedTensor.from_rank_offsets("final_norm.weight", norm)}


def _optimizer(params):
    inner = torch.optim.AdamW(params, lr=0.1)
    return FP32Optimizer(inner, OptimizerConfig(lr=0.1), None)


def test_fp32_optimizer_sharded_round_trip(tmp_path):
    torch.manual_seed(0)
    fc1, norm = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(5))
    opt = _optimizer([fc1, norm])
    (fc1.sum() * 2 + (norm ** 2).sum()).backward()
    opt.step()
    opt.step()
    state = opt.sharded_state_dict(_model_sd(fc1, norm))
    dist_checkpointing.save({"optimizer": state}, str(tmp_path))
    plain = dist_checkpointing.load_plain_tensors(str(tmp_path))
    # Megatron's FP32Optimizer layout: no fp32_param (the model params are the main params), the step once in
    # common.pt next to the param groups.
    assert sorted(plain) == sorted(f"optimizer.state.{n}.{k}" for n in ("exp_avg", "exp_avg_sq")
                                   for k in ("layers.fc1.weight", "final_norm.weight"))
    common = dist_checkpointing.load_common_state_dict(str(tmp_path))["optimizer"]
    assert sorted(common) == ["param_groups", "state"] and float(common["state"]["common_step"]) == 2.0
    assert "params" not in common["param_groups"][0] and common["param_groups"][0]["lr"] == 0.1
    # [gate; up] of the one rank is stored as [all gate; all up] under the model key, with the layer axis.
    assert plain["optimizer.state.exp_avg.layers.fc1.weight"].shape == (1, 6, 4)
    assert torch.equal(plain["optimizer.state.exp_avg.layers.fc1.weight"][0], opt.optimizer.state[fc1]["exp_avg"])
    assert torch.equal(plain["optimizer.state.exp_avg.final_norm.weight"], opt.optimizer.state[norm]["exp_avg"])

    fc1_b, norm_b = torch.nn.Parameter(torch.zeros(6, 4)), torch.nn.Parameter(torch.zeros(5))
    opt_b = _optimizer([fc1_b, norm_b])
    request = {"optimizer": opt_b.sharded_state_dict(_model_sd(fc1_b, norm_b), is_loading=True)}
    loaded = dist_checkpointing.load(request, str(tmp_path))
    opt_b.load_state_dict(loaded["optimizer"])
    for a, b in ((fc1, fc1_b), (norm, norm_b)):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.optimizer.state[a][name], opt_b.optimizer.state[b][name])
        assert float(opt_b.optimizer.state[b]["step"]) == 2.0


def test_owned_range_becomes_a_flattened_range_shard():
    param = torch.nn.Parameter(torch.arange(12.0).view(3, 4))
    model_sd = {"w": ShardedTensor.from_rank_offsets("w", param)}
    owned = torch.arange(3.0, 9.0)
    shards = model_space_state_shards([(param, 3, 9, {"exp_avg": owned})], param_to_sharded_map(model_sd), True)
    (shard,) = shards.values()
    assert shard.key == "optimizer.state.exp_avg.w" and shard.flattened_range == slice(3, 9)
    assert shard.local_shape == (3, 4) and shard.global_shape == (3, 4) and shard.data.tolist() == owned.tolist()
