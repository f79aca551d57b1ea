"""Lazy `torch.compile` for elementwise fusions: used only on CUDA tensors, never on CPU.

Compiling costs seconds on first use and gives no speed-up for these elementwise chains on CPU, so
CPU tensors always take the eager path. A compile failure (at construction or on the first call)
falls back to eager once and for all. Setting the environment variable `MEGATRON_EAGER_FUSIONS=1`
keeps every fusion eager on CUDA too (the plain reference path for numerics comparisons).
"""
import logging
import os

import torch

logger = logging.getLogger(__name__)


def eager_fusions_requested() -> bool:
    """True when `MEGATRON_EAGER_FUSIONS=1` asks for the eager reference path on CUDA."""
    return os.environ.get("MEGATRON_EAGER_FUSIONS", "0") == "1"


class CudaCompiled:
    """Calls `fn` eagerly on CPU and a `torch.compile`d copy of it on CUDA."""

    def __init__(self, fn):
        self.fn = fn
        self._compiled = None
        self._failed = False
        self._proven = False

    def __call__(self, *args):
        first = args[0]
        # Inside a compiled region (a compiled transformer layer) the outer compiler fuses the eager code.
        if self._failed or torch.compiler.is_compiling() or not (torch.is_tensor(first) and first.is_cuda):
            return self.fn(*args)
        if self._compiled is None:
            if eager_fusions_requested():
                self._failed = True
                return self.fn(*args)
            self._compiled = torch.compile(self.fn, dynamic=True)
        if self._proven:
            return self._compiled(*args)
        try:
            result = self._compiled(*args)
        except Exception as error:  # any compiler failure: the eager function computes the same result
            logger.warning("torch.compile of %s failed (%s); using the eager version.", self.fn.__name__, error)
            self._failed = True
            return self.fn(*args)
        self._proven = True
        return result
