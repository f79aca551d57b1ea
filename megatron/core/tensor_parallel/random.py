"""Named device-RNG streams (`CudaRNGStatesTracker`) and activation recompute (`checkpoint`).

The tracker keeps one generator state per name and swaps it in inside `fork(name)`. Megatron seeds
'model-parallel-rng' differently per TP rank, so dropout inside `fork()` (attention probabilities,
TP-split activations) differs across TP ranks while dropout outside it (sequence-replicated
activations) is identical on every TP rank.

Device note: the tracked generator is the CUDA generator when CUDA is available and the default CPU
generator otherwise, so the same per-TP-rank behaviour holds for CPU runs (gloo tests).
"""
import contextlib
import logging
from typing import Any, Dict, Optional

import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel.utils import gather_split_1d_tensor, split_tensor_into_1d_equal_chunks
from megatron.core.utils import module_available

logger = logging.getLogger(__name__)

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"


def _uses_cuda() -> bool:
    return torch.cuda.is_available()


def _get_device_rng_state() -> torch.Tensor:
    """State of the tracked generator (CUDA when available, else the default CPU generator)."""
    if _uses_cuda():
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def _set_device_rng_state(state: torch.Tensor) -> None:
    if _uses_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _device_manual_seed(seed: int) -> None:
    if _uses_cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


def _get_cuda_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> Optional[torch.Tensor]:
    """CUDA generator state, or None without CUDA."""
    if not _uses_cuda():
        return None
    state = torch.cuda.get_rng_state() if device is None else torch.cuda.get_rng_state(device)
    return state.clone() if clone else state


def _set_cuda_rng_state(new_state: Optional[torch.Tensor], device: int = -1, graph_safe: bool = False) -> None:
    """Restore a CUDA generator state taken by `_get_cuda_rng_state` (no-op without CUDA)."""
    if new_state is None or not _uses_cuda():
        return
    if device == -1:
        torch.cuda.set_rng_state(new_state)
    else:
        torch.cuda.set_rng_state(new_state, device)


_DEFAULT_STATE_NAME = "default-rng"


class CudaRNGStatesTracker:
    """Named device-RNG states; `fork(name)` runs a block with that state and saves where it ended.

    Megatron's semantics: `add` raises when the seed or the name is already used (the seed is recorded
    first); `get_states` returns a new dict holding the tracker's state objects (no copies) and
    `set_states` adopts the given dict itself, unchecked; `fork` of an unknown name raises. Forks nest:
    entering a fork stores the state of the fork it interrupts, so a stream forked again inside another
    stream continues where it was.
    """

    def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False) -> None:
        self.reset()
        self.use_cudagraphable_rng = use_cudagraphable_rng
        self.is_inference_rng_tracker = is_inference_rng_tracker

    def is_initialized(self) -> bool:
        """True once a state was added or set."""
        return self._is_initialized

    def reset(self) -> None:
        """Forget every named state and seed."""
        self._is_initialized = False
        self.states_: Dict[str, Any] = {}
        self.seeds_ = set()
        self._current_state_name = _DEFAULT_STATE_NAME

    def get_states(self) -> Dict[str, Any]:
        """A new name -> state dict with the tracker's own state objects (for checkpoints and recompute)."""
        return dict(self.states_)

    def set_states(self, states: Dict[str, Any]) -> None:
        """Adopt `states` (the dict itself) as the named states (inverse of `get_states`)."""
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """Register stream `name` seeded with `seed`; the current device RNG state is left unchanged."""
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists: every tracked RNG stream needs its own seed")
        self.seeds_.add(seed)
        if name in self.states_:
            raise ValueError(f"cuda rng state {name} already exists: call reset() before adding it again")
        original = _get_device_rng_state()
        _device_manual_seed(seed)
        self.states_[name] = _get_device_rng_state()
        _set_device_rng_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Run the block with stream `name`'s state; afterwards store its advanced state and restore the old one."""
        if name not in self.states_:
            raise KeyError(f"cuda rng state {name} is not added: call model_parallel_cuda_manual_seed(seed) first")
        outer_state = _get_device_rng_state()
        outer_name = self._current_state_name
        if outer_name != _DEFAULT_STATE_NAME:
            self.states_[outer_name] = outer_state
        _set_device_rng_state(self.states_[name])
        self._current_state_name = name
        cpu_state = torch.get_rng_state() if _uses_cuda() else None
        try:
            yield
        finally:
            if cpu_state is not None and not torch.equal(cpu_state, torch.get_rng_state()):
                logger.warning("CPU RNG state changed within GPU RNG context")
            if self._current_state_name != name:
                raise RuntimeError(
                    f"current state name {self._current_state_name} is not the same as the desired state name "
                    f"{name}: RNG forks must be exited in the order they were entered"
                )
            self.states_[name] = _get_device_rng_state()
            if outer_name != _DEFAULT_STATE_NAME:
                outer_state = self.states_[outer_name]
            _set_device_rng_state(outer_state)
            self._current_state_name = outer_name


