"""Parameter/gradient buffer layout against Megatron 0.13.1's `_ParamAndGradBuffer` rule, no processes.

Megatron's rule (what code that checks `param.main_grad` / `param.data` addresses relies on):
- parameters are laid out in reverse registration order, one buffer per (param dtype, grad dtype);
- a bucket is closed as soon as its elements (from the bucket start to the end of the current param)
  reach `bucket_size`; `bucket_size=None` means one bucket; DDP uses None without `overlap_grad_reduce`,
  for `disable_bucketing`, and on every pipeline stage but the first;
- with the distributed optimizer only: each param starts at a multiple of 64 elements, each bucket ends
  at a multiple of lcm(DP, 128) (lcm(DP, 128, 2**16) with `pad_buckets_for_high_nccl_busbw`), and a param
  marked `shared_embedding` gets a bucket of its own (the open bucket is closed at the param's padded
  start);
- `numel_unpadded` of a bucket counts from its start to the end of its last param; the buffer's is the
  sum over buckets; `numel` is the end of the last bucket.
The expected values below are computed from that description (or written out by hand), not by the
project's code; the fake process group only answers `size()` and `rank()`.
"""
import math
from types import SimpleNamespace

import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer, partition_buckets, shard_buffer


class FakeGroup:
    """Answers what buffer construction asks a process group."""

    def __init__(self, size, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def _params(numels, shared=(), dtype=torch.float32):
    params = []
    for index, numel in enumerate(numels):
        param = torch.nn.Parameter(torch.arange(numel, dtype=dtype) + 1000 * index)
        if index in shared:
            param.shared_embedding = True
        params.append(param)
    return params


def _round_up(value, divisor):
    return -(-value // divisor) * divisor


def megatron_layout(numels, shared, bucket_size, distopt, dp, high_busbw=False):
    """Megatron's documented rule, written independently: ({param index: (start, end, bucket)},
    [(bucket start, bucket end, numel_unpadded, [param indices])])."""
    end_divisor = (math.lcm(dp, 128, 2**16) if high_busbw else math.lcm(dp, 128)) if distopt else 1
    start_alignment = 64 if distopt else 1
    positions, buckets, members = {}, [], []
    bucket_start = cursor = 0

    def close(data_end):
        nonlocal bucket_start, members
        end = _round_up(data_end, end_divisor)
        buckets.append((bucket_start, end, data_end - bucket_start, members))
        bucket_start, members = end, []
        return end

    for index in reversed(range(len(numels))):
        own_bucket = distopt and index in shared
        cursor = _round_up(cursor, start_alignment)
        if own_bucket and members:
            cursor = close(cursor)
        positions[index] = (cursor, cursor + numels[index], len(buckets))
        members.append(index)
        cursor += numels[index]
        if (bucket_size is not None and cursor - bucket_start >= bucket_size) or own_bucket:
            cursor = close(cursor)
    if members:
        close(cursor)
    return positions, buckets


MODELS = {
    # name: (numels in registration order, indices marked shared_embedding)
    "gpt_like": ([6400, 32, 32, 9216, 3072, 3072, 32, 32, 32, 12288, 384, 12288, 32, 32], {0}),
    "odd_sizes": ([1, 3, 63, 64, 65, 127, 129, 1000], set()),
    "tied_middle": ([100, 200, 300, 400], {2}),
    "single": ([5], {0}),
}
CASES = [
    # (distopt, dp, bucket_size, high_busbw)
    (False, 4, None, False), (False, 4, 5000, False), (True, 1, None, False), (True, 2, None, False),
    (True, 3, 1000, False), (True, 8, 100, False), (True, 6, 4000, True), (True, 256, 300, False),
]


def _build(numels, shared, distopt, dp, bucket_size, high_busbw, dtype=torch.float32, grad_dtype=torch.float32):
    params = _params(numels, shared, dtype)
    originals = [p.detach().clone() for p in params]
    config = DistributedDataParallelConfig(use_distributed_optimizer=distopt, pad_buckets_for_high_nccl_busbw=high_busbw)
    names = {p: f"p{i}" for i, p in enumerate(params)}
    buffer = _ParamAndGradBuffer(config, dtype, grad_dtype, params, FakeGroup(dp), bucket_size, names, 1.0 / dp,
                                 list(range(len(params))))
    return params, originals, buffer


@pytest.mark.parametrize("model", sorted(MODELS))
def test_offsets_and_buckets_follow_megatrons_rule(model):
    numels, shared = MODELS[model]
    for distopt, dp, bucket_size, high_busbw in CASES:
        params, originals, buffer = _build(numels, shared, distopt, dp, bucket_size, high_busbw)
        positions, buckets = megatron_layout(numels, shared, bucket_size, distopt, dp, high_busbw)
        case = (model, distopt, dp, bucket_size, high_busbw)
        assert {i: buffer.param_index_map[p] for i, p in enumerate(params)} == positions, case
        assert buffer.bucket_indices == [(s, e) for s, e, _, _ in buckets], case
        assert buffer.numel == buckets[-1][1] and buffer.numel_unpadded == sum(b[2] for b in buckets), case
        assert buffer.grad_data.numel() == buffer.numel
        if not distopt:
            assert buffer.numel == buffer.numel_unpadded == sum(numels) and buffer.param_data is None
        for bucket, (start, end, unpadded, members) in zip(buffer.buckets, buckets):
            assert (bucket.offset, bucket.numel_unpadded) == (start, unpadded), case
            assert bucket.params_list == [params[i] for i in members], case
            assert bucket.grad_data.data_ptr() == buffer.grad_data[start:].data_ptr()
            assert bucket.grad_data.numel() == end - start
            if distopt:
                assert bucket.param_data.data_ptr() == buffer.param_data[start:].data_ptr()
                shards = shard_buffer(bucket.grad_data, dp)
                assert [s.numel() for s in shards] == [(end - start) // dp] * dp
        element = buffer.grad_data.element_size()
        for index, param in enumerate(params):
            start, end, bucket_id = positions[index]
            assert param.main_grad.data_ptr() == buffer.grad_data.data_ptr() + start * element, case
            assert param.main_grad.shape == param.shape and buffer.param_to_bucket[param].bucket_id == bucket_id
            if distopt:
                # param.data is moved into the param buffer, values kept.
                assert param.data.data_ptr() == buffer.param_data.data_ptr() + start * param.element_size()
                assert torch.equal(buffer.param_data[start:end], originals[index])
            else:
                assert torch.equal(param.detach(), originals[index])


def test_hand_computed_examples():
    """Three params of 10, 100 and 5 elements (registration order) with the distributed optimizer at DP=2:
    reversed, p2 sits at [0, 5), p1 at [64, 164), p0 at [192, 202); one bucket padded to 256."""
    params, _, buffer = _build([10, 100, 5], set(), True, 2, None, False)
    assert [buffer.param_index_map[p] for p in params] == [(192, 202, 0), (64, 164, 0), (0, 5, 0)]
    assert buffer.bucket_indices == [(0, 256)] and buffer.numel_unpadded == 202
    # bucket_size 64: p2 alone does not reach it (5 < 64), p2 + p1 does (164 >= 64): two buckets.
    params, _, buffer = _build([10, 100, 5], set(), True, 2, 64, False)
    assert buffer.bucket_indices == [(0, 256), (256, 384)]
    assert [b.numel_unpadded for b in buffer.buckets] == [164, 10]
    assert [buffer.param_index_map[p] for p in params] == [(256, 266, 1), (64, 164, 0), (0, 5, 0)]
    # The tied embedding (registered first, so last in the buffer) closes the open bucket at its padded start.
    params, _, buffer = _build([10, 100, 5], {0}, True, 2, None, False)
    assert buffer.bucket_indices == [(0, 256), (256, 384)]
    assert [b.params_list for b in buffer.buckets] == [[params[2], params[1]], [params[0]]]
    assert [b.numel_unpadded for b in buffer.buckets] == [192, 10]
    # Without the distributed optimizer nothing is padded and the tied embedding shares the bucket.
    params, _, buffer = _build([10, 100, 5], {0}, False, 2, None, False)
    assert [buffer.param_index_map[p] for p in params] == [(105, 115, 0), (5, 105, 0), (0, 5, 0)]
    assert buffer.bucket_indices == [(0, 115)]


def test_bucket_pack_map_and_bf16_buffers():
    """`param_to_index` packs a bucket's params back to back (Megatron's map for copying all-gathered
    params out of a reused buffer); bf16 params with fp32 grads keep their dtypes per buffer half."""
    params, _, buffer = _build([10, 100, 5], set(), True, 2, None, False, dtype=torch.bfloat16)
    assert buffer.buckets[0].param_to_index == {params[2]: (0, 5), params[1]: (5, 105), params[0]: (105, 115)}
    assert buffer.param_data.dtype == torch.bfloat16 and buffer.grad_data.dtype == torch.float32
    assert params[1].main_grad.dtype == torch.float32 and params[1].dtype == torch.bfloat16


def _ddp(model, ddp_config, pp_rank=0, dp=4, disable_bucketing=False):
    dp_group = FakeGroup(dp)
    grad_pgs = SimpleNamespace(dp=dp_group, dp_cp=dp_group, intra_dp_cp=dp_group)
    model_pgs = SimpleNamespace(tp=FakeGroup(1), pp=FakeGroup(2, pp_rank))
    config = SimpleNamespace(calculate_per_token_loss=False)
    return DistributedDataParallel(config, ddp_config, model, disable_bucketing=disable_bucketing,
                                   grad_comm_pgs=grad_pgs, model_comm_pgs=model_pgs)


def _toy_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.Linear(40, 50), torch.nn.Linear(50, 6))
    model[2].bias.requires_grad_(False)
    return model


def test_ddp_bucket_size_rules():
    """Megatron's DDP: an unset bucket_size becomes max(4e7, 1e6 x DP) in the (shared) config, and None
    without overlap_grad_reduce; the wrapper uses one bucket with disable_bucketing or when its pipeline
    rank is not 0. Frozen params get no main_grad and no place in the buffer."""
    config = DistributedDataParallelConfig(overlap_grad_reduce=True)
    ddp = _ddp(_toy_model(), config, dp=64)
    assert config.bucket_size == 64_000_000 and ddp.bucket_size == 64_000_000
    config = DistributedDataParallelConfig(overlap_grad_reduce=True)
    _ddp(_toy_model(), config, dp=4)
    assert config.bucket_size == 40_000_000
    config = DistributedDataParallelConfig(overlap_grad_reduce=False, bucket_size=500)
    ddp = _ddp(_toy_model(), config)
    assert config.bucket_size is None and len(ddp.buffers[0].buckets) == 1

    def buckets(**kwargs):
        pp_rank = kwargs.pop("pp_rank", 0)
        disable = kwargs.pop("disable_bucketing", False)
        model = _toy_model()
        ddp = _ddp(model, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=500, **kwargs),
                   pp_rank=pp_rank, disable_bucketing=disable)
        return model, ddp

    model, ddp = buckets()
    trainable = [p for p in model.parameters() if p.requires_grad]
    positions, expected = megatron_layout([p.numel() for p in trainable], set(), 500, False, 4)
    assert ddp.buffers[0].bucket_indices == [(s, e) for s, e, _, _ in expected] and len(expected) == 2
    assert len(ddp.bucket_groups) == 2 and all(len(g.buckets) == 1 for g in ddp.bucket_groups)
    assert not hasattr(model[2].bias, "main_grad") and model[2].bias not in ddp.param_to_bucket_group
    _, ddp = buckets(pp_rank=1)
    assert ddp.bucket_size is None and len(ddp.buffers[0].buckets) == 1
    _, ddp = buckets(disable_bucketing=True)
    assert len(ddp.buffers[0].buckets) == 1 and len(ddp.bucket_groups) == 1
    # Bucket groups expose Megatron's attribute names for their communication group.
    _, ddp = buckets()
    assert ddp.bucket_groups[0].data_parallel_group is ddp.intra_dp_cp_group
    assert not hasattr(ddp.bucket_groups[0], "intra_distributed_optimizer_instance_group")
    _, ddp = buckets(use_distributed_optimizer=True)
    group = ddp.bucket_groups[0]
    assert group.intra_distributed_optimizer_instance_group is ddp.intra_dp_cp_group
    assert (group.intra_distributed_optimizer_instance_size, group.intra_distributed_optimizer_instance_rank) == (4, 0)


def test_partition_buckets_groups_one_bucket_each_or_all():
    params, _, first = _build([300, 300, 300], set(), True, 2, 200, False)
    _, _, second = _build([50], set(), True, 2, 200, False, dtype=torch.bfloat16)
    groups = partition_buckets([first, second])
    assert [len(g.buckets) for g in groups] == [1, 1, 1, 1]
    single = partition_buckets([first, second], force_single_bucket_group=True)
    assert len(single) == 1 and single[0].buckets == first.buckets + second.buckets
    assert single[0].params == set(params) | set(second.params)
