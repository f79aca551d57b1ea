"""`--yaml-cfg`: Megatron-LM's YAML config files (the layout of its `examples/gpt3/gpt_config.yaml`).

Layout, as in Megatron: a `language_model:` mapping of `TransformerConfig` field names, a `model_parallel:`
mapping of `ModelParallelConfig` field names, and every other top-level key an argument name (the `dest`
of a flag: `micro_batch_size`, `lr`, `data_path`, ...). `${VAR}` inside a string is replaced by the
environment variable VAR (an error when unset), as Megatron's loader does.

How it is applied: the file becomes *parser defaults* (`load_yaml_defaults`), then the command line is
parsed as usual. So a YAML run goes through the same validation, derivation and the one args -> config
translation (`arguments/to_configs.py`) as a command-line run, and a flag given beside `--yaml-cfg` wins
over the file (Megatron ignores such flags; runs that pass only `--yaml-cfg` behave the same).

Config field names that differ from argument names are translated back (the reverse of
`to_configs.TRANSFORMER_RENAMES`: `layernorm_epsilon` -> `norm_epsilon`, `num_moe_experts` ->
`num_experts`, `activation_func: swiglu` -> `swiglu`, ...). A field no flag sets is accepted when it holds
its default or null (Megatron's example file lists runtime hooks such as `timers: null`) and is an error
otherwise. Every problem of the file is collected and reported with the other argument problems.
"""
import argparse
import dataclasses
import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

NESTED_SECTIONS = ("language_model", "model_parallel")

# Keys of Megatron's example files that name options Megatron Core 0.13.1 no longer has.
OBSOLETE_KEYS = {
    "async_tensor_model_parallel_allreduce": "removed from ModelParallelConfig (always asynchronous)",
    "delay_grad_reduce": "removed from Megatron's arguments",
    "delay_param_gather": "removed from Megatron's arguments",
    "scatter_gather_tensors_in_pipeline": "removed from Megatron's arguments",
    "moe_token_dropping": "MoE option without a flag (token dropping follows --moe-expert-capacity-factor)",
}

_ENV_PATTERN = re.compile(r"\$\{([^}{]+)\}")
_ACTIVATIONS = {"swiglu": "swiglu", "squared_relu": "squared_relu", "openai_gelu": "openai_gelu", "gelu": None}


def _substitute_env(value: Any, where: str, problems: List[str]) -> Any:
    """`${VAR}` replaced in every string of `value` (recursively)."""
    if isinstance(value, dict):
        return {key: _substitute_env(item, f"{where}.{key}", problems) for key, item in value.items()}
    if isinstance(value, list):
        return [_substitute_env(item, where, problems) for item in value]
    if not isinstance(value, str):
        return value

    def replace(match):
        name = match.group(1)
        if name not in os.environ:
            problems.append(f"--yaml-cfg: {where} uses ${{{name}}} but the environment variable {name} is not set: "
                            "export it or write the value into the file.")
            return match.group(0)
        return os.environ[name]

    return _ENV_PATTERN.sub(replace, value)


def read_yaml(path: str, problems: List[str]) -> Dict[str, Any]:
    """The file's mapping with environment variables substituted ({} after a problem)."""
    try:
        import yaml
    except ImportError:
        problems.append(f"--yaml-cfg {path}: PyYAML is not installed: pip install pyyaml (or megatron-lite[yaml]).")
        return {}
    try:
        with open(path) as handle:
            content = yaml.safe_load(handle)
    except OSError as err:
        problems.append(f"--yaml-cfg {path}: cannot read the file ({err.strerror}): give an existing YAML file.")
        return {}
    except yaml.YAMLError as err:
        problems.append(f"--yaml-cfg {path}: not valid YAML ({err}).")
        return {}
    if content is None:
        return {}
    if not isinstance(content, dict):
        problems.append(f"--yaml-cfg {path}: the top level must be a mapping of argument names, "
                        f"got {type(content).__name__}.")
        return {}
    return _substitute_env(content, "", problems)


