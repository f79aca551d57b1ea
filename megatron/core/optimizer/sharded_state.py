"""Optimizer state for distributed checkpoints, in Megatron-LM 0.13.1's layout (`fully_sharded_model_space`).

Every optimizer saves its per-parameter tensors under the model tensor's key: `optimizer.state.<name>.<model
key>` (`exp_avg`, `exp_avg_sq`, ..., and `fp32_param` for the fp32 main copy of a half-precision model param),
each sharded exactly like the model tensor (stacked layer axis, TP offsets, SwiGLU `[all gate; all up]`).
What differs between the optimizers is how those shards look, and the common part (`common.pt`):

| optimizer | tensors | common part |
|---|---|---|
| `FP32Optimizer` | model-shaped, no `fp32_param` | `{"state": {"common_step": step}, "param_groups": [...]}` |
| `Float16OptimizerWithFloat16Params` | model-shaped, `fp32_param` under `fp32_from_fp16_params` | `{"optimizer": {"state": {"common_step"}, "param_groups"}, "grad_scaler"}` |
| `DistributedOptimizer` | `flattened_range` shards: the rank's owned range of each chunk, stored N-D flattened | `{"optimizer": {"param_groups" (+ "step")}, "param_state": {i: {"step"}}, "param_state_sharding_type"}` |

The torch_dist backend reads any of these tensor layouts into any other (`dist_checkpointing.strategies.resharding`),
so a checkpoint loads at another TP/PP/DP layout and into a distributed or non-distributed optimizer alike.

Design note (loading in place): every tensor of an optimizer's sharded state dict is a view of the optimizer's
own state (created zero-filled first when the optimizer has not stepped yet), so a distributed load fills the
state in place; `load_state_dict` then restores hyper-parameters, Adam's `step` and the grad scaler from
whichever of the common layouts above the checkpoint holds (`sharded_common_groups_and_step`). A
`LocalNonpersistentObject` under `SHARDED_LOAD_KEY` in the request tells `load_state_dict` that it sees such a
loaded dict (it is never saved).
"""
import copy
import inspect
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.strategies.resharding import flat_range_to_boxes

SHARDING_TYPE = "fully_sharded_model_space"
"""The value of `content_metadata['distrib_optim_sharding_type']` for this layout."""
DP_ZERO_SHARDING_TYPE = "dp_zero_gather_scatter"
"""Megatron's layout for distributed-optimizer state saved with `--no-ckpt-fully-parallel-save`: the legacy
`distrib_optim.pt` dict as one ShardedObject per model-parallel rank (readable only at the same TP/PP)."""
SHARDING_TYPE_KEY = "param_state_sharding_type"
"""Names the distributed optimizer's layout in its sharded state dict (and in this framework's older files)."""
SHARDED_LOAD_KEY = "sharded_state_loaded"
"""Request-only marker (never saved): the state dict comes from a distributed load into this optimizer."""
STATE_PREFIX = "optimizer.state"
_IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "params", "step")

# What Megatron-LM's param groups hold for torch's kernel choices (torch.optim.AdamW's defaults, which it keeps):
# this run's choice (fused / foreach) is a property of the run, never written, and never read back.
MEGATRON_KERNEL_FLAGS = {"fused": None, "foreach": None}


def megatron_param_groups(groups: List[Dict]) -> List[Dict]:
    """Copies of `groups` (no params) with the kernel choices as Megatron writes them (`MEGATRON_KERNEL_FLAGS`)."""
    return [{**{k: copy.deepcopy(v) for k, v in group.items() if k != "params"}, **MEGATRON_KERNEL_FLAGS}
            for group in groups]


def _parameter_of(data: torch.Tensor) -> torch.Tensor:
    """The model parameter a model state-dict tensor stands for: itself, or, for the dequantized values of an
    FP8-primary weight (`--fp8-param-gather`, `megatron.core.fp8.params`), the parameter they were read from."""
    return getattr(data, "fp8_values_of", data)


def param_to_sharded_map(model_sharded_state_dict: Dict) -> Dict[int, Any]:
    """{id(parameter): its ShardedTensor or ShardedTensorFactory}; main replicas win over copies."""
    result: Dict[int, Any] = {}
    for value in nested_values(model_sharded_state_dict):
        if not isinstance(value, (ShardedTensor, ShardedTensorFactory)) or value.data is None:
            continue
        replica = value.replica_id if isinstance(value.replica_id, tuple) else (value.replica_id,)
        key = id(_parameter_of(value.data))
        if key not in result or replica[0] == 0:
            result[key] = value
    return result


def _pieces(sharded: Any, param: torch.Tensor) -> List[Tuple[ShardedTensor, Any]]:
    """[(ShardedTensor whose data is a view of `param`, where it sits)]: its flat start in `param` when the view
    is contiguous, else its `_StridedBox` (e.g. GroupedMLP's transposed experts). An FP8-primary weight's pieces
    are views of its dequantized values, which stand in for the parameter (same shape, contiguous)."""
    if _parameter_of(sharded.data) is param and sharded.data is not param:
        param = sharded.data
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


