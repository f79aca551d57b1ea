"""N-D flattened tensors, and reading any requested shard from any stored layout of its key.

Megatron's distributed optimizer owns a contiguous range of each flattened parameter, so its state
shards are `ShardedTensor`s with a `flattened_range`: `data` is the slice `[start, stop)` of the
flattened local chunk (`local_shape`) of a global tensor of `global_shape`. The torch_dist backend
stores such a key "N-D flattened" (Megatron's `fully_sharded_model_space` layout): a global tensor of
shape [X, Y, Z] cut into local chunks [x, y, z] becomes [X // x, Y // y, Z // z, x * y * z], chunk
(i, j, k) holding chunk (i, j, k) flattened, and each rank writes the slice `[start, stop)` of the last
axis of its chunk. A 1-D tensor [X] with chunks [x] becomes [X // x, x].

Three stored layouts can meet one request, and `plan_reads` turns each case into plain DCP chunk reads:
- the stored shape is the request's own layout (same model shape, same chunking): read it directly;
- the key is stored in model shape (a non-distributed optimizer's state, or this framework's older
  distributed-optimizer files, which split each owned range into boxes): read the boxes that make up
  the requested range;
- the key is N-D flattened with another chunking (another TP size, or a non-distributed reader): read,
  for every stored chunk the requested region touches, the flat range of that chunk spanning the
  region, rebuild the chunk's model-space block and copy the intersection out.

Design note (why the stored chunking is read from the shape): Megatron-LM 0.13.1 records the original
global shape of N-D flattened keys in `mcore_data` of `.metadata` only on some save paths (its default,
decentralized planning writes none). The stored shape says it anyway: with the model's global shape G
(from the request) and the stored fragments S, the saved chunk is G // S per axis.
"""
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from megatron.core.dist_checkpointing.mapping import CheckpointingException, ShardedTensor

Box = Tuple[int, Tuple[int, ...], Tuple[int, ...]]
ChunkId = Tuple[str, Tuple[int, ...]]


