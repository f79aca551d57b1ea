"""Small helpers shared by the dataset classes: the split enum, weight normalisation, blend parsing.

`compile_helpers()` exists for API compatibility only: the index builders here are vectorised numpy
(`megatron.core.datasets.helpers`), so there is nothing to compile.
"""
import logging
from enum import Enum
from typing import Any, List, Optional, Tuple

import numpy
import torch

logger = logging.getLogger(__name__)


class Split(Enum):
    """The three dataset splits, in the order used by every size and blend list."""

    train = 0
    valid = 1
    test = 2


def compile_helpers() -> None:
    """Megatron compiles a C++ helper here; this project's helpers are pure numpy, so this is a no-op."""
    return None


def log_single_rank(log: logging.Logger, *args: Any, rank: int = 0, **kwargs: Any) -> None:
    """Log through `log` only on global rank `rank` (always when torch.distributed is not initialised)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_rank() != rank:
            return
    log.log(*args, **kwargs)


def normalize(weights: List[float]) -> List[float]:
    """Scale `weights` so they sum to 1 (numpy division, as Megatron does, so the floats match bit for bit)."""
    w_array = numpy.array(weights, dtype=numpy.float64)
    w_sum = numpy.sum(w_array)
    return (w_array / w_sum).tolist()


def get_blend_from_list(
    blend: Optional[List[str]],
) -> Optional[Tuple[List[str], Optional[List[float]]]]:
    """Turn a `--data-path`-style list into `(prefixes, weights)`.

    An odd-length list holds prefixes only (weights None). An even-length list is read as
    `w1 p1 w2 p2 ...`; if any weight fails `float()`, the whole list is taken as prefixes.
    """
    if blend is None:
        return None
    if len(blend) % 2 == 1:
        return [str(p).strip() for p in blend], None
    raw_weights = blend[0::2]
    prefixes = [str(p).strip() for p in blend[1::2]]
    try:
        weights = [float(w) for w in raw_weights]
    except ValueError:
        return [str(p).strip() for p in blend], None
    return prefixes, weights
