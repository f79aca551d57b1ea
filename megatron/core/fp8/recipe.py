"""FP8 recipes (`--fp8-format`, `--fp8-recipe`, ...), the rules a config's FP8 fields must satisfy, and the
per-linear scaling state.

This package is pure math below the tensor-parallel layers: it imports nothing of megatron but
`megatron.core.utils`. Communication it needs (the amax reduction over the ranks that hold shards of an
operand) is handed in as a function by the layer that owns the process group.
"""
import contextlib
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from megatron.core.fp8 import kernels

FORMATS = ("e4m3", "hybrid")
RECIPES = ("delayed", "tensorwise")
AMAX_ALGOS = ("most_recent", "max")


@dataclass(frozen=True)
class Fp8Recipe:
    """How the transformer layers' linears run their GEMMs in FP8."""

    fp8_format: str
    """'e4m3': E4M3 everywhere; 'hybrid': E4M3 for inputs and weights, E5M2 for output gradients."""

    recipe: str = "delayed"
    """'delayed': scale from the amax history of earlier steps (one pass over each tensor);
    'tensorwise': scale from the tensor's own amax (a second pass, exact under recomputation)."""

    margin: int = 0
    """Scale down by 2**margin beyond what the amax needs (headroom for growth)."""

    amax_history_len: int = 1
    """Delayed scaling: how many past amax values each tensor keeps."""

    amax_compute_algo: str = "most_recent"
    """Delayed scaling: scale from the most recent amax or the maximum of the history."""

    wgrad: bool = True
    """Weight-gradient GEMM in FP8 too (else in the input's precision)."""

    num_layers_at_start_in_bf16: int = 0
    """`--first-last-layers-bf16`: how many of the model's first transformer layers keep bf16 GEMMs (0 without it)."""

    num_layers_at_end_in_bf16: int = 0
    """`--first-last-layers-bf16`: how many of the model's last transformer layers keep bf16 GEMMs (0 without it)."""

    num_layers: int = 0
    """The model's number of transformer layers (all pipeline stages): where the last layers start."""

    fp8_param: bool = False
    """`--fp8-param-gather`: the FP8 layers' weights are FP8 parameters (`fp8.params`): the distributed
    optimizer all-gathers them as FP8 bytes, which the forward uses as they are and which are the weights'
    only copy in the model."""

    def is_bf16_layer(self, layer_no: int) -> bool:
        """Whether global layer `layer_no` (0-based, counted over all pipeline stages, as Megatron's
        `is_first_last_bf16_layer` does) keeps its GEMMs in bf16; a negative `layer_no` (no particular
        layer) never does."""
        if layer_no < 0:
            return False
        at_end = self.num_layers_at_end_in_bf16 > 0 and layer_no >= self.num_layers - self.num_layers_at_end_in_bf16
        return layer_no < self.num_layers_at_start_in_bf16 or at_end

    @property
    def forward_dtype(self) -> torch.dtype:
        return kernels.E4M3

    @property
    def backward_dtype(self) -> torch.dtype:
        return kernels.E5M2 if self.fp8_format == "hybrid" else kernels.E4M3

    @classmethod
    def from_config(cls, config) -> Optional["Fp8Recipe"]:
        """The recipe a TransformerConfig asks for (None without `fp8`)."""
        if getattr(config, "fp8", None) is None:
            return None
        edges = bool(getattr(config, "first_last_layers_bf16", False))
        return cls(fp8_format=config.fp8, recipe=config.fp8_recipe or "delayed", margin=config.fp8_margin,
                   amax_history_len=config.fp8_amax_history_len, amax_compute_algo=config.fp8_amax_compute_algo,
                   wgrad=config.fp8_wgrad,
                   num_layers_at_start_in_bf16=config.num_layers_at_start_in_bf16 if edges else 0,
                   num_layers_at_end_in_bf16=config.num_layers_at_end_in_bf16 if edges else 0,
                   num_layers=config.num_layers if edges else 0, fp8_param=bool(getattr(config, "fp8_param", False)))


