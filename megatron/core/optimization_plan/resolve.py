"""Resolve the optimisation plan: (config, device facts) -> `OptimizationPlan`, a pure function.

Every decision about how the built model runs is a config field set from a flag (Megatron's where one
exists), resolved here once, `auto` included, with the reason. Nothing else reads these fields to decide
anything: modules are built plain and `optimization_plan.apply` carries the plan out. Problems (settings
the native path cannot run) are collected and raised once as a `PlanError`, each naming the flag.

Notes on the `auto` rules (measurements in docs/performance.md):

- Compiled layers (`--compile-layers auto`): on for layers on a CUDA device with hidden size >= 2048. On an
  H200, GPT-1.3B (hidden 2048) ran at 482 TFLOP/s/GPU compiled and 469 eager (+2.9%, ~10 s more compile
  time); a 12-layer model of hidden 1024 (seq 1024, micro-batch 8) at 160 compiled and 183 eager (-13%: its
  layers are too small for the compiled layers' per-call host work to pay). Not with tensor + sequence
  parallelism: with eagerly called linears the graph splits around every collective, and GPT-1.3B at
  TP=2+SP ran at 290 TFLOP/s/GPU compiled against 386-402 eager (2026-11-30). Not with selective
  recompute, whose recomputed parts are custom autograd functions inside the layer.
- Traced linears (`--compile-linears auto`): off. Traced, a linear returns its weight gradient to autograd
  and DDP's hook adds it into `main_grad`; exact against eager on CPU, faster for host-bound models
  without CUDA graphs (GPT-1.3B 495-500 TFLOP/s against 459-491), but 1% slower with CUDA graphs (the
  extra pass over the bf16 weight gradients), and over 200 iterations of real text its loss stayed 0.003-0.08
  above every other path's in two jobs (unexplained).
- Overlap transport (`--tp-comm-overlap-transport auto`): copy-engine peer copies on CUDA with NCCL. On an
  H200 at TP=2 two half-sequence GEMMs took 0.30 ms alone, 0.54 ms beside a 32 MB NCCL send/recv and
  0.36 ms beside a copy-engine peer copy (`benchmarks/gpu/tp_contention_bench.py`). Not detected: a TP
  group spread over hosts, which needs `p2p`.
- Fused kernels (`--fusion-kernels auto`): compiled on CUDA (`fusions/_compile.py`); CPU tensors always
  take the plain functions.
"""
import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from megatron.core.fp8.recipe import Fp8Recipe, fp8_config_problems

MIN_HIDDEN_SIZE_TO_COMPILE = 2048
"""`--compile-layers auto` compiles layers of at least this hidden size (see the module notes)."""

_MODES = {
    "compile_layers": ("--compile-layers", ("auto", "on", "off")),
    "compile_linears": ("--compile-linears", ("auto", "on", "off")),
    "fusion_kernels": ("--fusion-kernels", ("auto", "compiled", "eager")),
    "tp_comm_overlap_transport": ("--tp-comm-overlap-transport", ("auto", "copy-engine", "p2p")),
}


class PlanError(ValueError):
    """Settings the plan cannot carry out; `problems` holds one message per problem, each naming its flag."""

    def __init__(self, problems: List[str]):
        self.problems = list(problems)
        super().__init__("invalid optimisation plan:\n  " + "\n  ".join(self.problems))


@dataclass(frozen=True)
class DeviceFacts:
    """What the resolution needs to know about where the built model runs. Read from the built model chunks
    by `optimization_plan.apply.device_facts_of`; tests pass them directly (a CUDA plan resolves on CPU)."""

    device_type: str = "cpu"
    """Where the model's parameters live: 'cuda', 'cpu' or 'meta' (decides compiled layers and CUDA graphs)."""

    cuda: bool = False
    """Whether the process computes on a CUDA device (decides the fused kernels, the overlap transport and the
    FP8 GEMMs, which act on the tensors they get, wherever the parameters were built)."""

    compute_capability: Optional[Tuple[int, int]] = None
    """(major, minor) of the current CUDA device; None without one."""

    triton: bool = False
    """Whether Triton is installed (the fused kernels and the FP8 quantizers use it on CUDA)."""

    tp_backend: Optional[str] = None
    """Backend of the tensor-parallel process group ('nccl', 'gloo'); None without a process group."""

    transformer_engine_modules: Tuple[str, ...] = ()
    """Type names of Transformer Engine modules in the transformer layers (their FP8 is not wired here)."""