def _add_strided_piece(result: Dict[str, Any], index: int, piece: ShardedTensor, box: "_StridedBox", own_start: int,
                       own_stop: int, tensors: Dict[str, torch.Tensor], replica_id: Any) -> None:
    """The owned part of a piece that is a strided view of its parameter (GroupedMLP's transposed experts) as
    model-space boxes, views of the state tensors (not Megatron's N-D flattened layout, which a transposed view
    cannot take: Megatron's GroupedMLP optimizer states do not load into other expert layouts either)."""
    prefix_len = len(STATE_PREFIX) + 1
    for box_index, shard in enumerate(_strided_shards(piece, box, own_start, own_stop, tensors, replica_id).values()):
        name = shard.key[prefix_len:len(shard.key) - len(piece.key) - 1]
        result.setdefault(name, {})[f"{index}_{box_index}"] = shard


def param_state_shards(model_param: torch.Tensor, own_start: int, own_stop: int, tensors: Dict[str, torch.Tensor],
                       param_map: Dict[int, Any], sharded_over_dp: bool,
                       instance_id: int = 0) -> Dict[str, Any]:
    """{state name: ShardedTensor, or {piece index: ShardedTensor} for a factory-built param} of one param.

    `tensors` hold the range [own_start, own_stop) of the flattened `model_param`. With `sharded_over_dp`
    (distributed optimizer) each piece becomes a `flattened_range` shard of the model piece (stored N-D
    flattened; every DP rank writes the part it owns); otherwise the range is the whole param and each piece
    keeps the model layout. Empty when the model state dict has no entry for the param. `instance_id` is this
    rank's distributed-optimizer instance (see `_optimizer_replica_id`).
    """
    sharded = param_map.get(id(model_param))
    if sharded is None:
        return {}
    result: Dict[str, Any] = {}
    pieces = _pieces(sharded, model_param)
    for index, (piece, piece_start) in enumerate(pieces):
        replica_id = _optimizer_replica_id(piece.replica_id, sharded_over_dp, instance_id)
        if isinstance(piece_start, _StridedBox):
            _add_strided_piece(result, index, piece, piece_start, own_start, own_stop, tensors, replica_id)
            continue
        lo, hi = max(own_start, piece_start), min(own_stop, piece_start + piece.data.numel())
        if lo >= hi:
            continue
        for name, tensor in tensors.items():
            key = f"{STATE_PREFIX}.{name}.{piece.key}"
            flat = tensor.view(-1)[lo - own_start:hi - own_start]
            if sharded_over_dp:
                shard = ShardedTensor(key, flat, tensor.dtype, tuple(piece.local_shape), tuple(piece.global_shape),
                                      tuple(piece.global_offset), piece.axis_fragmentations, replica_id,
                                      piece.prepend_axis_num, piece.allow_shape_mismatch,
                                      flattened_range=slice(lo - piece_start, hi - piece_start))
            else:
                # [numel of the piece] -> [*local_shape]
                shard = ShardedTensor(key, flat.view(piece.local_shape), tensor.dtype, tuple(piece.local_shape),
                                      tuple(piece.global_shape), tuple(piece.global_offset), piece.axis_fragmentations,
                                      replica_id, piece.prepend_axis_num, piece.allow_shape_mismatch)
            if len(pieces) == 1:
                result[name] = shard
            else:
                result.setdefault(name, {})[index] = shard
    return result


def model_space_state_shards(entries: Iterable[Tuple[torch.Tensor, int, int, Dict[str, torch.Tensor]]],
                             param_map: Dict[int, Any], sharded_over_dp: bool) -> Dict[str, ShardedTensor]:
    """Every ShardedTensor of `param_state_shards` for many params, in one flat dict.

    entries: (model param, owned flat start, owned flat stop, {state name: tensor of the owned range}).
    """
    result: Dict[str, ShardedTensor] = {}
    for model_param, own_start, own_stop, tensors in entries:
        shards = param_state_shards(model_param, own_start, own_stop, tensors, param_map, sharded_over_dp)
        for shard in nested_values(shards):
            start = shard.flattened_range.start if shard.flattened_range is not None else 0
            result[f"{shard.key}@{'_'.join(map(str, shard.global_offset))}+{start}"] = shard
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


def state_tensors(optimizer: torch.optim.Optimizer, main_param: torch.Tensor,
                  with_main_param: bool = True) -> Dict[str, torch.Tensor]:
    """{'fp32_param': main param (when `with_main_param`), <every param-shaped state tensor>: tensor} of one
    main param.

    An optimizer that steps its own copy of the param (the hybrid CPU-offload optimizer) names it
    `master_param` in the state; that copy is the fp32 param."""
    state = optimizer.state.get(main_param, {})
    tensors = {"fp32_param": state.get("master_param", main_param).detach()} if with_main_param else {}
    for name, value in state.items():
        if torch.is_tensor(value) and value.shape == main_param.shape and name not in ("step", "master_param"):
            tensors[name] = value
    return tensors


