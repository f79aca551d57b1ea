"""Building the Megatron-LM parser and parsing a command line.

`parse_args()` keeps Megatron-LM's signature and reads `sys.argv`; it delegates to the pure
`_parse(argv, ...)`, which tests call directly. Unknown flags never make argparse exit: they are kept on
the namespace (`args._unknown_args`, removed again by `validate_args`) so that they are reported together
with every validation problem, each with a "did you mean" suggestion when one is close. Malformed values
are collected too: the offending flag is dropped and parsing retried, so one run reports them all.
"""
import argparse
import difflib
import os
import sys
from functools import lru_cache
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

from megatron.training.arguments.checkpointing import _add_checkpointing_args
from megatron.training.arguments.data import _add_data_args, _add_tokenizer_args
from megatron.training.arguments.distributed import _add_distributed_args
from megatron.training.arguments.engines import _add_inference_args, _add_transformer_engine_args
from megatron.training.arguments.errors import ArgumentsError
from megatron.training.arguments.logging_flags import _add_config_logger_args, _add_logging_args
from megatron.training.arguments.moe import _add_heterogeneous_args, _add_mla_args, _add_moe_args
from megatron.training.arguments.network import _add_network_size_args
from megatron.training.arguments.operations import (
    _add_autoresume_args,
    _add_ft_package_args,
    _add_inprocess_restart_args,
    _add_msc_args,
    _add_one_logger_args,
    _add_rerun_machine_args,
    _add_straggler_detector_args,
    _add_workload_inspector_server_args,
)
from megatron.training.arguments.optimization import (
    _add_learning_rate_args,
    _add_mixed_precision_args,
    _add_regularization_args,
)
from megatron.training.arguments.other_models import (
    _add_biencoder_args,
    _add_experimental_args,
    _add_kitchen_quantization_arguments,
    _add_retro_args,
    _add_sft_args,
    _add_vision_args,
)
from megatron.training.arguments.plan_flags import _add_optimization_plan_args
from megatron.training.arguments.training_loop import (
    _add_initialization_args,
    _add_training_args,
    _add_validation_args,
)

# Megatron-LM's group order (it decides the order of `--help`), then this framework's own group.
_GROUP_ADDERS = (
    _add_network_size_args, _add_regularization_args, _add_training_args, _add_initialization_args,
    _add_learning_rate_args, _add_checkpointing_args, _add_mixed_precision_args, _add_distributed_args,
    _add_validation_args, _add_data_args, _add_tokenizer_args, _add_autoresume_args, _add_biencoder_args,
    _add_vision_args, _add_moe_args, _add_mla_args, _add_heterogeneous_args, _add_logging_args,
    _add_straggler_detector_args, _add_workload_inspector_server_args, _add_inference_args,
    _add_transformer_engine_args, _add_retro_args, _add_experimental_args, _add_one_logger_args,
    _add_inprocess_restart_args, _add_ft_package_args, _add_config_logger_args, _add_rerun_machine_args,
    _add_msc_args, _add_kitchen_quantization_arguments, _add_sft_args, _add_optimization_plan_args,
)

UNKNOWN_ARGS_ATTR = "_unknown_args"


class _ParseFailure(Exception):
    """Raised instead of argparse's exit so the message can join the other problems."""


class MegatronArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise (to be collected) instead of printing and exiting."""

    def error(self, message):
        raise _ParseFailure(message)


def add_megatron_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every Megatron-LM 0.13.1 argument group to `parser`, in Megatron's order, then the flags this
    framework adds (`plan_flags.py`)."""
    for add_group_args in _GROUP_ADDERS:
        parser = add_group_args(parser)
    return parser


def build_parser(extra_args_provider: Optional[Callable] = None) -> argparse.ArgumentParser:
    """The full parser: `description='Megatron-LM Arguments'`, `allow_abbrev=False`, plus extra args."""
    parser = MegatronArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False, exit_on_error=False)
    parser = add_megatron_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


@lru_cache(maxsize=1)
def megatron_actions() -> Tuple[argparse.Action, ...]:
    """The actions of the plain Megatron parser (used to look up option strings and defaults)."""
    return tuple(action for action in build_parser()._actions if action.option_strings and action.dest != "help")


