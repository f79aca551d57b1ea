"""`torch.compile` of whole transformer layers, applied as a wrapper (the layer code does not change).

Compiling a layer lets the compiler fuse what sits between the matmuls (norms, bias adds, RoPE, the
activation, residual adds) into a few kernels, forward and backward. Compilation happens on the first
forward pass; its time shows up in the first logged iterations only, which the benchmark excludes from
steady-state numbers.

Whether layers are compiled is the `--compile-layers` decision of the optimisation plan
(`megatron.core.optimization_plan`, where the `auto` rule and its measurements live); this module only
does it. The tensor-parallel linears inside a compiled layer run eagerly (the layer's graph is split at
each of them) unless the plan traces them too (`--compile-linears`, a linear's `trace_when_compiled`).

Traced all-gathers and reduce-scatters of sequence-parallel layers go through torch's functional
collectives: traced as in-place `torch.distributed` calls into a fresh buffer, every layer parameter got
a zero gradient on the GPUs (2026-11-30, `benchmarks/gpu/sp_compile_check.py`).
"""
from typing import Optional

import torch

# One compiled graph is shared by all layers of a model; allow enough re-specialisations for a model
# whose layers differ (first/last layer, different shapes per pipeline stage).
_MIN_CACHE_SIZE = 64


class LayerCompileError(RuntimeError):
    """`torch.compile` of a transformer layer failed; the message names the layer and the flag that turns
    layer compilation off."""


def compile_forward(module: torch.nn.Module, backend: str = "inductor", name: Optional[str] = None) -> torch.nn.Module:
    """Replace `module.forward` by a compiled version of itself (parameters and state dict unchanged).

    A compiler failure (at the first call or at a recompilation) raises `LayerCompileError` naming `name`
    (default: the module's type and `layer_number`) and `--compile-layers off`; the layer never falls back to
    running eagerly behind the user's back.
    """
    dynamo_config = torch._dynamo.config
    for option in ("cache_size_limit", "recompile_limit"):
        if hasattr(dynamo_config, option):
            setattr(dynamo_config, option, max(getattr(dynamo_config, option), _MIN_CACHE_SIZE))
    if name is None:
        number = getattr(module, "layer_number", None)
        name = type(module).__name__ + ("" if number is None else f" {number}")
    compiled_forward = torch.compile(module.forward, backend=backend)

    def forward(*args, **kwargs):
        try:
            return compiled_forward(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as error:
            raise LayerCompileError(
                f"torch.compile of {name} failed (turn layer compilation off with --compile-layers off, "
                f"compile_layers='off', to run the layers eagerly): {type(error).__name__}: {error}") from error

    module.forward = forward
    module.is_compiled = True
    return module


__all__ = ["compile_forward", "LayerCompileError"]