def common_step(optimizer: torch.optim.Optimizer) -> Any:
    """The `step` every param's state holds (Megatron's `common_step`), or None when there is none."""
    step = None
    for param_state in optimizer.state.values():
        value = param_state.get("step")
        if value is None:
            continue
        if step is None:
            step = value
        elif float(value) != float(step):
            raise ValueError(f"the optimizer step differs between params ({float(step)} vs {float(value)}): a "
                             f"checkpoint stores one step shared by all params")
    return copy.deepcopy(step)


def torch_optimizer_sharded_state(optimizer: torch.optim.Optimizer, model_param_of, param_map: Dict[int, Any],
                                  exclude_state: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """Megatron's sharded form of `optimizer.state_dict()`: {"state": {index: {name: shard}, "common_step": step},
    "param_groups": [hyper-parameters]} with every param-shaped state tensor in the layout of the model param
    `model_param_of(param)`; `step` and the names in `exclude_state` are left out of the per-param state."""
    inner = optimizer.state_dict()
    params = [param for group in optimizer.param_groups for param in group["params"]]
    state: Dict[Any, Any] = {}
    for index, param_state in inner["state"].items():
        main = params[index]
        tensors = {name: value for name, value in optimizer.state[main].items()
                   if name != "step" and name not in exclude_state and torch.is_tensor(value)
                   and value.shape == main.shape}
        model = model_param_of(main)
        shards = param_state_shards(model, 0, model.numel(), tensors, param_map, False)
        if shards:
            state[index] = shards
    step = common_step(optimizer)
    if step is not None:
        state["common_step"] = step
    return {"state": state, "param_groups": megatron_param_groups(inner["param_groups"])}


def mark_for_loading(state: Dict[str, Any]) -> Dict[str, Any]:
    """Add the request-only marker `load_state_dict` recognises a distributed load by."""
    state[SHARDED_LOAD_KEY] = LocalNonpersistentObject(True)
    return state


def is_sharded_load(state_dict: Any) -> bool:
    """True for a state dict produced by a distributed load of this framework's sharded state (tensors in place),
    or stored in this framework's older layout (which `SHARDING_TYPE_KEY` marks for every optimizer)."""
    return isinstance(state_dict, dict) and (SHARDED_LOAD_KEY in state_dict or SHARDING_TYPE_KEY in state_dict)


def _has_hyper_parameters(groups: Any) -> bool:
    return isinstance(groups, list) and bool(groups) and all(
        isinstance(g, dict) and any(k != "params" for k in g) for g in groups)


def sharded_common_groups_and_step(state_dict: Dict[str, Any]) -> Tuple[List[Dict], Any]:
    """(param groups, common step or None) from the common part of any optimizer's checkpoint (see the table in
    the module docstring; the distributed optimizer's groups carry `step` themselves)."""
    inner = state_dict.get("optimizer") if isinstance(state_dict.get("optimizer"), dict) else {}
    for holder in (state_dict, inner):
        groups = holder.get("param_groups")
        if _has_hyper_parameters(groups):
            step_holder = holder.get("state") if isinstance(holder.get("state"), dict) else {}
            return groups, step_holder.get("common_step")
    raise ValueError("the checkpoint's optimizer state has no param_groups (it was not written by a Megatron "
                     "optimizer): pass --no-load-optim to load the weights only")


def load_sharded_common(optimizer: Optional[torch.optim.Optimizer], state_dict: Dict[str, Any]) -> None:
    """After a distributed load (tensors filled in place): hyper-parameters and Adam's step of every group."""
    if optimizer is None:
        return
    groups, step = sharded_common_groups_and_step(state_dict)
    load_param_groups(optimizer, groups)
    if step is None:
        return
    for param_state in optimizer.state.values():
        if "step" in param_state:
            old = param_state["step"]
            param_state["step"] = torch.full_like(old, float(step)) if torch.is_tensor(old) else step


def _group_step(optimizer: torch.optim.Optimizer, group: Dict) -> Optional[float]:
    for param in group["params"]:
        step = optimizer.state.get(param, {}).get("step")
        if step is not None:
            return float(step.item()) if torch.is_tensor(step) else step
    return None


def param_groups_without_params(optimizer: Optional[torch.optim.Optimizer]) -> List[Dict]:
    """Hyper-parameters of every group (no params, no implementation flags) plus its Adam `step`."""
    if optimizer is None:
        return []
    groups = []
    for group in optimizer.param_groups:
        saved = {k: copy.deepcopy(v) for k, v in group.items() if k not in _IMPLEMENTATION_KEYS}
        saved.update(MEGATRON_KERNEL_FLAGS)
        saved["capturable"] = group.get("capturable", False)
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
    "SHARDING_TYPE", "SHARDING_TYPE_KEY", "DP_ZERO_SHARDING_TYPE", "SHARDED_LOAD_KEY", "flat_range_to_boxes",
    "param_to_sharded_map", "param_state_shards", "model_space_state_shards", "ensure_state", "state_tensors",
    "common_step", "torch_optimizer_sharded_state", "mark_for_loading", "is_sharded_load",
    "sharded_common_groups_and_step", "load_sharded_common", "param_groups_without_params", "load_param_groups",
    "megatron_param_groups", "MEGATRON_KERNEL_FLAGS",
]