def flat_range_to_boxes(shape: Tuple[int, ...], start: int, stop: int) -> List[Box]:
    """Split the flat range [start, stop) of a row-major tensor of `shape` into rectangular boxes.

    Returns `(flat_start, offset, box_shape)` triples in flat order; each box is contiguous in memory.
    """
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [(start, (start,), (stop - start,))]
    inner = math.prod(shape[1:])
    boxes: List[Box] = []

    def partial_row(row: int, lo: int, hi: int) -> None:
        for flat, offset, box_shape in flat_range_to_boxes(tuple(shape[1:]), lo - row * inner, hi - row * inner):
            boxes.append((flat + row * inner, (row,) + offset, (1,) + box_shape))

    if start % inner:
        row = start // inner
        head_stop = min(stop, (row + 1) * inner)
        partial_row(row, start, head_stop)
        start = head_stop
    full_end = (stop // inner) * inner
    if start < full_end:
        boxes.append((start, (start // inner,) + (0,) * (len(shape) - 1),
                      ((full_end - start) // inner,) + tuple(shape[1:])))
        start = full_end
    if start < stop:
        partial_row(start // inner, start, stop)
    return boxes


def is_nd_flattened_tensor(sharded) -> bool:
    """True for a ShardedTensor holding a flattened range of its local chunk (stored N-D flattened)."""
    return isinstance(sharded, ShardedTensor) and sharded.flattened_range is not None


def nd_flattened_tensor_reformulated_global_shape(sharded: ShardedTensor) -> Tuple[int, ...]:
    """The stored global shape of an N-D flattened key: (*chunks per axis, numel of one chunk)."""
    chunk = sharded.chunk_shape()
    return tuple(g // c for g, c in zip(sharded.global_shape, chunk)) + (math.prod(chunk),)


def stored_geometry(sharded: ShardedTensor) -> Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]:
    """(global shape, global offset, chunk shape) of `sharded` as the torch_dist backend stores it."""
    if not is_nd_flattened_tensor(sharded):
        return tuple(sharded.global_shape), tuple(sharded.global_offset), sharded.chunk_shape()
    chunk_index = sharded.local_chunk_offset_in_global()
    ndim = len(sharded.global_shape)
    length = sharded.flattened_range.stop - sharded.flattened_range.start
    return (nd_flattened_tensor_reformulated_global_shape(sharded), tuple(chunk_index) + (sharded.flattened_range.start,),
            (1,) * ndim + (length,))


def stored_data(sharded: ShardedTensor, data: torch.Tensor) -> torch.Tensor:
    """`data` shaped as the chunk the torch_dist backend writes for `sharded`."""
    # [*local_shape] -> [1]*prepend + [*local_shape]; flattened: [n] -> [1]*ndim + [n]
    return data.reshape(stored_geometry(sharded)[2])


@dataclass
class ReadPlan:
    """Chunk reads for DCP plus the copies that finish a load once the reads are done.

    `reads` maps (key, stored offset) to the chunk-shaped buffer that receives the data (clipped to the
    stored shape by the reader); `finishers` run after the reads, in order.
    """

    reads: Dict[ChunkId, torch.Tensor] = field(default_factory=dict)
    """(key, offset) -> chunk-shaped target buffer."""
    finishers: List[Callable[[], None]] = field(default_factory=list)
    """Copies out of temporary buffers, run after the reads."""

    def read(self, key: str, offset: Sequence[int], target: torch.Tensor) -> None:
        """Read the stored chunk at `offset` (of `target`'s shape) of `key` into `target`."""
        chunk_id = (key, tuple(int(o) for o in offset))
        first = self.reads.get(chunk_id)
        if first is None:
            self.reads[chunk_id] = target
            return
        if tuple(first.shape) != tuple(target.shape):
            raise CheckpointingException(
                f"{key!r}: two requests read the stored chunk at offset {chunk_id[1]} with different shapes "
                f"{tuple(first.shape)} and {tuple(target.shape)}")
        self.finishers.append(lambda: target.copy_(first))


def _saved_chunk_shape(sharded: ShardedTensor, stored_shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The chunk shape an N-D flattened `stored_shape` was saved with, for the model tensor `sharded`."""
    fragments, numel = stored_shape[:-1], stored_shape[-1]
    global_shape = tuple(sharded.global_shape)
    chunk = [g // f if f and g % f == 0 else 0 for g, f in zip(global_shape, fragments)]
    if math.prod(chunk) == numel and all(chunk):
        return tuple(chunk)
    axis = sharded.prepend_axis_num
    others = math.prod(c for i, c in enumerate(chunk) if i != axis)
    if sharded.allow_shape_mismatch and others and all(c for i, c in enumerate(chunk) if i != axis) \
            and numel % others == 0:
        # Vocabulary padding depends on TP: the first model axis may differ from the saved one.
        chunk[axis] = numel // others
        return tuple(chunk)
    raise CheckpointingException(
        f"{sharded.key!r}: the checkpoint stores it N-D flattened with shape {stored_shape}, which does not "
        f"split the model tensor of global shape {global_shape} into equal chunks (different model "
        f"configuration?)")


def _requested_boxes(sharded: ShardedTensor) -> List[Box]:
    """(flat start in `data`, global offset, global box shape) of the regions `sharded` asks for."""
    prepend = sharded.prepend_axis_num
    head_offset = tuple(sharded.global_offset[:prepend])
    rest_offset = tuple(sharded.global_offset[prepend:])
    if sharded.flattened_range is None:
        return [(0, tuple(sharded.global_offset), sharded.chunk_shape())]
    start = sharded.flattened_range.start
    boxes = []
    for flat, offset, shape in flat_range_to_boxes(tuple(sharded.local_shape), start, sharded.flattened_range.stop):
        boxes.append((flat - start, head_offset + tuple(r + o for r, o in zip(rest_offset, offset)),
                      (1,) * prepend + tuple(shape)))
    return boxes


def _box_view(data: torch.Tensor, flat: int, shape: Tuple[int, ...]) -> torch.Tensor:
    # [numel] -> [*box shape]
    return data.view(-1)[flat:flat + math.prod(shape)].view(shape)


def _plan_model_space(plan: ReadPlan, sharded: ShardedTensor, data: torch.Tensor) -> None:
    """The key is stored in model shape: read each box of the requested region directly."""
    for flat, offset, shape in _requested_boxes(sharded):
        plan.read(sharded.key, offset, _box_view(data, flat, shape))


def _ravel(index: Sequence[int], shape: Sequence[int]) -> int:
    flat = 0
    for i, size in zip(index, shape):
        flat = flat * size + i
    return flat


def _plan_reformulated(plan: ReadPlan, sharded: ShardedTensor, data: torch.Tensor,
                       stored_shape: Tuple[int, ...]) -> None:
    """The key is N-D flattened with another chunking: rebuild the touched stored chunks' blocks."""
    chunk = _saved_chunk_shape(sharded, stored_shape)
    fragments = stored_shape[:-1]
    for flat, offset, shape in _requested_boxes(sharded):
        target = _box_view(data, flat, shape)
        first_chunk = [o // c for o, c in zip(offset, chunk)]
        last_chunk = [min((o + s - 1) // c, f - 1) for o, s, c, f in zip(offset, shape, chunk, fragments)]
        for index in _index_range(first_chunk, last_chunk):
            base = [i * c for i, c in zip(index, chunk)]
            lo = [max(o, b) - b for o, b in zip(offset, base)]
            hi = [min(o + s, b + c) - b for o, s, b, c in zip(offset, shape, base, chunk)]
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            begin, end = _ravel(lo, chunk), _ravel([h - 1 for h in hi], chunk) + 1
            buffer = torch.zeros((1,) * len(chunk) + (end - begin,), dtype=data.dtype, device=data.device)
            plan.read(sharded.key, tuple(index) + (begin,), buffer)
            source = tuple(slice(l, h) for l, h in zip(lo, hi))
            dest = tuple(slice(b + l - o, b + h - o) for b, l, h, o in zip(base, lo, hi, offset))
            plan.finishers.append(_block_copy(buffer, chunk, begin, source, target, dest))


def _index_range(first: List[int], last: List[int]):
    if not first:
        yield ()
        return
    for i in range(first[0], last[0] + 1):
        for rest in _index_range(first[1:], last[1:]):
            yield (i,) + rest


def _block_copy(buffer: torch.Tensor, chunk: Tuple[int, ...], begin: int, source, target: torch.Tensor, dest):
    def finish():
        block = torch.zeros(math.prod(chunk), dtype=buffer.dtype, device=buffer.device)
        block[begin:begin + buffer.numel()] = buffer.view(-1)
        # [numel of the chunk] -> [*chunk]
        target[dest].copy_(block.view(chunk)[source])

    return finish


def plan_reads(plan: ReadPlan, sharded: ShardedTensor, data: torch.Tensor, stored_shape: Tuple[int, ...]) -> None:
    """Add to `plan` the reads (and copies) that fill `data` (contiguous, shaped like `sharded.data`) with
    what `sharded` asks for from a key stored with global shape `stored_shape`."""
    stored_shape = tuple(stored_shape)
    _, own_offset, own_chunk = stored_geometry(sharded)
    ndim = len(sharded.global_shape)
    if len(stored_shape) == ndim:
        if stored_shape != tuple(sharded.global_shape) and not sharded.allow_shape_mismatch:
            raise CheckpointingException(
                f"ShardedTensor {sharded.key!r}: the checkpoint holds global shape {stored_shape}, the model asks "
                f"for {tuple(sharded.global_shape)} (different model configuration?)")
        if is_nd_flattened_tensor(sharded):
            _plan_model_space(plan, sharded, data)
        else:
            plan.read(sharded.key, own_offset, data.view(own_chunk))
    elif len(stored_shape) == ndim + 1:
        if is_nd_flattened_tensor(sharded) and _saved_chunk_shape(sharded, stored_shape) == sharded.chunk_shape():
            plan.read(sharded.key, own_offset, data.view(own_chunk))
        else:
            _plan_reformulated(plan, sharded, data, stored_shape)
    else:
        raise CheckpointingException(
            f"ShardedTensor {sharded.key!r}: the checkpoint holds global shape {stored_shape}, the model asks "
            f"for {tuple(sharded.global_shape)} (different model configuration?)")


__all__ = [
    "flat_range_to_boxes", "is_nd_flattened_tensor", "nd_flattened_tensor_reformulated_global_shape",
    "stored_geometry", "stored_data", "ReadPlan", "plan_reads",
]
