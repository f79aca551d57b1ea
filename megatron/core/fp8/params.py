"""FP8 parameters (`--fp8-param-gather`): the FP8 copy of a weight that the FP8 GEMMs use as it is, and, once the
distributed optimizer holds the fp32 master weights, the weight's only copy in the model.

With FP8 parameters the distributed optimizer keeps fp32 master weights, quantizes each rank's shard of an
FP8 weight into FP8 bytes (one scale per weight: the amax over the shards, `distributed.fp8_param_gather`)
and all-gathers those bytes; the gathered bytes, with their scale, are the weight's primary copy for the
forward (`weight.fp8_weight_copy`), so the FP8 linear does not quantize the weight again.

Note "FP8-primary parameters": once the distributed optimizer has taken its fp32 masters, the parameter keeps no
bf16/fp32 storage of its own (`drop_high_precision_storage`): its `.data` becomes a placeholder of the same shape
and dtype backed by one NaN element (stride 0), so autograd, the gradient buffers and everything that counts
elements see the parameter as before, a reader that forgot to dequantize sees NaN rather than a plausible wrong
weight, and the model holds 1 byte per value (the transposed copy the input-gradient GEMM needs is made in the
forward and lives only until its backward). Readers of the values dequantize on demand (`weight_values`); the
module hooks of `install_fp8_primary_hooks` make `state_dict()` hold the dequantized values (checkpoints load
without FP8) and `load_state_dict` quantize what it loads.
"""
from typing import Optional

import torch

from megatron.core.fp8 import kernels


class Fp8WeightCopy:
    """FP8 values `data` (E4M3, the weight's shape) and `scale_inv` ([1] fp32) of a weight; the transposed
    copy the input-gradient GEMM needs is made on request and not kept (it would double the bytes held)."""

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor):
        self.data = data
        self.scale_inv = scale_inv

    def update(self, scale_inv: torch.Tensor) -> None:
        """After new bytes arrived in `data` (in place): take their scale, in place (captured CUDA graphs keep
        pointing at the same tensors)."""
        self.scale_inv.copy_(scale_inv)

    def transposed(self) -> torch.Tensor:
        """data^T, contiguous ([in, out] for an [out, in] weight), made now."""
        return self.data.t().contiguous()

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """data * scale_inv in `dtype`."""
        return (self.data.float() * self.scale_inv).to(dtype)

    def nbytes(self) -> int:
        """Bytes of the FP8 values and the scale."""
        return self.data.numel() * self.data.element_size() + self.scale_inv.numel() * self.scale_inv.element_size()


_ROW = 128


def quantize_shard(shard: torch.Tensor, amax_: torch.Tensor, margin: int = 0):
    """(E4M3 values of a 1-D shard, scale_inv [1]) under the scale of the whole weight's `amax_` ([1] fp32)."""
    n = shard.numel()
    # [n] -> [n / 128, 128] (the quantizer takes 2-D tensors and tiles them 64 x 128: rows of 128 fill its
    # tiles), else [1, n]
    rows = shard.reshape(-1, _ROW) if n % _ROW == 0 and n > 0 else shard.reshape(1, -1)
    q, _, scale_inv = kernels.quantize(rows, amax_, kernels.E4M3, margin)
    return q.reshape(-1), scale_inv


def quantize_into(copy: Fp8WeightCopy, values: torch.Tensor, margin: int = 0) -> None:
    """Quantize `values` (the whole weight, its own amax) into `copy`, in place."""
    flat = values.detach().reshape(-1)  # [*shape] -> [numel]
    q, scale_inv = quantize_shard(flat, kernels.amax(flat), margin)
    copy.data.view(-1).copy_(q)  # [*shape] -> [numel]
    copy.update(scale_inv)


def fp8_copy_of(weight: torch.Tensor) -> Optional[Fp8WeightCopy]:
    """The FP8 primary copy of `weight` when it has one (FP8 parameters after a parameter all-gather)."""
    return getattr(weight, "fp8_weight_copy", None)


