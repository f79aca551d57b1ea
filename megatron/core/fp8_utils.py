"""FP8 helpers Megatron Core code imports from `megatron.core.fp8_utils`, for this project's native FP8.

Native FP8 (`megatron/core/fp8/`) quantizes the transformer layers' GEMM operands on the fly and has no
`fp8_autocast` region: the optimisation plan switches the transformer layers' linears to FP8 once the model is
built (`optimization_plan.apply`). With `--fp8-param-gather` the FP8 linears' weights are held only as FP8
bytes once the distributed optimizer holds their fp32 masters (`megatron.core.fp8.params`: plain parameters whose
values are read with `weight_values`), gathered by the distributed optimizer itself
(`megatron.core.distributed.fp8_param_gather`), not through TE's FP8 tensor class. So:
- `is_float8tensor` / `is_mxfp8tensor` are True only for Transformer Engine's quantized tensors, which exist
  only when TE has been imported (TE is never imported here);
- `get_fp8_context` returns a no-op context for the native layers (their FP8 is already on), after checking
  the config with the native path's rules (`megatron.core.fp8.recipe.fp8_config_problems`);
- the FP8-parameter helpers (`quantize_param_shard`, `post_all_gather_processing`, `correct_amax_history_if_needed`)
  have nothing to do for bf16/fp16 parameters and hand TE tensors to TE.
"""
import sys
from contextlib import nullcontext
from typing import List, Optional

import torch

from megatron.core.enums import Fp8Recipe
from megatron.core.extensions.transformer_engine import (
    TEColumnParallelLinear,
    TELayerNormColumnParallelLinear,
    TERowParallelLinear,
)
from megatron.core.fp8.recipe import Fp8Recipe as NativeFp8Recipe
from megatron.core.fp8.recipe import fp8_config_problems
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.utils import is_te_min_version, module_available

HAVE_TE = module_available("transformer_engine")
"""Transformer Engine is installed (found without importing it)."""

HAVE_TE_FP8_TENSOR_CLASS = HAVE_TE
"""TE's FP8 tensor classes can exist (they are looked up in the loaded TE when a tensor is checked)."""


def _loaded_te_class(module_name: str, class_name: str) -> Optional[type]:
    """A class of an already imported TE module, or None (never imports TE)."""
    module = sys.modules.get(module_name)
    return getattr(module, class_name, None) if module is not None else None


def _te_fp8_tensor_classes() -> tuple:
    classes = (
        _loaded_te_class("transformer_engine.pytorch.tensor", "QuantizedTensor"),  # TE 2.x: every quantized tensor
        _loaded_te_class("transformer_engine.pytorch.float8_tensor", "Float8Tensor"),  # TE 1.x
    )
    return tuple(cls for cls in classes if cls is not None)


def is_float8tensor(tensor: torch.Tensor) -> bool:
    """True for Transformer Engine's FP8 (quantized) tensors; plain tensors, native FP8 included, are not."""
    classes = _te_fp8_tensor_classes()
    return bool(classes) and isinstance(tensor, classes)


def is_mxfp8tensor(tensor: torch.Tensor) -> bool:
    """True for Transformer Engine's MXFP8 tensors."""
    cls = _loaded_te_class("transformer_engine.pytorch.tensor.mxfp8_tensor", "MXFP8Tensor")
    return cls is not None and isinstance(tensor, cls)


def dequantize_fp8_tensor(fp8_tensor: torch.Tensor) -> torch.Tensor:
    """The high-precision values of a Transformer Engine FP8 tensor (TE 2.x `dequantize`, TE 1.x `from_float8`)."""
    if not is_float8tensor(fp8_tensor):
        raise ValueError(f"dequantize_fp8_tensor: a {type(fp8_tensor).__name__} is not a Transformer Engine FP8 "
                         "tensor (native FP8 keeps no FP8 tensors outside its GEMMs).")
    if is_te_min_version("2.0"):
        return fp8_tensor.dequantize()
    return fp8_tensor.from_float8()


def get_fp8_align_size(fp8_recipe: Fp8Recipe) -> int:
    """Multiple that FP8 GEMM dimensions must be padded to: 32 for MXFP8, 16 for per-tensor recipes."""
    return 32 if fp8_recipe == Fp8Recipe.mxfp8 else 16


def is_column_parallel_linear(module: torch.nn.Module) -> bool:
    """True for column-parallel linears: native (with or without a fused norm) and TE wrappers."""
    return isinstance(module, (ColumnParallelLinear, TEColumnParallelLinear, TELayerNormColumnParallelLinear))


def is_row_parallel_linear(module: torch.nn.Module) -> bool:
    """True for row-parallel linears: native and TE wrappers."""
    return isinstance(module, (RowParallelLinear, TERowParallelLinear))


