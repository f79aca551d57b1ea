"""One 4-rank gloo launch: save a tensor split over ranks along dim 0 (plus stacked layers, a
replicated tensor and per-rank objects), load it split over 2 ranks along dim 1 and unsplit,
check replica handling, integrity validation, strict handling and that async saves write the same
files as synchronous ones."""
import os

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor, StrictHandling
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy, read_dcp_metadata
from tests.harness import run_on_ranks

WORLD = 4


def _global_tensors():
    g = torch.Generator().manual_seed(1234)
    return torch.randn(8, 6, generator=g), torch.randn(WORLD, 3, 5, generator=g), torch.randn(3, generator=g)


def _save_state(rank):
    full, layers, replicated = _global_tensors()
    return {
        "w": ShardedTensor.from_rank_offsets("w", full[2 * rank: 2 * rank + 2].clone(), (0, rank, WORLD)),
        "layer": ShardedTensor.from_rank_offsets("decoder.layers.w", layers[rank].clone(), (0, rank, WORLD),
                                                 prepend_axis_num=1),
        "rep": ShardedTensor.from_rank_offsets("rep", replicated.clone() + rank * (rank > 0), replica_id=rank),
        "rng": ShardedObject("rng_state", {"rank": rank}, (WORLD,), (rank,)),
        "iteration": 3,
    }


def _check_load(ckpt, rank):
    full, layers, replicated = _global_tensors()
    if rank < 2:  # split over 2 ranks along dim 1
        w = ShardedTensor.from_rank_offsets("w", torch.zeros(8, 3), (1, rank, 2), replica_id=0)
    else:  # unsplit
        w = ShardedTensor.from_rank_offsets("w", torch.zeros(8, 6), replica_id=rank)
    other = (rank + 1) % WORLD
    request = {"w": w, "rep": ShardedTensor.from_rank_offsets("rep", torch.zeros(3)),
               "layer": ShardedTensor.from_rank_offsets("decoder.layers.w", torch.zeros(3, 5), (0, other, WORLD),
                                                        prepend_axis_num=1),
               "rng": ShardedObject("rng_state", None, (WORLD,), (other,))}
    loaded = dc.load(request, ckpt)
    expected_w = full[:, 3 * rank: 3 * rank + 3] if rank < 2 else full
    assert torch.equal(loaded["w"], expected_w), rank
    assert torch.equal(loaded["rep"], replicated), "only replica 0 may be written"
    assert torch.equal(loaded["layer"], layers[other])
    assert loaded["rng"] == {"rank": other} and loaded["iteration"] == 3


def _multirank_body(tmp):
    rank = dist.get_rank()
    sync_dir, async_dir = os.path.join(tmp, "sync"), os.path.join(tmp, "async")
    dc.save(_save_state(rank), sync_dir)
    files = sorted(os.listdir(sync_dir))
    assert {"metadata.json", "common.pt", ".metadata"} <= set(files), files
    assert {f"__{r}_0.distcp" for r in range(WORLD)} <= set(files), files
    _check_load(sync_dir, rank)
    plain = dc.load_plain_tensors(sync_dir)
    full, layers, _ = _global_tensors()
    assert torch.equal(plain["w"], full) and torch.equal(plain["decoder.layers.w"], layers)

    queue = AsyncCallsQueue()
    queue.schedule_async_request(dc.save(_save_state(rank), async_dir, async_sharded_save=True))
    assert not os.path.exists(os.path.join(async_dir, "metadata.json"))
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    assert sorted(os.listdir(async_dir)) == files
    if rank == 0:
        for name in files:
            if name.endswith(".distcp") or name == "common.pt":
                with open(os.path.join(sync_dir, name), "rb") as a, open(os.path.join(async_dir, name), "rb") as b:
                    assert a.read() == b.read(), name
    _check_load(async_dir, rank)

    req = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 6), (0, rank, WORLD))}
    _, missing, unexpected = dc.load(req, sync_dir, strict=StrictHandling.RETURN_UNEXPECTED)
    assert not missing and "decoder.layers.w" in unexpected and "rep" in unexpected

    _check_fully_parallel(os.path.join(tmp, "fully_parallel"), rank)

    overlapping = {"x": ShardedTensor.from_rank_offsets("x", torch.zeros(2), replica_id=0)}
    try:
        dc.save(overlapping, os.path.join(tmp, "bad"))
    except CheckpointingException as exc:
        assert "overlap" in str(exc), str(exc)
    else:
        raise AssertionError("overlapping main replicas must be refused")
    return True


def _check_fully_parallel(ckpt, rank):
    """Replicated tensors are written by several ranks, not all by the main replica (rank 0)."""
    state = {f"r{i}": ShardedTensor.from_rank_offsets(f"r{i}", torch.full((10 + i, 3), float(i)), replica_id=rank)
             for i in range(WORLD)}
    dc.save(state, ckpt, sharded_strategy=FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy()))
    writers = {index.fqn: info.relative_path.split("_")[2] for index, info in read_dcp_metadata(ckpt).storage_data.items()}
    assert len(set(writers.values())) == WORLD, writers
    plain = dc.load_plain_tensors(ckpt)
    for i in range(WORLD):
        assert torch.equal(plain[f"r{i}"], torch.full((10 + i, 3), float(i)))


def test_save_4_ranks_load_other_layouts(tmp_path):
    assert run_on_ranks(_multirank_body, WORLD, str(tmp_path), timeout=240) == [True] * WORLD
