"""Apply the optimisation plan to built model chunks: one function, one small step per decision.

`apply_optimization_plan(model_chunks, plan)` runs, in this order (the order the wrappers nest in):
1. the fused kernels' mode (`fusions/_compile.py`; process-wide, the fused functions are module-level);
2. the `--tp-comm-overlap` pipelines and their transport on every tensor-parallel linear;
3. per transformer block: FP8 GEMMs on the layers' linears, then `torch.compile` of each layer (with the
   linears traced or called eagerly), then per-layer CUDA graphs around the (compiled) layers.
Nothing here decides: every value comes from the plan (`optimization_plan.resolve`). The steps are public so
that tests and tools can apply one of them to a module that is not a whole model.

Call it on the chunks as built (or moved to their device), before the mixed-precision and data-parallel
wrappers, as `megatron.training.get_model` does; a chunk gets the plan once.
"""
import logging
from typing import Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.extensions.transformer_engine import _TransformerEngineModule
from megatron.core.fp8.recipe import Fp8Recipe
from megatron.core.fusions._compile import set_fusion_kernels
from megatron.core.optimization_plan.resolve import DeviceFacts, OptimizationPlan, format_plan, resolve_plan
from megatron.core.process_groups_config import get_tensor_model_parallel_group_if_none
from megatron.core.tensor_parallel.layers import _ParallelLinearBase
from megatron.core.transformer.cuda_graphs import enable_layer_cuda_graphs
from megatron.core.transformer.layer_compile import compile_forward
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import module_available

logger = logging.getLogger(__name__)


def transformer_blocks(model_chunks: Iterable[torch.nn.Module]) -> List[TransformerBlock]:
    """Every `TransformerBlock` inside the chunks (through any wrapper)."""
    return [module for chunk in model_chunks for module in chunk.modules() if isinstance(module, TransformerBlock)]


def _linears(module: torch.nn.Module) -> List[_ParallelLinearBase]:
    return [sub for sub in module.modules() if isinstance(sub, _ParallelLinearBase)]


def device_facts_of(model_chunks: Sequence[torch.nn.Module], tp_group=None) -> DeviceFacts:
    """The facts `resolve_plan` needs, read from built chunks and the process: where the parameters live,
    whether there is a CUDA device and its compute capability, Triton, the tensor-parallel group's backend,
    Transformer Engine modules in the layers."""
    params = [param for chunk in model_chunks for param in chunk.parameters()]
    device = params[0].device if params else torch.device("cpu")
    cuda = torch.cuda.is_available()
    # asked only where CUDA is already up: facts of a CPU model never initialise CUDA (forked test ranks)
    known = cuda and (device.type == "cuda" or torch.cuda.is_initialized())
    capability = tuple(torch.cuda.get_device_capability(torch.cuda.current_device())) if known else None
    group = get_tensor_model_parallel_group_if_none(tp_group, check_initialized=False)
    backend = dist.get_backend(group) if group is not None and dist.is_initialized() else None
    te_modules = sorted({type(module).__name__ for block in transformer_blocks(model_chunks)
                         for module in block.layers.modules() if isinstance(module, _TransformerEngineModule)})
    return DeviceFacts(device_type=device.type, cuda=cuda, compute_capability=capability,
                       triton=module_available("triton"), tp_backend=backend,
                       transformer_engine_modules=tuple(te_modules))


def apply_fp8(layers: torch.nn.Module, recipe: Optional[Fp8Recipe]) -> None:
    """FP8 GEMMs for every tensor-parallel linear inside `layers` (like Transformer Engine's fp8_autocast
    around the transformer block: the embedding and the output layer stay in bf16). In a block's layers
    (a ModuleList), a layer whose global `layer_number` the recipe keeps in bf16 (`--first-last-layers-bf16`,
    `Fp8Recipe.is_bf16_layer`) is left as it is, as Megatron's per-layer `get_fp8_context` leaves it."""
    if recipe is None:
        return
    units = list(layers) if isinstance(layers, torch.nn.ModuleList) else [layers]
    for unit in units:
        number = getattr(unit, "layer_number", None)
        if isinstance(number, int) and recipe.is_bf16_layer(number - 1):
            continue
        for linear in _linears(unit):
            linear.enable_fp8(recipe)


def apply_layer_compile(layers: Iterable[torch.nn.Module], trace_linears: bool = False,
                        backend: str = "inductor") -> None:
    """`torch.compile` each layer; its linears traced into the layer's graph (`trace_linears`) or called
    eagerly (the graph splits at each)."""
    for layer in layers:
        for linear in _linears(layer):
            linear.trace_when_compiled = trace_linears
        compile_forward(layer, backend=backend)


def apply_tp_comm_overlap(module: torch.nn.Module, all_gather: bool, reduce_scatter: bool, transport: str) -> None:
    """`--tp-comm-overlap` on every tensor-parallel linear of `module` (those without sequence parallelism have
    nothing to pipeline and keep their plain path)."""
    for linear in _linears(module):
        linear.enable_tp_comm_overlap(all_gather, reduce_scatter, transport)


def apply_cuda_graphs(layers: torch.nn.ModuleList, warmup_steps: int) -> None:
    """Per-layer CUDA graphs for the layers of one block (one shared memory pool)."""
    if len(layers) > 0:
        enable_layer_cuda_graphs(layers, warmup_steps)


def apply_optimization_plan(model_chunks: Sequence[torch.nn.Module], plan: OptimizationPlan,
                            compile_backend: str = "inductor") -> None:
    """Carry out `plan` on the built `model_chunks` (see the module docstring for the order)."""
    blocks = transformer_blocks(model_chunks)
    planned = [block for block in blocks if block.optimization_plan is not None]
    if planned:
        raise RuntimeError("apply_optimization_plan: these model chunks already have an optimisation plan applied")
    set_fusion_kernels(plan.fusion_kernels.value)
    overlap = plan.tp_comm_overlap.value
    if overlap is not None:
        for chunk in model_chunks:
            apply_tp_comm_overlap(chunk, overlap["all_gather"], overlap["reduce_scatter"], plan.tp_comm_transport.value)
    for block in blocks:
        apply_fp8(block.layers, plan.fp8_recipe)
        if plan.compile_layers.value:
            apply_layer_compile(block.layers, plan.compile_linears.value, compile_backend)
        if plan.cuda_graphs.value is not None:
            apply_cuda_graphs(block.layers, plan.cuda_graphs.value["warmup_steps"])
        block.mark_plan_applied(plan)


def apply_plan_if_missing(model: torch.nn.Module) -> bool:
    """Resolve and apply the plan of `model.config` to `model` when none of its blocks has one yet.

    This is how a model built by Megatron Core user code (no `megatron.training.get_model`) runs the same code
    as the trainer for the same config, FP8 and CUDA graphs included: `LanguageModule` calls it at its first
    forward, and the plan is logged once. A model some of whose blocks already carry a plan is left as it is.
    Returns whether a plan was applied."""
    blocks = transformer_blocks([model])
    if not blocks or any(block.optimization_plan is not None for block in blocks):
        return False
    plan = resolve_plan(model.config, device_facts_of([model]))
    logger.info("%s: no optimisation plan was applied before the first forward; applying the plan of its "
                "config\n%s", type(model).__name__, format_plan(plan))
    apply_optimization_plan([model], plan)
    return True


__all__ = ["apply_optimization_plan", "apply_plan_if_missing", "device_facts_of", "transformer_blocks", "apply_fp8", "apply_layer_compile",
           "apply_tp_comm_overlap", "apply_cuda_graphs"]
