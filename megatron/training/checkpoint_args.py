"""Args as plain data, so checkpoints load with `torch.load(weights_only=True)`.

Megatron pickles the whole `argparse.Namespace` (with `torch.dtype`s and enums) into its checkpoints,
which forces an unrestricted unpickler on load. Here args are stored as a dict of str/int/float/bool/
None and lists of those: dtypes become `"torch.bfloat16"`, enums their value, anything else `str()`.
`plain_dict_to_args` turns such a dict back into a Namespace (dtype strings become dtypes again).
"""
import argparse
import enum
from typing import Any, Dict

import torch

_DTYPE_PREFIX = "torch."


def to_plain(value: Any) -> Any:
    """One value as plain data (recursively for lists, tuples and dicts)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, enum.Enum):
        return to_plain(value.value)
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    return str(value)


def args_to_plain_dict(args) -> Dict[str, Any]:
    """`vars(args)` with every value converted by `to_plain` (keys sorted, for stable files)."""
    return {key: to_plain(value) for key, value in sorted(vars(args).items())}


def _from_plain(value: Any) -> Any:
    if isinstance(value, str) and value.startswith(_DTYPE_PREFIX):
        candidate = getattr(torch, value[len(_DTYPE_PREFIX):], None)
        if isinstance(candidate, torch.dtype):
            return candidate
    return value


def plain_dict_to_args(plain: Dict[str, Any]) -> argparse.Namespace:
    """A Namespace from a stored plain dict (dtype strings restored; other values as stored)."""
    return argparse.Namespace(**{key: _from_plain(value) for key, value in plain.items()})
