"""DistributedDataParallelConfig defaults and validation; shard/range helpers (single process, no groups)."""
import ast
import dataclasses
import inspect

import pytest
import torch

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.param_and_grad_buffer import shard_buffer
from megatron.core.optimizer.distrib_optimizer import Range

MEGATRON_DEFAULTS = {
    "grad_reduce_in_fp32": False,
    "overlap_grad_reduce": False,
    "overlap_param_gather": False,
    "align_param_gather": False,
    "use_distributed_optimizer": False,
    "num_distributed_optimizer_instances": 1,
    "check_for_nan_in_grad": False,
    "check_for_large_grads": False,
    "bucket_size": None,
    "pad_buckets_for_high_nccl_busbw": False,
    "average_in_collective": False,
    "fp8_param_gather": False,
    "reuse_grad_buf_for_mxfp8_param_ag": False,
    "use_custom_fsdp": False,
    "data_parallel_sharding_strategy": "no_shard",
    "gradient_reduce_div_fusion": True,
    "suggested_communication_unit_size": None,
    "preserve_fp32_weights": True,
    "keep_fp8_transpose_cache_when_using_custom_fsdp": False,
    "nccl_ub": False,
    "fsdp_double_buffer": False,
}


def test_ddp_config_has_megatron_fields_defaults_and_docstrings():
    config = DistributedDataParallelConfig()
    fields = {f.name for f in dataclasses.fields(config)}
    assert fields == set(MEGATRON_DEFAULTS)
    for name, default in MEGATRON_DEFAULTS.items():
        assert getattr(config, name) == default, name
    tree = ast.parse(inspect.getsource(DistributedDataParallelConfig))
    body = tree.body[0].body
    for index, node in enumerate(body):
        if isinstance(node, ast.AnnAssign):
            following = body[index + 1]
            assert isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant), node.target.id


def test_ddp_config_collects_every_problem():
    with pytest.raises(ValueError) as info:
        DistributedDataParallelConfig(
            num_distributed_optimizer_instances=2, bucket_size=0, data_parallel_sharding_strategy="bogus"
        )
    message = str(info.value)
    assert "use_distributed_optimizer" in message
    assert "bucket_size (0)" in message
    assert "'bogus'" in message and "optim_grads_params" in message
    assert DistributedDataParallelConfig(nccl_ub=True).fsdp_double_buffer is True


def test_shard_buffer_and_range():
    buffer = torch.arange(12.0)
    shards = shard_buffer(buffer, 3)
    assert [s.tolist() for s in shards] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    shards[1].zero_()
    assert buffer[4:8].sum() == 0, "shards must be views"
    with pytest.raises(ValueError, match="cannot be split evenly"):
        shard_buffer(torch.zeros(10), 3)
    span = Range(5, 9)
    assert (span.size, len(span)) == (4, 4)
    moved = span.normalize(2)
    assert (moved.start, moved.end) == (2, 6)
