"""Optimizer state in model space for distributed checkpoints (Megatron's `fully_sharded_model_space`).

Every optimizer (FP32, Float16 with fp32 main params, distributed) saves the same keys:
`optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<model key>`, each a ShardedTensor laid out exactly like
the model tensor `<model key>` (stacked layer axis, TP offsets, SwiGLU `[all gate; all up]`). A
checkpoint therefore loads into any other TP/PP/DP layout and into a distributed or non-distributed
optimizer alike. Hyper-parameters, Adam's `step` (per group) and the grad scaler go to `common.pt`.

Design note (no flattened ranges on disk): a distributed-optimizer rank owns a contiguous range of each
flattened parameter. That range is split into rectangular boxes (a partial first row, whole rows, a
partial last row, recursively for more dimensions); each box is an ordinary ShardedTensor, so the
torch_dist backend stores it as a plain DCP chunk and any other layout reads it back by intersection.
The boxes are views of the optimizer's own tensors, so a load fills the state in place.
"""
import copy
import inspect
import math
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

SHARDING_TYPE = "fully_sharded_model_space"
"""The value of `content_metadata['distrib_optim_sharding_type']` for this layout."""
DP_ZERO_SHARDING_TYPE = "dp_zero_gather_scatter"
"""Megatron's layout for distributed-optimizer state saved with `--no-ckpt-fully-parallel-save`: the legacy
`distrib_optim.pt` dict as one ShardedObject per model-parallel rank (readable only at the same TP/PP)."""
SHARDING_TYPE_KEY = "param_state_sharding_type"
"""Marks an optimizer state dict produced by `sharded_state_dict` (and its loaded counterpart)."""
STATE_PREFIX = "optimizer.state"
_IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "params", "step")

Box = Tuple[int, Tuple[int, ...], Tuple[int, ...]]


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


def param_to_sharded_map(model_sharded_state_dict: Dict) -> Dict[int, Any]:
    """{id(parameter): its ShardedTensor or ShardedTensorFactory}; main replicas win over copies."""
    result: Dict[int, Any] = {}
    for value in nested_values(model_sharded_state_dict):
        if not isinstance(value, (ShardedTensor, ShardedTensorFactory)) or value.data is None:
            continue
        replica = value.replica_id if isinstance(value.replica_id, tuple) else (value.replica_id,)
        if id(value.data) not in result or replica[0] == 0:
            result[id(value.data)] = value
    return result


def _pieces(sharded: Any, param: torch.Tensor) -> List[Tuple[ShardedTensor, Any]]:
    """[(ShardedTensor whose data is a view of `param`, where it sits)]: its flat start in `param` when the view
    is contiguous, else its `_StridedBox` (e.g. GroupedMLP's transposed experts)."""
    if isinstance(sharded, ShardedTensorFactory):
        built = sharded.build_fn(sharded.key, param.detach(), sharded.replica_id, None)
        pieces = [v for v in nested_values(built if isinstance(built, dict) else {"_": built})]
    else:
        pieces = [sharded]
    result = []
    for piece in pieces:
        data = piece.data
        if data.untyped_storage().data_ptr() != param.untyped_storage().data_ptr():
            raise ValueError(f"optimizer state for {piece.key!r}: the model shard is not a view of the parameter "
                             "(a copy), so its optimizer state cannot be mapped to model space")
        start = data.storage_offset() - param.storage_offset()
        if data.is_contiguous():
            result.append((piece, start))
        else:
            result.append((piece, _StridedBox.of(data, start, param.numel(), piece.key)))
    return result