@dataclass(frozen=True)
class Decision:
    """One row of the plan."""

    value: Any
    """The resolved value, plain data (None, bool, str, or a dict of those): what `as_dict` stores."""

    why: str
    """Which flag decided it, or the `auto` rule that did."""

    shown: str = ""
    """The value as the start-up table prints it (default: derived from `value`)."""

    def text(self) -> str:
        """The table's value column."""
        if self.shown:
            return self.shown
        if self.value is None or self.value is False:
            return "off"
        return "on" if self.value is True else str(self.value)


@dataclass(frozen=True)
class OptimizationPlan:
    """Every decision about how the built model runs, in the order `optimization_plan.apply` carries them out.

    Megatron's fusion flags (the last four rows) are shown for completeness: the modules pick their fused
    functions from the config as they are built; the plan reports what that gives."""

    fp8: Decision
    """FP8 GEMMs in the transformer layers' linears: the `Fp8Recipe` fields, or None."""

    compile_layers: Decision
    """`torch.compile` each transformer layer (bool)."""

    compile_linears: Decision
    """Trace the tensor-parallel linears into the compiled layers' graphs (bool)."""

    cuda_graphs: Decision
    """Per-layer CUDA graphs: {'warmup_steps': n}, or None."""

    tp_comm_overlap: Decision
    """Sequence-parallel communication pipelined with the GEMMs: {'all_gather': bool, 'reduce_scatter': bool},
    or None."""

    tp_comm_transport: Decision
    """How the overlap pipelines move their chunks: 'copy-engine', 'p2p', or None without overlap."""

    fusion_kernels: Decision
    """The fused elementwise functions on CUDA tensors: 'compiled' or 'eager'."""

    bias_activation_fusion: Decision
    """Bias + GeLU / SwiGLU fused (Megatron's `--no-bias-gelu-fusion`, `--no-bias-swiglu-fusion`)."""

    bias_dropout_fusion: Decision
    """Bias + dropout + residual fused (`--no-bias-dropout-fusion`)."""

    gradient_accumulation_fusion: Decision
    """Weight gradients added into `main_grad` inside the linears' backward (`--no-gradient-accumulation-fusion`)."""

    native_fusions: Decision
    """RoPE, softmax and cross-entropy: this framework's kernels whatever Megatron's toggles say."""

    def decisions(self) -> List[Tuple[str, Decision]]:
        """(name, decision) in table order."""
        return [(field.name, getattr(self, field.name)) for field in dataclasses.fields(self)]

    def as_dict(self) -> Dict[str, Dict[str, Any]]:
        """The plan as plain data ({name: {'value', 'why'}}), stored as `args.optimization_plan`."""
        return {name: {"value": decision.value, "why": decision.why} for name, decision in self.decisions()}

    @property
    def fp8_recipe(self) -> Optional[Fp8Recipe]:
        """The FP8 recipe the transformer layers' linears run, or None."""
        return None if self.fp8.value is None else Fp8Recipe(**self.fp8.value)


def _mode(config, field: str, problems: List[str]) -> str:
    flag, choices = _MODES[field]
    value = getattr(config, field, "auto")
    if value not in choices:
        problems.append(f"{flag} ({field}={value!r}): expected one of {', '.join(choices)}.")
        return "auto"
    return value


def _fp8(config, device: DeviceFacts, problems: List[str]) -> Decision:
    problems += fp8_config_problems(config, device.transformer_engine_modules)
    recipe = Fp8Recipe.from_config(config)
    if recipe is None:
        return Decision(None, "no --fp8-format")
    capability = device.compute_capability
    shown_capability = "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
    if device.cuda and capability is not None and tuple(capability) >= (8, 9):
        gemms = f"torch._scaled_mm on compute capability {shown_capability}"
    else:
        where = f"compute capability {shown_capability}" if device.cuda else "no CUDA device"
        gemms = f"fp32 emulation of the same numbers ({where}: no FP8 tensor cores)"
    scaling = recipe.recipe
    if recipe.recipe == "delayed":
        scaling += f" (amax history {recipe.amax_history_len}, {recipe.amax_compute_algo})"
    shown = f"{recipe.fp8_format}, {scaling}, margin {recipe.margin}" + ("" if recipe.wgrad else ", bf16 wgrad")
    if recipe.num_layers_at_start_in_bf16 or recipe.num_layers_at_end_in_bf16:
        shown += (f", first {recipe.num_layers_at_start_in_bf16} / last {recipe.num_layers_at_end_in_bf16} "
                  "layers in bf16")
    return Decision(dataclasses.asdict(recipe), f"--fp8-format {recipe.fp8_format}: the transformer layers' "
                    f"linears; GEMMs: {gemms}", shown)