class InferenceCudaRNGStatesTracker(CudaRNGStatesTracker):
    """Tracker for inference (no dropout): adding and setting states are no-ops, `fork` switches nothing."""

    def add(self, name: str, seed: int) -> None:
        """Accepted and ignored, like Megatron's inference tracker."""

    def set_states(self, states: Dict[str, Any]) -> None:
        """Accepted and ignored, like Megatron's inference tracker."""

    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        """A no-op context."""
        return contextlib.nullcontext()


_CUDA_RNG_STATE_TRACKER: Optional[CudaRNGStatesTracker] = None
_CUDA_RNG_STATE_TRACKER_INITIALIZED = False


def initialize_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    force_reset: bool = False,
) -> None:
    """Create the global tracker on first use; later calls keep it, whatever they ask for, unless
    `force_reset` (Megatron's rule: the first caller decides the kind).

    Transformer Engine's tracker is used only when transformer_engine is importable and asked for;
    otherwise (as in Megatron) the native tracker is created.
    """
    global _CUDA_RNG_STATE_TRACKER, _CUDA_RNG_STATE_TRACKER_INITIALIZED
    if force_reset:
        _CUDA_RNG_STATE_TRACKER, _CUDA_RNG_STATE_TRACKER_INITIALIZED = None, False
    if _CUDA_RNG_STATE_TRACKER_INITIALIZED:
        return
    if use_te_rng_tracker and module_available("transformer_engine"):
        import transformer_engine.pytorch.distributed as te_distributed

        _CUDA_RNG_STATE_TRACKER = te_distributed.CudaRNGStatesTracker()
    elif inference_rng_tracker:
        _CUDA_RNG_STATE_TRACKER = InferenceCudaRNGStatesTracker(
            use_cudagraphable_rng=use_cudagraphable_rng, is_inference_rng_tracker=True)
    else:
        _CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker(use_cudagraphable_rng=use_cudagraphable_rng)
    _CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def get_cuda_rng_tracker(use_te_rng_tracker=False, inference_rng_tracker=False, use_cudagraphable_rng=False):
    """The global RNG tracker (created on first use)."""
    initialize_rng_tracker(use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)
    return _CUDA_RNG_STATE_TRACKER


def get_data_parallel_rng_tracker_name() -> str:
    """Name of the stream seeded identically on every rank."""
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def get_expert_parallel_rng_tracker_name() -> str:
    """Name of the stream seeded per expert-parallel / expert-TP rank."""
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def model_parallel_cuda_manual_seed(
    seed: int, te_rng_tracker: bool = False, inference_rng_tracker: bool = False, use_cudagraphable_rng: bool = False
) -> None:
    """Seed the device RNG with `seed` and register Megatron's three streams.

    'data-parallel-rng' = seed, 'model-parallel-rng' = seed + 2718 + tp_rank,
    'expert-parallel-rng' = seed + 1024 + 100 * ep_rank + expert_tp_rank.
    """
    tensor_model_parallel_seed = seed + 2718 + parallel_state.get_tensor_model_parallel_rank()
    expert_parallel_seed = (
        seed + 1024 + 100 * parallel_state.get_expert_model_parallel_rank()
        + parallel_state.get_expert_tensor_parallel_rank()
    )
    initialize_rng_tracker(te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)
    tracker = _CUDA_RNG_STATE_TRACKER
    tracker.reset()
    _device_manual_seed(seed)
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, tensor_model_parallel_seed)
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, expert_parallel_seed)


def _get_all_rng_states():
    return torch.get_rng_state(), _get_cuda_rng_state(), get_cuda_rng_tracker().get_states()


def _set_all_rng_states(cpu_state, cuda_state, tracker_states) -> None:
    torch.set_rng_state(cpu_state)
    _set_cuda_rng_state(cuda_state)
    get_cuda_rng_tracker().set_states(tracker_states)


def detach_variable(inputs):
    """Detached copies of the tensors in `inputs` keeping requires_grad (non-tensors pass through)."""
    out = []
    for inp in inputs:
        if not isinstance(inp, torch.Tensor):
            out.append(inp)
            continue
        x = inp.detach()
        x.requires_grad = inp.requires_grad
        out.append(x)
    return tuple(out)


def _set_tensor_data(tensor: torch.Tensor, data: torch.Tensor) -> None:
    """Swap `tensor`'s storage for `data` (the tensor must not be a view, or its base would keep the memory)."""
    if tensor._base is not None:
        raise RuntimeError(
            "distribute_saved_activations needs the checkpointed input to be a viewless tensor "
            "(see megatron.core.utils.make_viewless_tensor)"
        )
    tensor.data = data