def modify_underlying_storage(tensor: torch.Tensor, new_raw_data: torch.Tensor) -> None:
    """Replace the raw FP8 bytes of a Transformer Engine FP8 tensor (the distributed optimizer's gathered
    parameter buffer for FP8 parameters)."""
    if not is_float8tensor(tensor):
        raise ValueError("modify_underlying_storage: only Transformer Engine FP8 tensors have a separate raw "
                         f"storage; got a {type(tensor).__name__}.")
    from transformer_engine.pytorch.tensor.utils import replace_raw_data  # TE is loaded: `tensor` is one of its own

    replace_raw_data(tensor, new_raw_data)


def _refuse_te_fp8_params(caller: str, params: List[torch.Tensor]) -> None:
    if any(is_float8tensor(param) for param in params):
        raise ValueError(f"{caller}: Transformer Engine FP8 parameters (--fp8-param-gather) are not supported; keep "
                         "the parameters in bf16 (the GEMMs still run in FP8).")


def quantize_param_shard(model_params: List[torch.Tensor], main_params: List[torch.Tensor],
                         start_offsets: List[int], data_parallel_group, fsdp_shard_model_params=None) -> None:
    """Cast fp32 main-parameter shards into FP8 model parameters (`--fp8-param-gather`).

    Native FP8 parameters are quantized by the distributed optimizer's own FP8 gather
    (`megatron.core.distributed.fp8_param_gather`), so there is nothing to do here. Transformer Engine's FP8
    parameters are not driven by this path: a ValueError says so.
    """
    _refuse_te_fp8_params("quantize_param_shard", model_params)


def post_all_gather_processing(model_params: List[torch.Tensor]) -> None:
    """After the distributed optimizer gathers parameters: nothing to refresh for bf16/fp16 parameters
    (Transformer Engine's FP8 parameters would rebuild their transposes here; they are refused)."""
    _refuse_te_fp8_params("post_all_gather_processing", model_params)


def correct_amax_history_if_needed(model: List[torch.nn.Module]) -> None:
    """Transformer Engine 1.x needed its amax histories fixed after FP8 parameters were updated outside TE.

    Native delayed scaling records each amax as the GEMM quantizes it, so its histories never need this;
    the call does nothing (as it does in Megatron with TE 2.x).
    """
    return None


def is_first_last_bf16_layer(config, layer_no: int) -> bool:
    """Whether global layer `layer_no` (0-based, over all pipeline stages) stays in bf16 under
    `first_last_layers_bf16`: one of the first `num_layers_at_start_in_bf16` or the last
    `num_layers_at_end_in_bf16` layers (`Fp8Recipe.is_bf16_layer`, what the optimisation plan applies). A
    negative `layer_no` (no particular layer) is never a bf16 layer."""
    if not getattr(config, "first_last_layers_bf16", False):
        return False
    return NativeFp8Recipe(fp8_format="e4m3", num_layers_at_start_in_bf16=config.num_layers_at_start_in_bf16,
                           num_layers_at_end_in_bf16=config.num_layers_at_end_in_bf16,
                           num_layers=config.num_layers).is_bf16_layer(layer_no)


def get_fp8_context(config, layer_no: int = -1, is_init: bool = False):
    """The FP8 context to run (or, with `is_init`, to build) global layer `layer_no` in; -1 means all layers.

    Megatron returns Transformer Engine's `fp8_autocast` (or `fp8_model_init`) and `nullcontext()` when FP8
    is off or the layer is kept in bf16. The native layers are switched to FP8 by the optimisation plan, so the
    context itself is `nullcontext()`: code written as `with get_fp8_context(config, i): layer(...)` runs
    the same layers with the same FP8 GEMMs. What the native path cannot run (FP8 parameters, block-scaled
    recipes, ...; `megatron.core.fp8.recipe.fp8_config_problems`, the rules the plan
    checks) raises one ValueError listing every problem, as resolving the plan would.
    """
    if getattr(config, "fp8", None) is None:
        return nullcontext()
    problems = fp8_config_problems(config)
    if problems:
        raise ValueError("get_fp8_context: " + " ".join(problems))
    return nullcontext()


__all__ = [
    "HAVE_TE",
    "HAVE_TE_FP8_TENSOR_CLASS",
    "is_float8tensor",
    "is_mxfp8tensor",
    "dequantize_fp8_tensor",
    "get_fp8_align_size",
    "is_column_parallel_linear",
    "is_row_parallel_linear",
    "modify_underlying_storage",
    "quantize_param_shard",
    "post_all_gather_processing",
    "correct_amax_history_if_needed",
    "is_first_last_bf16_layer",
    "get_fp8_context",
]
