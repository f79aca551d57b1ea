"""`FullyParallelSaveStrategyWrapper`: spread the writing of replicated shards over a group of ranks.

Without it, every shard is written by the rank holding its all-zero `replica_id` (e.g. DP rank 0), so
DP rank 0 writes everything. With it, the ranks of `parallelization_group` (normally the data-parallel
group) that hold the same shard (same key, offset and shape) share the work: shards are assigned
largest first to the holder with the least bytes so far. A shard is written at all only when some
rank of the group holds it as a main replica (so e.g. the tied output-layer copy stays unwritten).
"""
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch.distributed as dist

from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.strategies._collectives import all_gather_object, get_rank, is_distributed
from megatron.core.dist_checkpointing.strategies.base import AsyncSaveShardedStrategy, LoadShardedStrategy
from megatron.core.dist_checkpointing.strategies.resharding import stored_geometry

ShardId = Tuple[str, Tuple[int, ...], Tuple[int, ...]]


def _shard_id(sharded: ShardedTensor) -> ShardId:
    _, offset, shape = stored_geometry(sharded)
    return sharded.key, offset, shape


def _nbytes(sharded: ShardedTensor) -> int:
    return int(np.prod(stored_geometry(sharded)[2])) * sharded.data.element_size()


def assign_writers(per_rank: List[List[Tuple[ShardId, int, bool]]]) -> Dict[ShardId, int]:
    """{shard id: group rank that writes it} from every group rank's (id, bytes, is_main) list."""
    holders: Dict[ShardId, List[int]] = {}
    sizes: Dict[ShardId, int] = {}
    written = set()
    for rank, shards in enumerate(per_rank):
        for shard_id, nbytes, main in shards:
            holders.setdefault(shard_id, []).append(rank)
            sizes[shard_id] = nbytes
            if main:
                written.add(shard_id)
    load = [0] * len(per_rank)
    assignment = {}
    for shard_id in sorted(written, key=lambda s: (-sizes[s], s)):
        writer = min(holders[shard_id], key=lambda r: (load[r], r))
        assignment[shard_id] = writer
        load[writer] += sizes[shard_id]
    return assignment


class FullyParallelSaveStrategyWrapper(AsyncSaveShardedStrategy):
    """Wraps a torch_dist save strategy and picks the writers of replicated shards (collective)."""

    def __init__(self, strategy: AsyncSaveShardedStrategy, parallelization_group: Optional[dist.ProcessGroup] = None,
                 do_cache_distribution: bool = False):
        super().__init__(strategy.backend, strategy.version)
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution

    def select_tensors_to_write(self, tensors: List[ShardedTensor]) -> List[ShardedTensor]:
        """The subset of this rank's ShardedTensors it writes."""
        if not is_distributed():
            return [t for t in tensors if is_main_replica(t.replica_id)]
        local = [(_shard_id(t), _nbytes(t), is_main_replica(t.replica_id)) for t in tensors]
        assignment = assign_writers(all_gather_object(local, self.parallelization_group))
        me = get_rank(self.parallelization_group)
        chosen, seen = [], set()
        for sharded in tensors:
            shard_id = _shard_id(sharded)
            if assignment.get(shard_id) == me and shard_id not in seen:
                chosen.append(sharded)
                seen.add(shard_id)
        return chosen


class FullyParallelLoadStrategyWrapper(LoadShardedStrategy):
    """Accepted for Megatron compatibility: every rank reads only the shards it asks for already."""

    def __init__(self, strategy: LoadShardedStrategy, parallelization_group: Optional[dist.ProcessGroup] = None,
                 do_cache_distribution: bool = False, exchange_algo: str = "broadcast"):
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.exchange_algo = exchange_algo