def _compile_layers(config, device: DeviceFacts, problems: List[str]) -> Decision:
    mode = _mode(config, "compile_layers", problems)
    if mode == "off":
        return Decision(False, "--compile-layers off")
    selective = config.recompute_granularity == "selective"
    if mode == "on":
        if selective:
            problems.append("--compile-layers on with selective activation recompute (--recompute-activations / "
                            "--recompute-granularity selective): its recomputed parts cannot be compiled into the "
                            "layer; use --compile-layers auto or off, or another recompute setting.")
        return Decision(True, "--compile-layers on")
    if selective:
        return Decision(False, "auto: selective recompute (its recomputed parts are custom autograd functions)")
    if device.device_type != "cuda":
        return Decision(False, f"auto: parameters on {device.device_type}, not a CUDA device")
    if config.hidden_size < MIN_HIDDEN_SIZE_TO_COMPILE:
        return Decision(False, f"auto: hidden size {config.hidden_size} < {MIN_HIDDEN_SIZE_TO_COMPILE} (small "
                        "layers ran slower compiled)")
    if config.tensor_model_parallel_size > 1 and config.sequence_parallel:
        return Decision(False, "auto: tensor + sequence parallelism (split graphs ran slower than eager layers)")
    return Decision(True, f"auto: CUDA, hidden size {config.hidden_size} >= {MIN_HIDDEN_SIZE_TO_COMPILE}")


def _compile_linears(config, layers_compiled: bool, problems: List[str]) -> Decision:
    mode = _mode(config, "compile_linears", problems)
    if not layers_compiled:
        unused = "" if mode == "auto" else f" (--compile-linears {mode} has no effect)"
        return Decision(False, "layers not compiled" + unused)
    if mode == "on":
        return Decision(True, "--compile-linears on: the weight gradients go to autograd, DDP adds them")
    if mode == "off":
        return Decision(False, "--compile-linears off: the compiled layers call the linears eagerly")
    return Decision(False, "auto: off (traced linears were slower with CUDA graphs and trained differently)")


def moe_cuda_graph_problems(settings, expert_tensor_parallel_size: Optional[int]) -> List[str]:
    """MoE settings a graphed layer cannot follow (empty when the MoE layers can be captured). `settings` has
    the MoE fields under their config / argument names (a TransformerConfig or the parsed arguments).

    A captured MoE layer must not read anything on the host and must have fixed shapes: that holds for the
    dropless alltoall dispatcher without expert parallelism or expert TP, whose row counts per expert stay on
    the device (the grouped GEMM takes device offsets), and for routing without random numbers or host loops."""
    problems = []
    ep = getattr(settings, "expert_model_parallel_size", 1) or 1
    if ep > 1:
        problems.append(f"expert parallelism (--expert-model-parallel-size {ep}: the all-to-all needs its split "
                        "sizes on the host)")
    if (expert_tensor_parallel_size or 1) > 1:
        problems.append(f"expert tensor parallelism (--expert-tensor-parallel-size {expert_tensor_parallel_size}, "
                        "which defaults to --tensor-model-parallel-size: its gathers need split sizes on the host)")
    dispatcher = getattr(settings, "moe_token_dispatcher_type", "allgather")
    if dispatcher != "alltoall":
        problems.append(f"--moe-token-dispatcher-type {dispatcher} (only alltoall keeps its row counts on the "
                        "device)")
    if getattr(settings, "moe_expert_capacity_factor", None) is not None:
        problems.append(f"--moe-expert-capacity-factor {settings.moe_expert_capacity_factor} (with token dropping "
                        "the row count depends on the routing)")
    if getattr(settings, "moe_router_padding_for_fp8", False):
        problems.append("--moe-router-padding-for-fp8 (the padded row count depends on the routing)")
    if getattr(settings, "moe_router_load_balancing_type", None) == "sinkhorn":
        problems.append("--moe-router-load-balancing-type sinkhorn (it iterates until a host-side test passes)")
    if getattr(settings, "moe_input_jitter_eps", None):
        problems.append(f"--moe-input-jitter-eps {settings.moe_input_jitter_eps} (the graphs would replay the "
                        "same noise)")
    if getattr(settings, "moe_router_force_load_balancing", False):
        problems.append("--moe-router-force-load-balancing (the graphs would replay the same random logits)")
    if getattr(settings, "moe_shared_expert_overlap", False):
        problems.append("--moe-shared-expert-overlap (its side stream is not captured)")
    return problems