def _backward_outputs(outputs, grads):
    if isinstance(outputs, torch.Tensor):
        outputs = (outputs,)
    pairs = [(o, g) for o, g in zip(outputs, grads) if isinstance(o, torch.Tensor) and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


class CheckpointFunction(torch.autograd.Function):
    """Runs `run_function` without saving activations; backward re-runs it under the forward's RNG states."""

    @staticmethod
    def forward(ctx, run_function, distribute_saved_activations, *args):
        ctx.run_function = run_function
        ctx.distribute_saved_activations = distribute_saved_activations
        ctx.fwd_rng_states = _get_all_rng_states()
        with torch.no_grad():
            outputs = run_function(*args)
        if distribute_saved_activations:
            ctx.input_0_shape = args[0].data.shape
            _set_tensor_data(args[0], split_tensor_into_1d_equal_chunks(args[0].data, new_buffer=True))
        ctx.save_for_backward(*args)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("activation checkpointing does not work with torch.autograd.grad(); use .backward()")
        inputs = ctx.saved_tensors
        if ctx.distribute_saved_activations:
            # [numel/tp] -> [numel] -> original shape
            _set_tensor_data(inputs[0], gather_split_1d_tensor(inputs[0].data).view(ctx.input_0_shape))
        bwd_rng_states = _get_all_rng_states()
        _set_all_rng_states(*ctx.fwd_rng_states)
        detached_inputs = detach_variable(inputs)
        try:
            with torch.enable_grad():
                outputs = ctx.run_function(*detached_inputs)
        finally:
            _set_all_rng_states(*bwd_rng_states)
        _backward_outputs(outputs, grads)
        input_grads = tuple(inp.grad if isinstance(inp, torch.Tensor) else None for inp in detached_inputs)
        return (None, None) + input_grads


def checkpoint(function, distribute_saved_activations, *args):
    """Activation recompute: forward without saving activations, recompute them in backward with
    identical RNG states (CPU, CUDA and tracker), so dropout masks match. With
    `distribute_saved_activations`, the saved first input is split across TP ranks."""
    return CheckpointFunction.apply(function, distribute_saved_activations, *args)


class CheckpointWithoutOutputFunction(torch.autograd.Function):
    """Forward without grad; backward back-propagates through outputs rebuilt by `CheckpointWithoutOutput`."""

    @staticmethod
    def forward(ctx, run_function, checkpoint_without_output_obj, *args):
        with torch.no_grad():
            outputs = run_function(*args)
        ctx.save_for_backward(*detach_variable(args))
        checkpoint_without_output_obj.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        inputs, outputs = ctx.inputs, ctx.outputs
        _backward_outputs(outputs, grads)
        ctx.outputs, ctx.inputs = None, None
        input_grads = tuple(inp.grad if isinstance(inp, torch.Tensor) else None for inp in inputs)
        return (None, None) + input_grads


class CheckpointWithoutOutput:
    """Recompute a function whose output storage is freed right after the consumer used it.

    `out = ckpt.checkpoint(fn, x)`; `y = consumer(out)`; `ckpt.discard_output_and_register_recompute(y)`:
    `out`'s storage is released and refilled (with the forward's RNG states) when `y`'s grad arrives.

    Megatron's semantics: the storage is refilled byte for byte without touching the tensors' metadata or
    version counters, so consumers that saved `out` (or views of it) for their backward read the
    recomputed values and pass autograd's in-place checks; a second trigger of the hook does nothing.
    """

    def __init__(self, fp8: bool = False) -> None:
        self.fp8 = fp8
        self.run_function = None
        self.rng_states = None
        self.ctx = None
        self.outputs = None

    def checkpoint(self, run_function, *args):
        """Run `run_function(*args)` without building a graph; remember how to recompute it."""
        self.run_function = run_function
        self.rng_states = _get_all_rng_states()
        outputs = CheckpointWithoutOutputFunction.apply(run_function, self, *args)
        self.outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
        return outputs

    def _recompute(self, _grad):
        if self.ctx is None:
            return
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("activation checkpointing does not work with torch.autograd.grad(); use .backward()")
        current = _get_all_rng_states()
        _set_all_rng_states(*self.rng_states)
        try:
            inputs = detach_variable(self.ctx.saved_tensors)
            with torch.enable_grad():
                outputs = self.run_function(*inputs)
        finally:
            _set_all_rng_states(*current)
        self.run_function = None
        self.rng_states = None
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        with torch.no_grad():
            for output, recomputed in zip(self.outputs, outputs):
                # Storage-level copy: an in-place tensor op would bump `output`'s version counter and make
                # every consumer that saved it for backward fail autograd's in-place check.
                output.untyped_storage().resize_(recomputed.untyped_storage().size())
                output.untyped_storage().copy_(recomputed.untyped_storage())
        self.ctx.outputs, self.ctx.inputs = outputs, inputs
        self.outputs = None
        self.ctx = None

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the outputs' storage; recompute them when `hook_tensor`'s gradient is computed."""
        for output in self.outputs:
            output.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute)