def _bf16_edge_problems(config) -> List[str]:
    """Megatron's rules for `--first-last-layers-bf16` (TransformerConfig): not with delayed scaling, and each
    count between 0 and the layers of one pipeline stage."""
    if not getattr(config, "first_last_layers_bf16", False):
        return []
    problems = []
    if (config.fp8_recipe or "delayed") == "delayed":
        problems.append("--first-last-layers-bf16 with --fp8-recipe delayed: delayed scaling does not support the "
                        "first / last layers in bf16 (as in Megatron); add --fp8-recipe tensorwise.")
    per_stage = config.num_layers // max(1, getattr(config, "pipeline_model_parallel_size", 1))
    for flag, field in (("--num-layers-at-start-in-bf16", "num_layers_at_start_in_bf16"),
                        ("--num-layers-at-end-in-bf16", "num_layers_at_end_in_bf16")):
        value = getattr(config, field)
        if value < 0 or value > per_stage:
            problems.append(f"{flag} ({field} ({value})) must be between 0 and the number of layers per pipeline "
                            f"stage ({per_stage}); pick a count in that range.")
    return problems


def fp8_config_problems(config, te_modules: Sequence[str] = ()) -> List[str]:
    """Every FP8 rule, checked in this one place (by `optimization_plan.resolve.resolve_plan`): what in a
    config's FP8 fields the native FP8 path cannot run, each problem naming the flag, the value and the fix.
    `te_modules`: names of Transformer Engine module types in the model (their own FP8 is not wired here)."""
    if getattr(config, "fp8", None) is None:
        return []
    problems = []
    if config.fp8 not in FORMATS:
        problems.append(f"--fp8-format (fp8={config.fp8!r}) is not an FP8 format: use e4m3 or hybrid.")
    if (config.fp8_recipe or "delayed") not in RECIPES:
        problems.append(f"--fp8-recipe (fp8_recipe={config.fp8_recipe!r}) is not implemented natively (it needs "
                        "Blackwell-class block scaling): use delayed or tensorwise.")
    if config.fp8_amax_history_len < 1:
        problems.append(f"--fp8-amax-history-len (fp8_amax_history_len ({config.fp8_amax_history_len})) must be "
                        "at least 1.")
    if config.fp8_amax_compute_algo not in AMAX_ALGOS:
        problems.append(f"--fp8-amax-compute-algo (fp8_amax_compute_algo={config.fp8_amax_compute_algo!r}): use "
                        "most_recent or max.")
    if config.fp8_margin < 0:
        problems.append(f"--fp8-margin (fp8_margin ({config.fp8_margin})) must be >= 0.")
    for field, what in (("fp8_dot_product_attention", "FP8 attention"),
                        ("fp8_multi_head_attention", "FP8 attention projections outside the linears")):
        if getattr(config, field, False):
            problems.append(f"{field}: {what} is not implemented natively; set it False (the linears' GEMMs "
                            "still run in FP8).")
    problems.extend(_bf16_edge_problems(config))
    if te_modules:
        problems.append(f"--fp8-format {config.fp8} with Transformer Engine's modules ({', '.join(te_modules)}): "
                        "their FP8 (fp8_autocast) is not wired here; add --transformer-impl local for the native "
                        "FP8 GEMMs.")
    return problems


