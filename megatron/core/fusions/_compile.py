"""Lazy `torch.compile` for elementwise fusions: used only on CUDA tensors, never on CPU.

Compiling costs seconds on first use and gives no speed-up for these elementwise chains on CPU, so
CPU tensors always take the eager path. Whether CUDA tensors take the compiled functions and the Triton
kernels ('compiled') or the plain PyTorch reference ('eager', for numerics comparisons) is the
`--fusion-kernels` decision of the optimisation plan (`megatron.core.optimization_plan`), set here by
`set_fusion_kernels`. It is process-wide because the fused functions are module-level objects shared by
every model of the process; tests reset it with `reset_fusion_kernels`. A compile failure is an error
naming the function and the flag, never a silent fallback.
"""
import types

import torch

FUSION_KERNELS = ("compiled", "eager")
_DEFAULT_FUSION_KERNELS = "compiled"
_fusion_kernels = {"mode": _DEFAULT_FUSION_KERNELS}


def set_fusion_kernels(mode: str) -> None:
    """Run the fused functions on CUDA tensors 'compiled' (default) or 'eager' from now on (the plan's choice)."""
    if mode not in FUSION_KERNELS:
        raise ValueError(f"--fusion-kernels ({mode!r}): expected one of {', '.join(FUSION_KERNELS)}")
    _fusion_kernels["mode"] = mode


def reset_fusion_kernels() -> None:
    """Back to the default ('compiled'), for tests that switch it."""
    _fusion_kernels["mode"] = _DEFAULT_FUSION_KERNELS


def eager_fusions_requested() -> bool:
    """True when the plan chose the eager reference path for CUDA tensors (`--fusion-kernels eager`)."""
    return _fusion_kernels["mode"] == "eager"


# Argument signatures (shapes, strides, dtypes) compiled per function, each with its sizes as constants;
# calls with further signatures run eagerly (bounded compile time for callers whose shapes keep changing,
# e.g. text generation with growing sequences).
_MAX_SPECIALISED = 8


def _signature(args) -> tuple:
    """What a specialised compilation depends on: every tensor's shape, strides, dtype and device, the
    scalars' values, and whether autograd records."""
    parts = [torch.is_grad_enabled()]
    for arg in args:
        if torch.is_tensor(arg):
            parts.append((tuple(arg.shape), arg.stride(), arg.dtype, arg.device, arg.requires_grad))
        else:  # scalars (eps, flags) by value; anything unhashable by its text
            parts.append((type(arg), arg if isinstance(arg, (bool, int, float, str, type(None))) else repr(arg)))
    return tuple(parts)


def _fresh_copy(fn):
    """The same function with its own code object: torch.compile keeps its compilations per code object, so
    each copy holds exactly its own (no sharing or evicting between the specialised variants)."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


class CudaCompiled:
    """Calls `fn` eagerly on CPU and a `torch.compile`d copy of it on CUDA.

    Each new argument signature (up to `_MAX_SPECIALISED`; later ones run eagerly) gets its own
    compilation with `dynamic=False`: sizes are constants, so the kernels index without integer
    divisions by runtime sizes. Not `dynamic=True`: on an H200 (torch 2.11, 2026-11-30) the symbolic-size
    compilation ran the cross-entropy gradient at about half speed and RoPE at half speed, and gave a
    wrong cross-entropy gradient (off by 1.0 at a target column against the fp32 formula) on logits
    split into several chunks; the specialised ones matched it to bf16 rounding (docs/performance.md,
    `benchmarks/gpu/ce_bench.py`).
    """

    def __init__(self, fn):
        self.fn = fn
        self._specialised = {}

    def _compiled_for(self, args):
        """[compiled function, proven] for these arguments (proven: it has run once without failing), or None
        once `_MAX_SPECIALISED` other signatures have their compilation (the caller runs `fn` eagerly)."""
        key = _signature(args)
        entry = self._specialised.get(key)
        if entry is None and len(self._specialised) < _MAX_SPECIALISED:
            entry = self._specialised[key] = [torch.compile(_fresh_copy(self.fn), dynamic=False), False]
        return entry

    def __call__(self, *args):
        first = args[0]
        # Inside a compiled region (a compiled transformer layer) the outer compiler fuses the eager code.
        # The mode is read at each call (not remembered), so a process may switch it.
        if torch.compiler.is_compiling() or not (torch.is_tensor(first) and first.is_cuda):
            return self.fn(*args)
        if eager_fusions_requested():
            return self.fn(*args)
        entry = self._compiled_for(args)
        if entry is None:
            return self.fn(*args)
        if entry[1]:
            return entry[0](*args)
        try:
            result = entry[0](*args)
        except torch._dynamo.exc.TorchDynamoException as error:
            raise RuntimeError(f"torch.compile of the fused {self.fn.__name__} failed (run the fusions as plain "
                               "PyTorch with --fusion-kernels eager, fusion_kernels='eager'): "
                               f"{type(error).__name__}: {error}") from error
        entry[1] = True
        return result
