"""`torch.compile` of whole transformer layers, applied as a wrapper (the layer code does not change).

Compiling a layer lets the compiler fuse what sits between the matmuls (norms, bias adds, RoPE, the
activation, residual adds) into a few kernels, forward and backward. The tensor-parallel linears are
custom autograd functions that the compiler traces as they are (their weight-gradient accumulation
into `main_grad` included), so the numbers do not change beyond rounding.

Switch: the environment variable `MEGATRON_COMPILE_LAYERS` = `1` (always), `0` (never) or `auto`
(default: on when the layer's parameters live on a CUDA device and the hidden size is at least 2048,
where the measured win recorded in docs/performance.md holds; never on CPU). Compilation happens on the
first forward pass; its time shows up in the first logged iterations only, which the benchmark excludes
from steady-state numbers.

The tensor-parallel linears inside a compiled layer run eagerly by default (the layer's graph is split
at each of them; `tensor_parallel.layers.trace_linears_when_compiling` says why and how to trace them).

Not by default: layers with tensor and sequence parallelism. With eagerly called linears their graph
splits into many pieces around the NCCL calls, and on two H200s (2026-11-30) GPT-1.3B at TP=2+SP ran at
290 TFLOP/s/GPU compiled against 386-402 with eager layers. (Their traced all-gathers and
reduce-scatters go through torch's functional collectives: traced as in-place `torch.distributed` calls
into a fresh buffer, every layer parameter got a zero gradient on the GPUs, found the same day and fixed;
`benchmarks/gpu/sp_compile_check.py`.) `MEGATRON_COMPILE_LAYERS=1` forces compilation.
"""
import logging
import os

import torch

logger = logging.getLogger(__name__)

# Default of `auto` on CUDA: on an H200, GPT-1.3B (hidden 2048) through pretrain_gpt.py ran at 482 TFLOP/s/GPU
# with compiled layers and 469 without (+2.9%; about 10 s more compile time), while a 12-layer model of hidden
# 1024 (seq 1024, micro-batch 8) ran at 160 compiled and 183 eager (-13%: its layers are too small for the
# compiled layers' per-call host work to pay), docs/performance.md. Hence: compile from this hidden size up.
COMPILE_LAYERS_ON_CUDA_BY_DEFAULT = True
MIN_HIDDEN_SIZE_TO_COMPILE_BY_DEFAULT = 2048
# One compiled graph is shared by all layers of a model; allow enough re-specialisations for a model
# whose layers differ (first/last layer, different shapes per pipeline stage).
_MIN_CACHE_SIZE = 64


def layer_compile_requested(module: torch.nn.Module) -> bool:
    """Whether the layers of this block should be compiled (see the module docstring)."""
    mode = os.environ.get("MEGATRON_COMPILE_LAYERS", "auto").strip().lower()
    if mode in ("1", "true", "on"):
        return True
    if mode in ("0", "false", "off"):
        return False
    if mode != "auto":
        raise ValueError(f"MEGATRON_COMPILE_LAYERS ({mode!r}) must be 1, 0 or auto.")
    params = list(module.parameters())
    config = getattr(module, "config", None)
    large = config is None or config.hidden_size >= MIN_HIDDEN_SIZE_TO_COMPILE_BY_DEFAULT
    split_graphs = getattr(config, "tensor_model_parallel_size", 1) > 1 and getattr(config, "sequence_parallel", False)
    return COMPILE_LAYERS_ON_CUDA_BY_DEFAULT and large and not split_graphs and bool(params) and params[0].is_cuda


def compile_forward(module: torch.nn.Module, backend: str = "inductor") -> torch.nn.Module:
    """Replace `module.forward` by a compiled version of itself (parameters and state dict unchanged)."""
    dynamo_config = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), _MIN_CACHE_SIZE))
    eager_forward = module.forward
    compiled_forward = torch.compile(eager_forward, backend=backend)
    state = {"proven": False}

    def forward(*args, **kwargs):
        if state["proven"]:
            return compiled_forward(*args, **kwargs)
        try:
            output = compiled_forward(*args, **kwargs)
        except Exception as error:  # a compiler failure: the eager layer computes the same result
            logger.warning("torch.compile of %s failed (%s); running it eagerly.", type(module).__name__, error)
            module.forward = eager_forward
            module.is_compiled = False
            return eager_forward(*args, **kwargs)
        state["proven"] = True
        return output

    module.forward = forward
    module.is_compiled = True
    return module


__all__ = ["layer_compile_requested", "compile_forward", "COMPILE_LAYERS_ON_CUDA_BY_DEFAULT",
           "MIN_HIDDEN_SIZE_TO_COMPILE_BY_DEFAULT"]
