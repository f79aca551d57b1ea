"""Dumping the arguments a module was built with to disk, for comparing two runs (`megatron.core.config_logger`).

A config whose `config_logger_dir` is non-empty has logging enabled. `log_config_to_disk(config, data, prefix)`
writes `data` (typically a constructor's `locals()`) to `<config_logger_dir>/<prefix>.rank_<ranks>.iter<N>.json`,
N counting the dumps of that name from 0; an OrderedDict (a state dict) is written with `torch.save` as `.pth`.
Values JSON cannot hold are written as Megatron writes them: dtypes, functions, classes and enums as their
`str`, dataclasses as dicts of their fields, modules as the dict of their children (a leaf as its `str`).
"""
import dataclasses
import enum
import json
import os
from collections import OrderedDict
from typing import Any, Dict

import torch

from megatron.core import parallel_state

_DUMP_COUNTS: Dict[str, int] = {}


def get_config_logger_path(config) -> str:
    """The directory dumps go to ('' when logging is off)."""
    return getattr(config, "config_logger_dir", "") or ""


def has_config_logger_enabled(config) -> bool:
    """Whether `config` asks for its modules' arguments to be dumped."""
    return get_config_logger_path(config) != ""


def get_path_with_count(path: str) -> str:
    """`path` with `.iter<N>` appended, N the number of earlier dumps to the same path."""
    count = _DUMP_COUNTS.get(path, 0)
    _DUMP_COUNTS[path] = count + 1
    return f"{path}.iter{count}"


class JSONEncoderWithMcoreTypes(json.JSONEncoder):
    """JSON encoder for the values found in Megatron constructors' arguments (see the module docstring)."""

    def default(self, o: Any) -> Any:
        """A JSON-able stand-in for `o` (called by `json` for every value it cannot encode itself)."""
        if isinstance(o, (dict, OrderedDict)):
            return {str(key): self._encode(value) for key, value in o.items()}
        if isinstance(o, (list, tuple, torch.nn.ModuleList)):
            return [self._encode(value) for value in o]
        if type(o).__name__ == "Float16Module":
            return {"Float16Module": {"module": self._encode(o.module)}}
        if isinstance(o, torch.nn.Module):
            children = dict(o.named_children())
            return {name: self._encode(child) for name, child in children.items()} if children else str(o)
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            return {field.name: self._encode(getattr(o, field.name)) for field in dataclasses.fields(o)}
        if isinstance(o, (torch.dtype, type, enum.Enum)) or callable(o):
            return str(o)
        try:
            return super().default(o)
        except TypeError:
            return str(o)

    def _encode(self, value: Any) -> Any:
        """`value` itself when JSON holds it as is, else its stand-in."""
        if value is None or isinstance(value, (str, int, float, bool)) and not isinstance(value, enum.Enum):
            return value
        return self.default(value)


def log_config_to_disk(config, dict_data: Dict[str, Any], prefix: str = "", rank_str: str = "") -> None:
    """Write `dict_data` under `config.config_logger_dir` (see the module docstring).

    A `self` entry is dropped and, without `prefix`, names the file after its class. `rank_str` defaults to
    this rank's coordinates from `parallel_state.get_all_ranks()` ('tp_cp_ep_dp_pp' style).
    """
    directory = get_config_logger_path(config)
    if not directory:
        raise ValueError("log_config_to_disk: config.config_logger_dir is empty (set --config-logger-dir).")
    os.makedirs(directory, exist_ok=True)
    if "self" in dict_data:
        prefix = prefix or type(dict_data["self"]).__name__
        dict_data = type(dict_data)((key, value) for key, value in dict_data.items() if key != "self")
    if not rank_str:
        rank_str = parallel_state.get_all_ranks()
    path = get_path_with_count(os.path.join(directory, f"{prefix}.rank_{rank_str}"))
    if isinstance(dict_data, OrderedDict):
        torch.save(dict_data, f"{path}.pth")
        return
    with open(f"{path}.json", "w", encoding="utf-8") as stream:
        json.dump(dict_data, stream, cls=JSONEncoderWithMcoreTypes)


__all__ = ["has_config_logger_enabled", "log_config_to_disk"]
