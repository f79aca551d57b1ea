"""Megatron-LM's command line: parse, validate, derive, and turn arguments into configs.

- `parser.py` builds `argparse.ArgumentParser(description='Megatron-LM Arguments', allow_abbrev=False)`
  from one module per Megatron argument group (`network.py`, `training_loop.py`, ...);
- `manifest.json` records for every Megatron-LM 0.13.1 flag whether it is supported, accepted without
  effect, or rejected, and marks the few flags this framework adds (`plan_flags.py`, the optimisation plan);
- `validate.py` collects every problem and raises one `ArgumentsError`; `derive.py` computes derived values;
- `to_configs.py` is the one place arguments become `TransformerConfig` / `OptimizerConfig` /
  `DistributedDataParallelConfig` (imported lazily: it pulls in the model packages).
"""
import importlib

from megatron.training.arguments._spec import _check_arg_is_not_none, moe_freq_type, no_rope_freq_type
from megatron.training.arguments.derive import derive
from megatron.training.arguments.errors import ArgumentsError, exit_on_arguments_error
from megatron.training.arguments.parser import (
    _parse,
    _print_args,
    add_megatron_arguments,
    build_parser,
    get_rank_and_world_size,
    parse_args,
    set_rank_and_world_size,
)
from megatron.training.arguments.validate import apply_args_defaults, validate_args

_LAZY_ATTRS = {
    "core_transformer_config_from_args": "megatron.training.arguments.to_configs",
    "optimizer_config_from_args": "megatron.training.arguments.to_configs",
    "ddp_config_from_args": "megatron.training.arguments.to_configs",
}

__all__ = [
    "ArgumentsError", "exit_on_arguments_error", "parse_args", "_parse", "validate_args", "derive",
    "apply_args_defaults", "build_parser", "add_megatron_arguments", "get_rank_and_world_size",
    "set_rank_and_world_size", "_print_args", "moe_freq_type", "no_rope_freq_type", "_check_arg_is_not_none",
    *_LAZY_ATTRS,
]


def __getattr__(name):
    if name in _LAZY_ATTRS:
        value = getattr(importlib.import_module(_LAZY_ATTRS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'megatron.training.arguments' has no attribute {name!r}")
