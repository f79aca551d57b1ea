"""Per-layer CUDA graphs (`--enable-cuda-graph`): each transformer layer's forward and backward replay as
one CUDA graph each, so the host launches two graphs per layer instead of every kernel and collective.

How it runs. The first `cuda_graph_warmup_steps` training forwards of a layer run eagerly (this is where
`torch.compile` of the layer and NCCL's communicator set-up happen). The next training forward captures
the layer's forward into a graph, with the autograd graph recorded at capture time; that layer's next
backward captures `torch.autograd.grad` of the captured output into a second graph. From then on the
forward copies its inputs into the captured ("static") input tensors only when they live elsewhere
(a layer fed by the previous graphed layer reads that layer's static output in place) and replays; the
backward does the same with the incoming gradient. All graphs of a block share one memory pool and are
replayed in the order they were captured (forwards in layer order, backwards in reverse), which is what
makes the shared pool safe.

Gradients. Weight gradients that the tensor-parallel linears add straight into `main_grad` are part of
the backward graph; the graphed backward hands autograd a fresh, unfilled placeholder for those weights
and sets `grad_added_to_main_grad`, exactly what the eager linear does, so DDP's per-parameter hooks fire
in the same order and skip the add. Other parameter gradients (biases, norm weights, MoE expert and router
weights) are added from the graph's static buffers into `main_grad` right after the replay, the same way
(under DDP; without it they are returned to autograd as copies).

MoE layers (dropless alltoall without EP or expert TP: `optimization_plan.resolve.moe_cuda_graph_problems`)
are captured whole: their row counts stay on the device. The auxiliary losses are recorded into the
tracker and scaled in backward by `MoEAuxLossAutoScaler`'s scale tensor, both updated in place, so the
replays follow them; the warm-up pass before a capture undoes its additions to the tracker and to the
layer's buffers (an expert-bias router's token counts).

Scope (checked when the optimisation plan is resolved, and by the argument validation): training forwards
with gradients of layers on CUDA, one micro-batch in flight (no pipeline parallelism), no dropout (the
graphs do not advance the tensor-parallel RNG tracker's generators), no activation recompute, no
parameter-gather pre-hooks, and for MoE layers the settings above. Calls outside this scope (evaluation,
no-grad, another input shape) run the layer eagerly. Off the GPU the plan leaves the layers ungraphed and
says so in its table.
"""
import contextlib
import logging
from typing import Dict, List, Optional, Tuple

import torch

from megatron.core import parallel_state
from megatron.core.fp8.recipe import fp8_scaling_state_kept
from megatron.core.fusions.fused_grad_accumulation import accumulate_grad_
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

logger = logging.getLogger(__name__)