def cuda_graph_problems(config) -> List[str]:
    """Settings that per-layer CUDA graphs do not support (empty when the config can be graphed)."""
    problems = []
    if getattr(config, "pipeline_model_parallel_size", 1) > 1:
        problems.append(f"pipeline parallelism (--pipeline-model-parallel-size {config.pipeline_model_parallel_size}: "
                        "several micro-batches in flight)")
    if getattr(config, "hidden_dropout", 0.0) or getattr(config, "attention_dropout", 0.0):
        problems.append(f"dropout (--hidden-dropout {config.hidden_dropout}, --attention-dropout "
                        f"{config.attention_dropout}: the graphs would replay the same dropout masks)")
    if getattr(config, "recompute_granularity", None) is not None:
        problems.append(f"activation recompute (--recompute-granularity {config.recompute_granularity})")
    if getattr(config, "num_moe_experts", None):
        problems.extend(moe_cuda_graph_problems(config, config.expert_tensor_parallel_size))
    if getattr(config, "cuda_graph_scope", "full") != "full":
        problems.append(f"--cuda-graph-scope {config.cuda_graph_scope} (the graphs cover whole layers: full)")
    if getattr(config, "cuda_graph_warmup_steps", 1) < 1:
        problems.append(f"--cuda-graph-warmup-steps {config.cuda_graph_warmup_steps} (at least 1)")
    return problems


def _cuda_graphs(config, device: DeviceFacts, problems: List[str]) -> Decision:
    if not config.enable_cuda_graph:
        return Decision(None, "no --enable-cuda-graph")
    unsupported = cuda_graph_problems(config)
    if unsupported:
        problems.append("--enable-cuda-graph does not support " + "; ".join(unsupported) + ": drop "
                        "--enable-cuda-graph or change those settings.")
    if device.device_type != "cuda":
        return Decision(None, f"--enable-cuda-graph, but the layers are on {device.device_type}: no graphs")
    steps = config.cuda_graph_warmup_steps
    return Decision({"warmup_steps": steps}, f"--enable-cuda-graph: each layer captured after {steps} eager "
                    "training forwards (--cuda-graph-warmup-steps)", f"on, per layer, after {steps} warm-up steps")


def _tp_comm_overlap(config) -> Decision:
    if not config.tp_comm_overlap:
        return Decision(None, "no --tp-comm-overlap")
    if not (config.sequence_parallel and config.tensor_model_parallel_size > 1):
        return Decision(None, "--tp-comm-overlap without sequence parallelism over TP > 1: nothing to overlap")
    halves = {"all_gather": bool(config.tp_comm_overlap_ag), "reduce_scatter": bool(config.tp_comm_overlap_rs)}
    off = [flag for flag, half in (("--disable-tp-comm-overlap-ag", "all_gather"),
                                   ("--disable-tp-comm-overlap-rs", "reduce_scatter")) if not halves[half]]
    if len(off) == 2:
        return Decision(None, "--tp-comm-overlap with " + " and ".join(off) + ": both halves off")
    shown = " + ".join(name.replace("_", "-") for name, on in halves.items() if on)
    return Decision(halves, "--tp-comm-overlap" + "".join(f" {flag}" for flag in off), shown)


def _tp_comm_transport(config, device: DeviceFacts, overlapping: bool, problems: List[str]) -> Decision:
    mode = _mode(config, "tp_comm_overlap_transport", problems)
    if not overlapping:
        unused = "" if mode == "auto" else f" (--tp-comm-overlap-transport {mode} has no effect)"
        return Decision(None, "no overlap pipelines" + unused)
    copy_engine_possible = device.cuda and device.tp_backend != "gloo"
    where = f"{'CUDA' if device.cuda else 'no CUDA device'}, {device.tp_backend or 'no'} process group"
    if mode == "copy-engine":
        if not copy_engine_possible:
            problems.append(f"--tp-comm-overlap-transport copy-engine needs CUDA tensors on an NCCL group ({where}): "
                            "use p2p or auto.")
        return Decision("copy-engine", "--tp-comm-overlap-transport copy-engine")
    if mode == "p2p":
        return Decision("p2p", f"--tp-comm-overlap-transport p2p: point-to-point sends ({where})")
    if copy_engine_possible:
        return Decision("copy-engine", "auto: CUDA with NCCL: peer copies take no SMs from the GEMMs (the TP ranks "
                        "must share a host; else --tp-comm-overlap-transport p2p)")
    return Decision("p2p", f"auto: no copy engine for {where}")