def _parse(argv: Sequence[str], extra_args_provider: Optional[Callable] = None, ignore_unknown_args: bool = False):
    """Parse `argv` (without the program name) into a Namespace; never exits, never reads sys.argv.

    Malformed values (a type error, a bad choice, a missing value) are all collected and raised together
    with any unknown flags as one `ArgumentsError`. Otherwise unknown flags are stored as problem messages
    on `args._unknown_args` (unless `ignore_unknown_args`) for `validate_args` to report.
    """
    parser = build_parser(extra_args_provider)
    argv, value_problems = list(argv), []
    yaml_problems = _apply_yaml_cfg(parser, argv)
    while True:
        try:
            args, unknown = parser.parse_known_args(argv)
            break
        except argparse.ArgumentError as err:
            value_problems.append(f"{err}.")
            remaining = _drop_flag(argv, err.argument_name, parser)
            if remaining == argv:
                raise ArgumentsError(value_problems) from None
            argv = remaining
        except _ParseFailure as failure:
            raise ArgumentsError(value_problems + [str(failure)]) from None
    unknown_problems = yaml_problems + ([] if ignore_unknown_args else describe_unknown_args(unknown, parser))
    if value_problems:
        raise ArgumentsError(value_problems + unknown_problems)
    setattr(args, UNKNOWN_ARGS_ATTR, unknown_problems)
    return args


def _apply_yaml_cfg(parser: argparse.ArgumentParser, argv: Sequence[str]) -> List[str]:
    """With `--yaml-cfg FILE` in argv: the file's values become the parser's defaults (flags still win).
    Returns the file's problems, reported with the others by `validate_args`."""
    from megatron.training import yaml_arguments

    path = yaml_arguments.yaml_cfg_path(argv)
    if path is None:
        return []
    defaults, problems = yaml_arguments.load_yaml_defaults(path, parser)
    parser.set_defaults(**defaults)
    return problems


def _drop_flag(argv: List[str], argument_name: Optional[str], parser) -> List[str]:
    """`argv` without every occurrence of the flag named in an argparse error (and the values after it)."""
    names = set((argument_name or "").split("/"))
    kept, skipping = [], False
    for item in argv:
        if item.startswith("-") and not _looks_like_number(item):
            skipping = item in names  # only the space-separated form has values after it
            if item.split("=", 1)[0] in names:
                continue
        elif skipping:
            continue
        kept.append(item)
    return kept


def describe_unknown_args(unknown: Sequence[str], parser: argparse.ArgumentParser) -> List[str]:
    """One message per unknown flag (with the values that followed it), suggesting a close known flag."""
    known = [s for action in parser._actions for s in action.option_strings]
    problems, current = [], None
    for item in unknown:
        if item.startswith("-") and not _looks_like_number(item):
            if current:
                problems.append(_unknown_message(current, known))
            current = [item]
        elif current is not None:
            current.append(item)
        else:
            problems.append(f"unexpected value {item!r} (no flag takes it): remove it or put a flag before it.")
    if current:
        problems.append(_unknown_message(current, known))
    return problems


def _looks_like_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _unknown_message(words: List[str], known: List[str]) -> str:
    name = words[0].split("=", 1)[0]
    shown = " ".join(words)
    message = f"unrecognized argument {shown}"
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    if close:
        message += f": did you mean {close[0]}? (flags must be spelled in full; prefixes are not accepted)"
    else:
        message += ": it is not a Megatron-LM flag; see --help for the flag list"
    return message + "."


def get_rank_and_world_size(environ: Optional[Mapping[str, str]] = None) -> Tuple[int, int]:
    """(RANK, WORLD_SIZE) from the launcher's environment (torchrun, SLURM wrappers), defaulting to (0, 1)."""
    environ = os.environ if environ is None else environ
    values = []
    for name, default in (("RANK", "0"), ("WORLD_SIZE", "1")):
        raw = environ.get(name, default)
        try:
            values.append(int(raw))
        except ValueError:
            message = f"environment variable {name}={raw!r} is not an integer: fix the launcher."
            raise ArgumentsError([message]) from None
    return values[0], values[1]


def set_rank_and_world_size(args, environ: Optional[Mapping[str, str]] = None):
    """Set `args.rank` and `args.world_size` from the environment, as Megatron-LM's parse_args does."""
    args.rank, args.world_size = get_rank_and_world_size(environ)
    return args


def parse_args(extra_args_provider: Optional[Callable] = None, ignore_unknown_args: bool = False):
    """Megatron-LM's `parse_args`: parse `sys.argv[1:]` and set `args.rank` / `args.world_size`."""
    args = _parse(sys.argv[1:], extra_args_provider, ignore_unknown_args)
    return set_rank_and_world_size(args)


def _print_args(title: str, args) -> None:
    """Print every argument as `  name ........ value` (sorted case-insensitively) on rank 0."""
    if getattr(args, "rank", 0) != 0:
        return
    print(f"------------------------ {title} ------------------------", flush=True)
    lines = []
    for name, value in vars(args).items():
        if name.startswith("_"):
            continue
        dots = "." * (48 - len(name))
        lines.append(f"  {name} {dots} {value}")
    for line in sorted(lines, key=lambda text: text.lower()):
        print(line, flush=True)
    print(f"-------------------- end of {title} ---------------------", flush=True)