def is_fp8_primary(param: torch.Tensor) -> bool:
    """Whether `param`'s FP8 copy is its only copy (its `.data` is a placeholder: `drop_high_precision_storage`)."""
    return bool(getattr(param, "fp8_primary", False))


def drop_high_precision_storage(param: torch.nn.Parameter, copy: Fp8WeightCopy) -> None:
    """Make `copy` the only copy of `param`: `.data` becomes a stride-0 view of one NaN element (same shape and
    dtype, so autograd and the gradient buffers see the parameter unchanged); the old storage is freed once
    nothing else refers to it."""
    one = torch.full((1,), float("nan"), dtype=param.dtype, device=param.device)
    param.data = one.expand(param.shape)  # [1] -> [*param.shape], stride 0
    param.fp8_weight_copy = copy
    param.fp8_primary_copy = copy  # kept: loading a state dict into the layer clears fp8_weight_copy
    param.fp8_primary = True


def weight_values(param: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The values of a parameter (detached) in `dtype` (default: its own): dequantized from the FP8 copy for an
    FP8-primary parameter, else the parameter itself."""
    dtype = dtype or param.dtype
    if is_fp8_primary(param):
        return param.fp8_weight_copy.dequantized(dtype)
    return param.detach().to(dtype)


def held_bytes(param: torch.Tensor) -> int:
    """Bytes `param` holds in the model: its own storage plus its FP8 copy's values and scale (the copy's values
    are a view of a gather buffer; counted here at one byte per value)."""
    own = param.detach().untyped_storage().nbytes()
    copy = fp8_copy_of(param)
    return own + (copy.nbytes() if copy is not None else 0)


def _primary_params(module: torch.nn.Module):
    return [(name, param) for name, param in module.named_parameters(recurse=False) if is_fp8_primary(param)]


def _save_dequantized(module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook: FP8-primary weights are saved as their dequantized values (what Megatron stores).
    Where the caller asked for the parameters themselves (`keep_vars=True`: the sharded state dict, whose tensors
    the optimizer maps to its state by parameter) the values name their parameter (`fp8_values_of`); a plain
    state dict's values carry no attribute (`torch.save` would pickle it, parameter and all)."""
    for name, param in _primary_params(module):
        key = prefix + name
        if key in state_dict:
            values = weight_values(param)
            if state_dict[key] is param:
                values.fp8_values_of = param
            state_dict[key] = values


def _materialize_for_load(module, state_dict, prefix, *unused) -> None:
    """load_state_dict pre-hook: give an FP8-primary weight about to be loaded real storage to load into."""
    for name, param in _primary_params(module):
        if prefix + name in state_dict:
            param.data = torch.empty(param.shape, dtype=param.dtype, device=param.device)
            param.fp8_loaded = True


def _quantize_loaded(module, incompatible_keys) -> None:
    """load_state_dict post-hook: quantize the loaded values into the FP8 copy (in place) and drop them again."""
    for _, param in _primary_params(module):
        if getattr(param, "fp8_loaded", False):
            copy = param.fp8_primary_copy
            quantize_into(copy, param.detach(), getattr(param, "fp8_param_margin", 0))
            drop_high_precision_storage(param, copy)
            param.fp8_loaded = False


def install_fp8_primary_hooks(module: torch.nn.Module) -> None:
    """Hooks on every submodule of `module` that owns an FP8-primary parameter (once each): `state_dict()` holds
    the dequantized weight, `load_state_dict` quantizes the loaded weight into the FP8 copy."""
    for sub in module.modules():
        params = _primary_params(sub)
        if not params or getattr(sub, "_fp8_primary_hooks", False):
            continue
        sub.register_state_dict_post_hook(_save_dequantized)
        sub.register_load_state_dict_pre_hook(_materialize_for_load)
        sub.register_load_state_dict_post_hook(_quantize_loaded)
        sub._fp8_primary_hooks = True


__all__ = ["Fp8WeightCopy", "quantize_shard", "quantize_into", "fp8_copy_of", "is_fp8_primary",
           "drop_high_precision_storage", "weight_values", "held_bytes", "install_fp8_primary_hooks"]