class _GraphPool:
    """State shared by the graphed layers of one block: the memory pool, the capture stream, and the
    storages of every graph's static outputs / input gradients (to recognise them when they come back)."""

    def __init__(self, warmup_steps: int):
        self.pool = torch.cuda.graph_pool_handle()
        self.stream: Optional[torch.cuda.Stream] = None
        self.warmup_steps = max(int(warmup_steps), 1)
        self.static_tensors: Dict[int, torch.Tensor] = {}
        self.captured_layers = 0

    def run(self, fn, graph: Optional["torch.cuda.CUDAGraph"] = None):
        """`fn()` on `capture_stream()`, captured into `graph` when one is given (no gc / empty_cache,
        unlike `torch.cuda.graph`); the current stream then waits for it."""
        if graph is not None:
            torch.cuda.synchronize()
        stream = self.capture_stream()
        with torch.cuda.stream(stream):
            if graph is None:
                result = fn()
            else:
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    result = fn()
                finally:
                    graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        return result

    def capture_stream(self) -> "torch.cuda.Stream":
        """The stream that warm-ups and captures run on: the current one, unless it is the legacy default
        stream (which cannot be captured); then a side stream. Autograd runs each backward node on its
        forward's stream and a parameter's gradient accumulator on the stream it was created on, so a
        training loop that runs on one non-default stream (pretrain does, with --enable-cuda-graph) keeps
        every stream of the captured backward the same; with a side stream a gradient accumulator made
        earlier on the default stream would break the capture."""
        current = torch.cuda.current_stream()
        if current != torch.cuda.default_stream():
            return current
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        self.stream.wait_stream(current)
        return self.stream

    def remember(self, tensor: Optional[torch.Tensor]) -> None:
        if tensor is not None:
            self.static_tensors[tensor.data_ptr()] = tensor

    def static_alias(self, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        """The static tensor `tensor` shares memory and layout with, if any."""
        known = self.static_tensors.get(tensor.data_ptr())
        if known is not None and known.shape == tensor.shape and known.stride() == tensor.stride() \
                and known.dtype == tensor.dtype:
            return known
        return None


@contextlib.contextmanager
def main_grad_flags_restored(params, reset: bool = False):
    """Keep the parameters' `grad_added_to_main_grad` flags (DDP's) as they are outside the block; with
    `reset`, the block starts with them False. Parameters without the flag are left alone."""
    flagged = [p for p in params if hasattr(p, "grad_added_to_main_grad")]
    before = [p.grad_added_to_main_grad for p in flagged]
    if reset:
        for param in flagged:
            param.grad_added_to_main_grad = False
    try:
        yield
    finally:
        for param, flag in zip(flagged, before):
            param.grad_added_to_main_grad = flag


@contextlib.contextmanager
def forward_side_effects_undone(layer: torch.nn.Module):
    """Undo what a layer's forward adds outside its outputs: its buffers (an MoE router's token counts) and
    the MoE auxiliary-loss tracker (the logged losses) are as before the block; tracker entries first made
    in the block are zeroed."""
    tracker = parallel_state.get_moe_layer_wise_logging_tracker()
    existing = set(tracker)
    saved = [(buffer, buffer.detach().clone()) for buffer in layer.buffers()]
    saved += [(entry["values"], entry["values"].detach().clone()) for entry in tracker.values()]
    try:
        yield
    finally:
        for tensor, copy in saved:
            tensor.data.copy_(copy)
        for name in set(tracker) - existing:
            tracker[name]["values"].zero_()


@contextlib.contextmanager
def aux_loss_gradients_zeroed():
    """Inside the block the auxiliary losses attached by `MoEAuxLossAutoScaler` (MoE load balancing, z-loss)
    get a zero gradient, so a backward from a zero output gradient is zero everywhere. Without it the warm-up
    backward would carry the losses' gradient into the fused linears' `main_grad` (attention's weights,
    through the MoE layer's input)."""
    scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    if scale is None:
        MoEAuxLossAutoScaler.main_loss_backward_scale = torch.zeros(())
        try:
            yield
        finally:
            MoEAuxLossAutoScaler.main_loss_backward_scale = None
        return
    saved = scale.detach().clone()
    scale.data.zero_()
    try:
        yield
    finally:
        scale.data.copy_(saved)


def _adds_to_main_grad(param: torch.nn.Parameter) -> bool:
    """Whether a returned weight gradient can go straight into DDP's `main_grad` (DDP then skips its add)."""
    return getattr(param, "main_grad", None) is not None and hasattr(param, "grad_added_to_main_grad") \
        and not getattr(param, "zero_out_wgrad", False)


def _detached(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if tensor is None else tensor.detach()


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


class _GraphedLayerFunction(torch.autograd.Function):
    """Replays a layer's forward graph; its backward replays the backward graph (captured on first use)."""

    @staticmethod
    def forward(ctx, runner: "GraphedLayer", *inputs_and_params):
        ctx.runner = runner
        runner.load_inputs(inputs_and_params[: runner.num_inputs])
        runner.forward_graph.replay()
        return runner.static_output.detach()

    @staticmethod
    def backward(ctx, grad_output):
        return (None,) + ctx.runner.run_backward(grad_output)


class GraphedLayer:
    """Wraps one layer's `forward` (see the module docstring)."""

    def __init__(self, layer: torch.nn.Module, graph_pool: _GraphPool):
        self.layer, self.graph_pool = layer, graph_pool
        self.eager_forward = layer.forward
        self.params: List[torch.nn.Parameter] = [p for p in layer.parameters() if p.requires_grad]
        self.calls = 0
        self.key = None
        self.num_inputs = 0
        self.static_inputs: List[torch.Tensor] = []
        self.static_output = self.static_grad_output = None
        self.forward_graph = self.backward_graph = None
        self.static_grads: Tuple[Optional[torch.Tensor], ...] = ()
        self.fused_params: List[bool] = []
        self._mismatch_logged = False

    # ----- eligibility -----
    def _graphable(self, hidden_states, kwargs) -> Optional[Tuple[Tuple[str, ...], List[torch.Tensor]]]:
        if not (self.layer.training and torch.is_grad_enabled() and torch.is_tensor(hidden_states)
                and hidden_states.is_cuda and hidden_states.requires_grad):
            return None
        if torch.cuda.is_current_stream_capturing():
            return None
        names, tensors = [], []
        for name in sorted(kwargs):
            value = kwargs[name]
            if value is None:
                continue
            if not torch.is_tensor(value):
                return None
            names.append(name)
            tensors.append(value)
        return tuple(names), [hidden_states] + tensors

    @staticmethod
    def _key(names, tensors):
        return names, tuple((t.shape, t.stride(), t.dtype, t.requires_grad) for t in tensors)

    def __call__(self, hidden_states, *args, **kwargs):
        context = kwargs.get("context")
        eligible = self._graphable(hidden_states, kwargs) if context is None and not args else None
        if eligible is None:
            return self.eager_forward(hidden_states, *args, **kwargs)
        names, tensors = eligible
        key = self._key(names, tensors)
        if self.forward_graph is None:
            self.calls += 1
            if self.calls <= self.graph_pool.warmup_steps:
                return self.eager_forward(hidden_states, **kwargs)
            self._capture_forward(names, tensors, key)
        elif key != self.key:
            if not self._mismatch_logged:
                logger.info("CUDA graph of layer %s: inputs differ from the captured ones; running it eagerly.",
                            getattr(self.layer, "layer_number", "?"))
                self._mismatch_logged = True
            return self.eager_forward(hidden_states, **kwargs)
        output = _GraphedLayerFunction.apply(self, *tensors, *self.params)
        return output, None

    # ----- capture -----
    def _capture_forward(self, names, tensors, key) -> None:
        self.key, self.num_inputs = key, len(tensors)
        static_inputs = []
        for tensor in tensors:
            alias = self.graph_pool.static_alias(tensor)
            source = alias if alias is not None else tensor.detach().clone()
            static_inputs.append(source.detach().requires_grad_(tensor.requires_grad))
        self.static_inputs = static_inputs

        def run():
            kwargs = dict(zip(names, static_inputs[1:]))
            output, context = self.eager_forward(static_inputs[0], **kwargs)
            if context is not None:
                raise ValueError("--enable-cuda-graph: a layer that returns a context cannot be graphed.")
            return output

        self._warm_up(run)
        graph = torch.cuda.CUDAGraph()
        self.static_output = self.graph_pool.run(run, graph)
        self.forward_graph = graph
        self.graph_pool.remember(self.static_output)
        if self.graph_pool.captured_layers == 0:
            logger.info("--enable-cuda-graph: capturing per-layer CUDA graphs after %d eager forward(s).",
                        self.graph_pool.warmup_steps)
        self.graph_pool.captured_layers += 1

    def _grad_inputs(self) -> List[torch.Tensor]:
        return [t for t in self.static_inputs if t.requires_grad] + self.params

    def _warm_up(self, run) -> None:
        """One forward and backward on the static inputs outside the capture, on the capture stream, so
        that anything done once per input signature (a recompilation, a lazily compiled backward, a
        communicator) happens before capturing. The backward gets a zero output gradient and the auxiliary
        losses a zero gradient: the weight gradients it adds into `main_grad` are zeros, and the
        `grad_added_to_main_grad` flags it sets, the FP8 amax histories it updates and what the forward
        adds to buffers and the aux-loss tracker are restored."""
        def forward_backward():
            output = run()
            torch.autograd.grad(output, self._grad_inputs(), grad_outputs=torch.zeros_like(output), allow_unused=True)

        with main_grad_flags_restored(self.params), fp8_scaling_state_kept(self.layer), \
                forward_side_effects_undone(self.layer), aux_loss_gradients_zeroed():
            self.graph_pool.run(forward_backward)

    def _capture_backward(self, grad_output: torch.Tensor) -> None:
        alias = self.graph_pool.static_alias(grad_output)
        self.static_grad_output = alias if alias is not None else torch.empty_like(grad_output)
        grad_inputs = self._grad_inputs()

        def run():
            return torch.autograd.grad(self.static_output, grad_inputs, grad_outputs=self.static_grad_output,
                                       allow_unused=True)

        graph = torch.cuda.CUDAGraph()
        with main_grad_flags_restored(self.params, reset=True):
            self.static_grads = self.graph_pool.run(run, graph)
            # the weights whose gradient the captured backward adds into main_grad
            self.fused_params = [bool(getattr(p, "grad_added_to_main_grad", False)) for p in self.params]
        self.backward_graph = graph
        num_input_grads = len(grad_inputs) - len(self.params)
        for grad in self.static_grads[:num_input_grads]:
            self.graph_pool.remember(grad)

    # ----- replay -----
    def load_inputs(self, inputs) -> None:
        for static, tensor in zip(self.static_inputs, inputs):
            if not _same_memory(static, tensor):
                # `.data`: a copy that does not bump the version counter autograd checks saved tensors by
                static.data.copy_(tensor.detach())

    def run_backward(self, grad_output: torch.Tensor) -> tuple:
        if self.backward_graph is None:
            self._capture_backward(grad_output)
        if not _same_memory(self.static_grad_output, grad_output):
            self.static_grad_output.data.copy_(grad_output.detach())
        self.backward_graph.replay()
        num_input_grads = sum(t.requires_grad for t in self.static_inputs)
        input_grads_iter = iter(self.static_grads[:num_input_grads])
        input_grads = [_detached(next(input_grads_iter)) if t.requires_grad else None for t in self.static_inputs]
        param_grads = []
        for param, grad, fused in zip(self.params, self.static_grads[num_input_grads:], self.fused_params):
            if not fused and grad is not None and _adds_to_main_grad(param):
                # Added here from the static buffer: autograd would otherwise copy it first (it is still
                # referenced), and DDP's hook would then add the copy.
                accumulate_grad_(param.main_grad, grad)
                fused = True
            if fused:
                # The gradient is in main_grad (by the graph or just above); DDP's hook skips the add.
                param.grad_added_to_main_grad = True
                make = torch.zeros if getattr(param, "zero_out_wgrad", False) else torch.empty
                param_grads.append(make(param.shape, dtype=param.dtype, device=param.device))
            else:
                # A copy: autograd may keep the tensor as `param.grad` and add into it later.
                param_grads.append(None if grad is None else grad.clone())
        return tuple(input_grads) + tuple(param_grads)


def enable_layer_cuda_graphs(layers, warmup_steps: int) -> _GraphPool:
    """Wrap every layer of `layers` (CUDA modules of one block) in a `GraphedLayer` sharing one graph pool,
    capturing after `warmup_steps` eager training forwards. The optimisation plan decides whether to
    (`--enable-cuda-graph`; it checks the settings graphs cannot take, see `optimization_plan.resolve`)."""
    graph_pool = _GraphPool(warmup_steps)
    for layer in layers:
        layer.forward = GraphedLayer(layer, graph_pool)
    return graph_pool


__all__ = ["GraphedLayer", "enable_layer_cuda_graphs"]
