"""Read pickled checkpoint files (`common.pt`, legacy `model_optim_rng.pt`, ShardedObjects) safely.

Megatron-LM pickles an `argparse.Namespace` holding `torch.dtype`s and Megatron enums into its
checkpoints. We never unpickle arbitrary objects: files are read with `torch.load(weights_only=True)`
plus an explicit allow-list of the extra types such files contain. Any other type fails with a
`CheckpointingException` naming the type and the file.

Design note (name-based allow-list): the Megatron enums are listed by their pickled names
("megatron.core.transformer.enums.AttnBackend"), and resolved when a file is read: to our class
of the same path when it is importable, else to a stand-in enum with Megatron's members. This keeps
`dist_checkpointing` free of imports of the model packages that sit above it.
"""
import argparse
import collections
import enum
import importlib
import io
import os
import pickle
import re
from typing import Any, Callable, Dict, List, Union

import numpy as np
import torch

from megatron.core.dist_checkpointing.mapping import CheckpointingException


class _AttnBackendStandIn(enum.Enum):
    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5


class _AttnMaskTypeStandIn(enum.Enum):
    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5


class _ModelTypeStandIn(enum.Enum):
    encoder_or_decoder = 1
    encoder_and_decoder = 2
    retro_encoder = 3
    retro_decoder = 4


class _RerunModeStandIn(str, enum.Enum):
    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_DETERMINISM_STATS = "report_determinism_stats"


class _RerunStateStandIn(enum.Enum):
    NOT_RUNNING_YET = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    WILL_RERUN_FROM_CHECKPOINT = 3
    RERUNNING_FROM_CHECKPOINT = 4
    RERUNNING_AGAIN_FROM_CHECKPOINT = 5


class _RerunDiagnosticStandIn(str, enum.Enum):
    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


class _RecordStandIn(tuple):
    """Stands in for a NamedTuple of Megatron's (pickled as class + field values) of any arity."""

    def __new__(cls, *fields):
        return tuple.__new__(cls, fields)


class _CallerStandIn(_RecordStandIn):
    pass


class _CallStandIn(_RecordStandIn):
    pass


class _Fp8RecipeStandIn(str, enum.Enum):
    delayed = "delayed"
    tensorwise = "tensorwise"
    mxfp8 = "mxfp8"
    blockwise = "blockwise"


# Pickled name -> stand-in used when our class of that name cannot be imported. This is everything of
# Megatron's own that Megatron-LM 0.13.1 pickles into `common.pt`, its legacy `model_optim_rng.pt` and the
# ShardedObjects of a torch_dist checkpoint: the enums in its args Namespace (`attention_backend`, `model_type`,
# an Fp8Recipe where a recipe object is stored), and the rerun state machine's state (its mode, state and
# the error injector's diagnostic; a failed validation's `Call(Caller(...), sequence)` records).
MEGATRON_CLASSES: Dict[str, type] = {
    "megatron.core.transformer.enums.AttnBackend": _AttnBackendStandIn,
    "megatron.core.transformer.enums.AttnMaskType": _AttnMaskTypeStandIn,
    "megatron.core.transformer.enums.ModelType": _ModelTypeStandIn,
    "megatron.core.enums.ModelType": _ModelTypeStandIn,
    "megatron.core.enums.Fp8Recipe": _Fp8RecipeStandIn,
    "megatron.core.rerun_state_machine.RerunMode": _RerunModeStandIn,
    "megatron.core.rerun_state_machine.RerunState": _RerunStateStandIn,
    "megatron.core.rerun_state_machine.RerunDiagnostic": _RerunDiagnosticStandIn,
    "megatron.core.rerun_state_machine.Caller": _CallerStandIn,
    "megatron.core.rerun_state_machine.Call": _CallStandIn,
}

_PLAIN_GLOBALS: List[Any] = [
    argparse.Namespace,
    collections.OrderedDict,
    collections.defaultdict,
    collections.Counter,
    io.BytesIO,
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
    type(np.dtype(np.float32)),
    type(np.dtype(np.float64)),
    type(np.dtype(np.int64)),
]
_NUMPY_RECONSTRUCT_NAMES = ("numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct",
                            "numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar")
_user_globals: List[Any] = []


def register_safe_globals(globals_list: List[Any]) -> None:
    """Allow more types in checkpoint files (classes, or (class, "pickled.name") pairs)."""
    _user_globals.extend(globals_list)


def _resolve(name: str, stand_in: type) -> type:
    module_name, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError):
        return stand_in


def _numpy_globals() -> List[Any]:
    result = []
    for name in _NUMPY_RECONSTRUCT_NAMES:
        module_name, _, attr = name.rpartition(".")
        try:
            result.append((getattr(importlib.import_module(module_name), attr), name))
        except (ImportError, AttributeError):
            continue
    return result


def safe_globals() -> List[Any]:
    """The allow-list handed to `torch.serialization.safe_globals`."""
    megatron = [(_resolve(name, stand_in), name) for name, stand_in in MEGATRON_CLASSES.items()]
    return _PLAIN_GLOBALS + _numpy_globals() + megatron + list(_user_globals)


_GLOBAL_RE = re.compile(r"GLOBAL ([\w\.]+)")


def _describe_source(source: Union[str, os.PathLike, io.IOBase], name: str = None) -> str:
    if name:
        return name
    return str(source) if isinstance(source, (str, os.PathLike)) else "<in-memory checkpoint item>"


def safe_torch_load(source, map_location: Union[str, torch.device, Callable] = "cpu", name: str = None) -> Any:
    """`torch.load(source, weights_only=True)` with the checkpoint allow-list.

    Raises CheckpointingException naming the file when it is missing, truncated/corrupt, or holds a
    type that is not on the allow-list (the type is named).
    """
    where = _describe_source(source, name)
    if isinstance(source, (str, os.PathLike)) and not os.path.isfile(source):
        raise CheckpointingException(f"checkpoint file {where} is missing")
    try:
        with torch.serialization.safe_globals(safe_globals()):
            return torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        match = _GLOBAL_RE.search(str(exc))
        type_name = next((g for g in match.groups() if g), "unknown") if match else "unknown"
        raise CheckpointingException(
            f"refusing to load {where}: it contains the type {type_name}, which is not on the allow-list of "
            f"checkpoint types (plain data, tensors, torch dtypes, argparse.Namespace, numpy arrays and "
            f"Megatron enums). If you trust the file, allow the type with "
            f"megatron.core.dist_checkpointing.safe_load.register_safe_globals([{type_name.split('.')[-1]}])."
        ) from exc
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CheckpointingException(f"checkpoint file {where} is truncated or corrupt: {exc}") from exc
