"""Flag tables and the argument types Megatron-LM's parser uses.

Every argument group module lists its flags as a tuple of `Flag(...)` entries (the same option strings and
keyword arguments as Megatron-LM 0.13.1's `add_argument` calls) and registers them with `add_group`.
Keeping the flags as data makes the compatibility test (parser == manifest == Megatron's flag list) a
plain comparison, and keeps each group readable as a table.

Design note (list expressions): `--moe-layer-freq` and `--no-rope-freq` accept a Python list expression
such as `([1]*3+[0])*2`. Megatron passes the string to `eval`; here a small AST walker accepts only list
literals, integers, `+` and `*`, so a command line can never run code.
"""
import argparse
import ast
from typing import Any, NamedTuple

from megatron.core.transformer.enums import AttnBackend


class Flag(NamedTuple):
    """One `add_argument` call: its option strings and keyword arguments."""

    option_strings: tuple
    kwargs: dict


def flag(*option_strings: str, **kwargs: Any) -> Flag:
    """Describe a flag exactly as `parser.add_argument(*option_strings, **kwargs)` would."""
    return Flag(tuple(option_strings), kwargs)


def add_group(parser: argparse.ArgumentParser, title: str, flags, help_for=None) -> argparse.ArgumentParser:
    """Register `flags` in an argument group called `title` (Megatron's group titles).

    `help_for(option_string, help)` returns the help text shown by `--help` (e.g. the table's help plus the
    flag's manifest status).
    """
    group = parser.add_argument_group(title=title)
    for entry in flags:
        kwargs = dict(entry.kwargs)
        if help_for is not None:
            kwargs["help"] = help_for(entry.option_strings[0], kwargs.get("help"))
        group.add_argument(*entry.option_strings, **kwargs)
    return parser


_ALLOWED_BINOPS = (ast.Add, ast.Mult)


def _eval_int_list_expression(text: str):
    """Evaluate an expression built from integers, list literals, `+` and `*` (e.g. "([1]*3+[0])*2")."""
    tree = ast.parse(text.strip(), mode="eval")

    def evaluate(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            return [evaluate(element) for element in node.elts]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -evaluate(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, _ALLOWED_BINOPS):
            left, right = evaluate(node.left), evaluate(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(f"unsupported element {ast.dump(node)}")

    return evaluate(tree.body)


def _int_or_int_list(value, what: str):
    """An int (every N-th layer) or a per-layer list given as a list expression containing '['."""
    if isinstance(value, int):
        return value
    if "[" in value:
        try:
            result = _eval_int_list_expression(value)
        except (SyntaxError, ValueError, TypeError) as err:
            raise argparse.ArgumentTypeError(
                f"{what} {value!r} is not an int or a list expression such as '([1]*3+[0])*2': {err}"
            ) from err
        if not isinstance(result, list) or not all(type(x) is int for x in result):
            raise argparse.ArgumentTypeError(f"{what} {value!r} must evaluate to a list of ints, got {result!r}")
        return result
    try:
        return int(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{what} {value!r} is not an int or a list expression") from err


def moe_freq_type(value):
    """`--moe-layer-freq`: an int N (an MoE layer every N layers) or a per-layer 0/1 list expression."""
    return _int_or_int_list(value, "--moe-layer-freq")


def no_rope_freq_type(value):
    """`--no-rope-freq`: an int N (every N-th layer skips RoPE) or a per-layer 0/1 list expression."""
    return _int_or_int_list(value, "--no-rope-freq")


def _check_arg_is_not_none(args, arg: str) -> None:
    """Raise ValueError when `args.<arg>` is None (Megatron's helper for argument checks)."""
    if getattr(args, arg) is None:
        raise ValueError(f"--{arg.replace('_', '-')} argument is None: give it a value.")


def attention_backend_type(value):
    """`--attention-backend`: the name of an `AttnBackend` member (`flash`, `fused`, `unfused`, `local`, `auto`)."""
    if isinstance(value, AttnBackend):
        return value
    try:
        return AttnBackend[value]
    except KeyError as err:
        raise argparse.ArgumentTypeError(
            f"--attention-backend {value!r} is not one of {', '.join(m.name for m in AttnBackend)}"
        ) from err


ATTN_BACKENDS = list(AttnBackend)
DEFAULT_ATTN_BACKEND = AttnBackend.auto