def _fusion_kernels(config, device: DeviceFacts, problems: List[str]) -> Decision:
    mode = _mode(config, "fusion_kernels", problems)
    on_cuda = device.cuda
    if mode == "eager":
        return Decision("eager", "--fusion-kernels eager: the plain PyTorch reference")
    if mode == "compiled":
        return Decision("compiled", "--fusion-kernels compiled" + ("" if on_cuda else " (CPU tensors run eagerly)"))
    if not on_cuda:
        return Decision("eager", "auto: no CUDA device: the fused functions compile only for CUDA tensors")
    triton = "" if device.triton else " (Triton missing: no Triton kernels)"
    return Decision("compiled", "auto: CUDA: torch.compile per argument signature, Triton kernels" + triton)


def _megatron_fusions(config) -> Dict[str, Decision]:
    bias_act = bool(config.bias_activation_fusion)
    bias_dropout = bool(config.bias_dropout_fusion)
    wgrad = bool(config.gradient_accumulation_fusion)
    return {
        "bias_activation_fusion": Decision(bias_act, "bias + GeLU / SwiGLU in one fused function" if bias_act else
                                           "--no-bias-gelu-fusion / --no-bias-swiglu-fusion, or no fused kernel "
                                           "for this activation"),
        "bias_dropout_fusion": Decision(bias_dropout, "bias + dropout + residual in one fused function"
                                        if bias_dropout else "--no-bias-dropout-fusion"),
        "gradient_accumulation_fusion": Decision(wgrad, "weight gradients added into main_grad in the linears' "
                                                 "backward" if wgrad else "--no-gradient-accumulation-fusion: "
                                                 "DDP's hook adds the weight gradients"),
        "native_fusions": Decision("native", "--no-rope-fusion, --no-masked-softmax-fusion and "
                                   "--cross-entropy-loss-fusion have no effect here: RoPE, softmax and "
                                   "cross-entropy always run this framework's kernels"),
    }


def resolve_plan(config, device: DeviceFacts) -> OptimizationPlan:
    """The plan for a model built from `config` (a `TransformerConfig`) whose chunks run on `device`.

    Raises `PlanError` listing every setting that cannot be carried out (FP8 rules, CUDA-graph scope, an
    impossible transport, compiled layers with selective recompute)."""
    problems: List[str] = []
    fp8 = _fp8(config, device, problems)
    compile_layers = _compile_layers(config, device, problems)
    compile_linears = _compile_linears(config, compile_layers.value, problems)
    cuda_graphs = _cuda_graphs(config, device, problems)
    overlap = _tp_comm_overlap(config)
    transport = _tp_comm_transport(config, device, overlap.value is not None, problems)
    fusion_kernels = _fusion_kernels(config, device, problems)
    if problems:
        raise PlanError(problems)
    return OptimizationPlan(fp8=fp8, compile_layers=compile_layers, compile_linears=compile_linears,
                            cuda_graphs=cuda_graphs, tp_comm_overlap=overlap, tp_comm_transport=transport,
                            fusion_kernels=fusion_kernels, **_megatron_fusions(config))


def format_plan(plan: OptimizationPlan) -> str:
    """The start-up table: one line per decision (decision, value, why)."""
    rows = [("decision", "value", "why")] + [(name, decision.text(), decision.why)
                                              for name, decision in plan.decisions()]
    widths = [max(len(row[column]) for row in rows) for column in range(2)]
    lines = ["optimisation plan (megatron.core.optimization_plan):"]
    for index, (name, value, why) in enumerate(rows):
        lines.append(f"  {name:<{widths[0]}} | {value:<{widths[1]}} | {why}")
        if index == 0:
            lines.append(f"  {'-' * widths[0]}-+-{'-' * widths[1]}-+-{'-' * 3}")
    return "\n".join(lines)


def settings_applied_by_plan(config) -> List[str]:
    """The flags in `config` that only the applied plan carries out (a block built from it refuses to run
    until the plan has been applied, rather than silently running without them)."""
    settings = []
    if getattr(config, "fp8", None) is not None:
        settings.append(f"--fp8-format {config.fp8}")
    if getattr(config, "enable_cuda_graph", False):
        settings.append("--enable-cuda-graph")
    if getattr(config, "tp_comm_overlap", False):
        settings.append("--tp-comm-overlap")
    for field in ("compile_layers", "compile_linears"):
        if getattr(config, field, "auto") == "on":
            settings.append(f"{_MODES[field][0]} on")
    if getattr(config, "fusion_kernels", "auto") == "eager":
        settings.append("--fusion-kernels eager")
    return settings


__all__ = ["DeviceFacts", "Decision", "OptimizationPlan", "PlanError", "resolve_plan", "format_plan",
           "cuda_graph_problems", "moe_cuda_graph_problems", "settings_applied_by_plan",
           "MIN_HIDDEN_SIZE_TO_COMPILE"]