class _StridedBox:
    """A non-contiguous view of a parameter that is a box of the parameter's memory seen as a row-major array:
    `mem_shape` (the parameter's memory dimensions), the box's `offset` and `size` there, and `order`, the
    view's dimension of each memory dimension (None for an inserted size-1 dimension)."""

    def __init__(self, mem_shape, offset, size, order):
        self.mem_shape, self.offset, self.size, self.order = tuple(mem_shape), tuple(offset), tuple(size), order

    @classmethod
    def of(cls, data: torch.Tensor, start: int, param_numel: int, key: str) -> "_StridedBox":
        dims = sorted((d for d in range(data.dim()) if data.shape[d] > 1), key=lambda d: -data.stride(d))
        strides = [data.stride(d) for d in dims]
        ok = bool(dims) and strides[-1] == 1 and all(a % b == 0 and a > b for a, b in zip(strides, strides[1:]))
        ok = ok and param_numel % strides[0] == 0
        if not ok:
            raise ValueError(f"optimizer state for {key!r}: the model shard is a view of the parameter that is not a "
                             "box of its memory, so its optimizer state cannot be mapped to model space")
        mem_shape = [param_numel // strides[0]] + [a // b for a, b in zip(strides, strides[1:])]
        offset = [start // strides[0]] + [(start % a) // b for a, b in zip(strides, strides[1:])]
        size = [data.shape[d] for d in dims]
        if any(o + n > m for o, n, m in zip(offset, size, mem_shape)):
            raise ValueError(f"optimizer state for {key!r}: the model shard does not fit in the parameter's memory")
        return cls(mem_shape, offset, size, dims)

    def owned_boxes(self, own_start: int, own_stop: int):
        """(flat start of the owned memory box, its shape, the slices of the piece inside it, the piece-local
        offset per view dimension) for every part of the piece in the owned flat range."""
        for flat, box_offset, box_shape in flat_range_to_boxes(self.mem_shape, own_start, own_stop):
            lows = [max(b, o) for b, o in zip(box_offset, self.offset)]
            highs = [min(b + n, o + m) for b, n, o, m in zip(box_offset, box_shape, self.offset, self.size)]
            if any(lo >= hi for lo, hi in zip(lows, highs)):
                continue
            slices = tuple(slice(lo - b, hi - b) for lo, hi, b in zip(lows, highs, box_offset))
            yield flat, box_shape, slices, {d: lo - o for d, lo, o in zip(self.order, lows, self.offset)}


def _strided_shards(piece, box: _StridedBox, own_start, own_stop, tensors, replica_id) -> Dict[str, ShardedTensor]:
    """The owned part of a strided piece as ShardedTensors whose data are (strided) views of the state tensors."""
    result = {}
    prepend, ndim = piece.prepend_axis_num, len(piece.local_shape)
    to_view = [box.order.index(d) for d in range(ndim) if d in box.order]
    for flat, box_shape, slices, local_offset in box.owned_boxes(own_start, own_stop):
        offset = [local_offset.get(d, 0) for d in range(ndim)]
        global_offset = tuple(piece.global_offset[:prepend]) + tuple(
            g + o for g, o in zip(piece.global_offset[prepend:], offset))
        for name, tensor in tensors.items():
            begin = flat - own_start
            # [owned numel] -> memory box -> the piece's part -> the view's dimension order (size-1 dims back in)
            memory = tensor.view(-1)[begin:begin + math.prod(box_shape)].view(box_shape)[slices]
            data = memory.permute(to_view)
            for d in range(ndim):
                if d not in box.order:
                    data = data.unsqueeze(d)
            key = f"{STATE_PREFIX}.{name}.{piece.key}"
            result[f"{key}@{'_'.join(map(str, global_offset))}"] = ShardedTensor(
                key, data, tensor.dtype, tuple(data.shape), tuple(piece.global_shape), global_offset, None, replica_id,
                prepend, allow_shape_mismatch=piece.allow_shape_mismatch)
    return result


def _optimizer_replica_id(replica_id: Any, sharded_over_dp: bool, instance_id: int = 0) -> Any:
    """A sharded optimizer's pieces are unique inside one distributed-optimizer instance: the DP coordinate
    of the replica id becomes the instance id (Megatron's rule), so only instance 0 writes them."""
    if not sharded_over_dp:
        return replica_id
    if isinstance(replica_id, tuple):
        return (*replica_id[:-1], instance_id)
    return instance_id


def _nd_flattened_shards(piece: ShardedTensor, piece_start: int, lo: int, hi: int, own_start: int,
                         tensors: Dict[str, torch.Tensor], replica_id: Any) -> Dict[str, ShardedTensor]:
    """The owned flat range [lo, hi) of `piece` in Megatron-LM's N-D flattened layout: a model tensor of global
    shape [X, Y, Z] split into local chunks [x, y, z] is stored as [X // x, Y // y, Z // z, x * y * z], chunk
    (i, j, k) holding that chunk flattened; the range is the slice [lo, hi) of the last axis of one chunk."""
    prepend = piece.prepend_axis_num
    chunk_shape = (1,) * prepend + tuple(piece.local_shape)
    fragments = tuple(g // c for g, c in zip(piece.global_shape, chunk_shape))
    chunk_index = tuple(o // c for o, c in zip(piece.global_offset, chunk_shape))
    local_shape = (1,) * len(fragments) + (hi - lo,)
    global_shape = fragments + (math.prod(piece.local_shape),)
    global_offset = chunk_index + (lo - piece_start,)
    result = {}
    for name, tensor in tensors.items():
        # [owned numel] -> [1, ..., 1, hi - lo]
        data = tensor.view(-1)[lo - own_start:hi - own_start].view(local_shape)
        key = f"{STATE_PREFIX}.{name}.{piece.key}"
        result[f"{key}@{'_'.join(map(str, global_offset))}"] = ShardedTensor(
            key, data, tensor.dtype, local_shape, global_shape, global_offset, None, replica_id, 0)
    return result


def model_space_state_shards(entries: Iterable[Tuple[torch.Tensor, int, int, Dict[str, torch.Tensor]]],
                             param_map: Dict[int, Any], sharded_over_dp: bool,
                             nd_flattened: bool = False, instance_id: int = 0) -> Dict[str, ShardedTensor]:
    """ShardedTensors of optimizer state tensors, in model space.

    entries: (model param, owned flat start, owned flat stop, {state name: tensor of the owned range}).
    With `sharded_over_dp` (distributed optimizer) every DP rank writes the part it owns. With `nd_flattened`
    the requests follow Megatron-LM's distributed-optimizer layout instead (`_nd_flattened_shards`; tensors
    with one dimension keep the model layout, as Megatron stores them): used to read its checkpoints.
    `instance_id` is this rank's distributed-optimizer instance (see `_optimizer_replica_id`).
    """
    result: Dict[str, ShardedTensor] = {}
    for model_param, own_start, own_stop, tensors in entries:
        sharded = param_map.get(id(model_param))
        if sharded is None:
            continue
        for piece, piece_start in _pieces(sharded, model_param):
            if isinstance(piece_start, _StridedBox):
                if nd_flattened:
                    raise ValueError(f"optimizer state for {piece.key!r}: Megatron-LM's distributed-optimizer layout of "
                                     "a transposed expert shard (GroupedMLP) cannot be read")
                replica_id = _optimizer_replica_id(piece.replica_id, sharded_over_dp, instance_id)
                result.update(_strided_shards(piece, piece_start, own_start, own_stop, tensors, replica_id))
                continue
            lo = max(own_start, piece_start)
            hi = min(own_stop, piece_start + piece.data.numel())
            prepend = piece.prepend_axis_num
            replica_id = _optimizer_replica_id(piece.replica_id, sharded_over_dp, instance_id)
            if nd_flattened and len(piece.global_shape) > 1:
                if lo < hi:
                    result.update(_nd_flattened_shards(piece, piece_start, lo, hi, own_start, tensors, replica_id))
                continue
            for flat, offset, box_shape in flat_range_to_boxes(tuple(piece.local_shape), lo - piece_start,
                                                               hi - piece_start):
                begin = piece_start + flat - own_start
                numel = math.prod(box_shape)
                global_offset = tuple(piece.global_offset[:prepend]) + tuple(
                    g + o for g, o in zip(piece.global_offset[prepend:], offset))
                for name, tensor in tensors.items():
                    # [owned numel] -> [*box_shape]
                    data = tensor.view(-1)[begin:begin + numel].view(box_shape)
                    key = f"{STATE_PREFIX}.{name}.{piece.key}"
                    result[f"{key}@{'_'.join(map(str, global_offset))}"] = ShardedTensor(
                        key, data, tensor.dtype, tuple(box_shape), tuple(piece.global_shape), global_offset,
                        None, replica_id, prepend, allow_shape_mismatch=piece.allow_shape_mismatch)
    return result


def ensure_state(optimizer: torch.optim.Optimizer, init_state_fn, config) -> None:
    """Create empty state (zeros, step 0) for every param without state, so that a load can fill it in place."""
    if optimizer is None:
        return
    if init_state_fn is not None and len(optimizer.state) == 0:
        # Megatron's init functions take (optimizer, config); its default placeholder takes (optimizer).
        takes_config = len(inspect.signature(init_state_fn).parameters) >= 2
        init_state_fn(*((optimizer, config) if takes_config else (optimizer,)))
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if len(state) != 0:
                continue
            if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param.data)
                state["exp_avg_sq"] = torch.zeros_like(param.data)
            elif isinstance(optimizer, torch.optim.SGD) and group.get("momentum", 0) and not group.get("dampening"):
                # A zero buffer gives the same first step as torch's lazy `clone(grad)` when dampening is 0.
                state["momentum_buffer"] = torch.zeros_like(param.data)


def state_tensors(optimizer: torch.optim.Optimizer, main_param: torch.Tensor) -> Dict[str, torch.Tensor]:
    """{'fp32_param': main param, <every param-shaped state tensor>: tensor} of one main param."""
    tensors = {"fp32_param": main_param.detach()}
    for name, value in optimizer.state.get(main_param, {}).items():
        if torch.is_tensor(value) and value.shape == main_param.shape and name != "step":
            tensors[name] = value
    return tensors


def _group_step(optimizer: torch.optim.Optimizer, group: Dict) -> Optional[int]:
    for param in group["params"]:
        step = optimizer.state.get(param, {}).get("step")
        if step is not None:
            return int(step.item()) if torch.is_tensor(step) else int(step)
    return None


def param_groups_without_params(optimizer: Optional[torch.optim.Optimizer]) -> List[Dict]:
    """Hyper-parameters of every group (no params, no implementation flags) plus its Adam `step`."""
    if optimizer is None:
        return []
    groups = []
    for group in optimizer.param_groups:
        saved = {k: copy.deepcopy(v) for k, v in group.items() if k not in _IMPLEMENTATION_KEYS}
        step = _group_step(optimizer, group)
        if step is not None:
            saved["step"] = step
        groups.append(saved)
    return groups


def load_param_groups(optimizer: Optional[torch.optim.Optimizer], saved_groups: List[Dict]) -> None:
    """Restore hyper-parameters and Adam's `step` of every group from `param_groups_without_params`."""
    if optimizer is None:
        return
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint has {len(saved_groups)} optimizer param groups, this run has "
            f"{len(optimizer.param_groups)}: the parameter grouping (weight decay / lr multipliers) must match")
    for group, saved in zip(optimizer.param_groups, saved_groups):
        for key, value in saved.items():
            if key not in _IMPLEMENTATION_KEYS:
                group[key] = copy.deepcopy(value)
        step = saved.get("step")
        if step is None:
            continue
        for param in group["params"]:
            state = optimizer.state[param]
            old = state.get("step")
            if torch.is_tensor(old):
                state["step"] = torch.full_like(old, float(step))
            elif old is not None:
                state["step"] = step


__all__ = [
    "SHARDING_TYPE", "SHARDING_TYPE_KEY", "DP_ZERO_SHARDING_TYPE", "flat_range_to_boxes", "param_to_sharded_map",
    "model_space_state_shards",
    "ensure_state", "state_tensors", "param_groups_without_params", "load_param_groups",
]