class TensorScaling:
    """The scale of one operand (input, weight or output gradient) of one linear.

    `amax_reduce(amax) -> amax`: for an operand split over several ranks (a tensor-parallel weight, a
    column-parallel output gradient, a row-parallel input), the maximum over those ranks (one tiny
    all-reduce, supplied by the layer), so that every shard is quantized with the scale the whole tensor
    gets in a single-process run, as Transformer Engine's amax reduction does. None: the operand is whole.
    """

    def __init__(self, recipe: Fp8Recipe, dtype: torch.dtype,
                 amax_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        self.recipe = recipe
        self.dtype = dtype
        self.amax_reduce = amax_reduce
        self.amax_history: Optional[torch.Tensor] = None

    def _reduced(self, amax_: torch.Tensor) -> torch.Tensor:
        return amax_ if self.amax_reduce is None else self.amax_reduce(amax_)

    def quantize(self, tensor: torch.Tensor, transpose: bool, record: bool = True):
        """(q, q^T or None, scale_inv) of a 2-D tensor under this operand's recipe.

        Delayed scaling quantizes with the amax of earlier calls and then records this tensor's amax, in
        the same pass on GPU. Its first call (a new model, or one just loaded from a checkpoint, whose
        history is not saved) has no earlier amax: it scales by the tensor's own amax, where Transformer
        Engine uses scale 1 (which flushes small gradients to zero on that step). `record=False` (forwards
        without autograd: evaluation, the first pass of activation recompute) uses the history without
        adding to it, so the recomputed forward quantizes exactly as the original one. A non-finite amax
        (an overflowing step) is not recorded: the entry repeats the amax that was used.
        """
        recipe = self.recipe
        history = self.amax_history
        if recipe.recipe == "tensorwise" or history is None or history.device != tensor.device:
            current = self._reduced(kernels.amax(tensor))
            if recipe.recipe == "delayed":
                self.amax_history = torch.zeros(recipe.amax_history_len, dtype=torch.float32, device=tensor.device)
                self.amax_history[:1].copy_(torch.where(torch.isfinite(current), current, 0.0))
            return kernels.quantize(tensor, current, self.dtype, recipe.margin, transpose)
        return kernels.quantize_delayed(tensor, history, recipe.amax_compute_algo == "max", self.dtype, recipe.margin,
                                        transpose, record, self.amax_reduce)


class Fp8LinearState:
    """The FP8 recipe of one linear layer and the scaling state of its three GEMM operands.

    `sharded`: which operands ('input', 'weight', 'grad_output') are split over the layer's tensor-parallel
    group; their amax goes through `amax_reduce` (see `TensorScaling`)."""

    def __init__(self, recipe: Fp8Recipe, sharded: Tuple[str, ...] = (),
                 amax_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        unknown = set(sharded) - {"input", "weight", "grad_output"}
        if unknown:
            raise ValueError(f"Fp8LinearState: unknown operands {sorted(unknown)} in sharded={sharded!r}")

        def reduce_for(name):
            return amax_reduce if name in sharded else None

        self.recipe = recipe
        self.input = TensorScaling(recipe, recipe.forward_dtype, reduce_for("input"))
        self.weight = TensorScaling(recipe, recipe.forward_dtype, reduce_for("weight"))
        self.grad_output = TensorScaling(recipe, recipe.backward_dtype, reduce_for("grad_output"))

    def __repr__(self):
        return f"Fp8LinearState({self.recipe.fp8_format}, {self.recipe.recipe})"


@contextlib.contextmanager
def fp8_scaling_state_kept(module: torch.nn.Module):
    """Run the block and put every FP8 amax history inside `module` back as it was (in place: captured
    CUDA graphs keep pointing at the same tensors). For passes that are not training steps, such as the
    warm-up before a CUDA-graph capture, whose zero output gradient would otherwise enter the history."""
    scalings = [scaling for sub in module.modules() if isinstance(getattr(sub, "fp8", None), Fp8LinearState)
                for scaling in (sub.fp8.input, sub.fp8.weight, sub.fp8.grad_output)]
    saved = [None if s.amax_history is None else s.amax_history.clone() for s in scalings]
    try:
        yield
    finally:
        for scaling, history in zip(scalings, saved):
            if history is not None:
                scaling.amax_history.copy_(history)
            else:
                scaling.amax_history = None