def _config_field_defaults() -> Dict[str, Any]:
    """Default of every TransformerConfig / ModelParallelConfig field (MISSING for required ones)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    defaults = {}
    for field in dataclasses.fields(TransformerConfig):
        if field.default is not dataclasses.MISSING:
            defaults[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            defaults[field.name] = field.default_factory()
        else:
            defaults[field.name] = dataclasses.MISSING
    return defaults


def _translate_config_key(key: str, value: Any, section: str, dests: set, problems: List[str]) -> Dict[str, Any]:
    """Argument values for one `language_model` / `model_parallel` entry."""
    where = f"{section}.{key}"
    if key == "activation_func":
        if value not in _ACTIVATIONS:
            problems.append(f"--yaml-cfg: {where} is {value!r}; allowed: {sorted(_ACTIVATIONS)}.")
            return {}
        return {_ACTIVATIONS[value]: True} if _ACTIVATIONS[value] else {}
    renamed = {
        "layernorm_epsilon": ("norm_epsilon", value),
        "layernorm_zero_centered_gamma": ("apply_layernorm_1p", value),
        "persist_layer_norm": ("no_persist_layer_norm", not value),
        "num_moe_experts": ("num_experts", value),
        "bias_activation_fusion": ("bias_gelu_fusion", value),
        "num_layers_in_first_pipeline_stage": ("decoder_first_pipeline_num_layers", value),
        "num_layers_in_last_pipeline_stage": ("decoder_last_pipeline_num_layers", value),
        "fp8_param": ("fp8_param_gather", value),
    }
    if key in renamed:
        dest, translated = renamed[key]
        return {dest: translated}
    if key == "num_query_groups" and value is not None:
        return {"num_query_groups": value, "group_query_attention": True}
    if key == "gated_linear_unit":
        return {}  # follows activation_func / swiglu, as in Megatron's YAML path
    if key in dests:
        return {key: value}
    if key in OBSOLETE_KEYS:
        return {}
    defaults = _config_field_defaults()
    if key not in defaults:
        problems.append(f"--yaml-cfg: {where} is not a field of TransformerConfig / ModelParallelConfig: "
                        "check its spelling against megatron/core/transformer/transformer_config.py.")
    elif value is not None and value != defaults[key]:
        problems.append(f"--yaml-cfg: {where} = {value!r}: no flag sets this field here, so only its default "
                        f"({defaults[key]!r}) or null is accepted: remove the line.")
    return {}


def _coerce(action: argparse.Action, value: Any, where: str, problems: List[str]) -> Tuple[bool, Any]:
    """(ok, value) converted the way the command line would convert it."""
    if value is None:
        return True, None
    if action.nargs in ("*", "+") or (isinstance(action.nargs, int) and action.nargs > 1):
        items = value.split() if isinstance(value, str) else value
        if not isinstance(items, list):
            items = [items]
        converted = []
        for item in items:
            ok, item = _coerce_scalar(action, item, where, problems)
            if not ok:
                return False, None
            converted.append(item)
        return True, converted
    if isinstance(value, list):
        problems.append(f"--yaml-cfg: {where} is a list {value!r} but its flag takes one value: give one value.")
        return False, None
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            problems.append(f"--yaml-cfg: {where} is {value!r}; it is a switch: write true or false.")
            return False, None
        return True, value
    return _coerce_scalar(action, value, where, problems)


def _coerce_scalar(action: argparse.Action, value: Any, where: str, problems: List[str]) -> Tuple[bool, Any]:
    convert = action.type if callable(action.type) else None
    try:
        if convert is int and not isinstance(value, str):
            if isinstance(value, bool) or not float(value).is_integer():
                raise ValueError("it must be an integer")
            value = int(value)
        elif convert is float and not isinstance(value, str):
            if isinstance(value, bool):
                raise ValueError("it must be a number")
            value = float(value)
        elif convert is not None:
            value = convert(value if isinstance(value, str) else str(value))
    except (TypeError, ValueError, argparse.ArgumentTypeError) as err:
        problems.append(f"--yaml-cfg: {where} is {value!r}, not a valid value ({err}).")
        return False, None
    if action.choices is not None and value not in action.choices:
        problems.append(f"--yaml-cfg: {where} is {value!r}; allowed: {list(action.choices)}.")
        return False, None
    return True, value


def load_yaml_defaults(path: str, parser: argparse.ArgumentParser) -> Tuple[Dict[str, Any], List[str]]:
    """({argument dest: value}, problems) from a Megatron YAML config, for `parser.set_defaults`."""
    problems: List[str] = []
    content = read_yaml(path, problems)
    actions = {action.dest: action for action in parser._actions if action.option_strings}
    dests = set(actions)
    flat: Dict[str, Tuple[str, Any]] = {}
    for key, value in content.items():
        if key in NESTED_SECTIONS:
            if value is None:
                continue
            if not isinstance(value, dict):
                problems.append(f"--yaml-cfg: {key} must be a mapping of config fields, got {value!r}.")
                continue
            for sub_key, sub_value in value.items():
                for dest, translated in _translate_config_key(sub_key, sub_value, key, dests, problems).items():
                    flat[dest] = (f"{key}.{sub_key}", translated)
        elif key in dests:
            flat[key] = (key, value)
        elif key not in OBSOLETE_KEYS:
            problems.append(f"--yaml-cfg: top-level key {key!r} is not an argument name (the dest of a flag, "
                            "e.g. micro_batch_size for --micro-batch-size): fix or remove it.")
    defaults = {}
    for dest, (where, value) in flat.items():
        if dest == "yaml_cfg":
            continue
        ok, converted = _coerce(actions[dest], value, where, problems)
        if ok:
            defaults[dest] = converted
    return defaults, problems


def yaml_cfg_path(argv: Sequence[str]) -> Optional[str]:
    """The value of `--yaml-cfg` in `argv` (last one wins), or None."""
    path = None
    for index, item in enumerate(argv):
        if item == "--yaml-cfg" and index + 1 < len(argv):
            path = argv[index + 1]
        elif item.startswith("--yaml-cfg="):
            path = item.split("=", 1)[1]
    return path


def load_yaml(yaml_path: str, extra_args_provider=None):
    """Megatron-LM's `load_yaml(yaml_path)`: the arguments of a YAML config (with `args.yaml_cfg`, `args.rank`
    and `args.world_size` set). Unlike Megatron's nested namespace, the result is the flat argument namespace
    every other entry point uses (`args.num_layers`, not `args.language_model.num_layers`)."""
    from megatron.training.arguments import _parse, set_rank_and_world_size

    return set_rank_and_world_size(_parse(["--yaml-cfg", yaml_path], extra_args_provider))


def validate_yaml(args, defaults=None):
    """Megatron-LM's `validate_yaml(args, defaults={})`: the same checks and derivations as `validate_args`."""
    from megatron.training.arguments import validate_args

    return validate_args(args, defaults or {})


def core_transformer_config_from_yaml(args, transfomer_key: str = "language_model"):
    """Megatron-LM's `core_transformer_config_from_yaml(args, transfomer_key)` (its spelling): the
    `TransformerConfig` of YAML-loaded args, built by the one args -> config translation."""
    from megatron.training.arguments import core_transformer_config_from_args

    return core_transformer_config_from_args(args)
