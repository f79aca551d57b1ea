"""`ModuleSpec` and `build_module`: layers are described as data and built from it.

A spec names a module (a class, a function, or an importable `(module_path, name)` pair), the keyword
arguments it is built with, and the submodule specs passed down as `submodules=`.
"""
import types
from dataclasses import dataclass, field
from typing import Tuple, Union


@dataclass
class ModuleSpec:
    """What to build: `module(*args, **params, **kwargs, submodules=submodules)`."""

    module: Union[Tuple, type]
    """The class or function to build, or an importable `(module_path, name)` pair."""

    params: dict = field(default_factory=lambda: {})
    """Keyword arguments passed to `module` when it is built."""

    submodules: type = None
    """A submodules dataclass passed to `module` as `submodules=` (omitted when None)."""


def import_module(module_path: Tuple[str, str]):
    """Import `name` from `base_path` given as the pair `(base_path, name)`."""
    base_path, name = module_path
    try:
        module = __import__(base_path, globals(), locals(), [name])
    except ImportError as error:
        raise ImportError(f"couldn't import module {base_path} ({error})") from error
    return vars(module)[name]


def get_module(spec_or_module: Union[ModuleSpec, type], **additional_kwargs):
    """The class or function a spec names (imported when it is a path pair), not instantiated."""
    if isinstance(spec_or_module, (type, types.FunctionType)):
        return spec_or_module
    if isinstance(spec_or_module.module, (type, types.FunctionType)):
        return spec_or_module.module
    return import_module(spec_or_module.module)


def build_module(spec_or_module: Union[ModuleSpec, type], *args, **kwargs):
    """Instantiate a spec, a class or an importable pair; functions are returned as they are."""
    if isinstance(spec_or_module, types.FunctionType):
        return spec_or_module
    if isinstance(spec_or_module, ModuleSpec) and isinstance(spec_or_module.module, types.FunctionType):
        return spec_or_module.module

    if isinstance(spec_or_module, type):
        module = spec_or_module
    elif hasattr(spec_or_module, "module") and isinstance(spec_or_module.module, type):
        module = spec_or_module.module
    else:
        module = import_module(spec_or_module.module)

    if isinstance(module, types.FunctionType):
        return module

    params = getattr(spec_or_module, "params", None) or {}
    submodules = getattr(spec_or_module, "submodules", None)
    if submodules is not None:
        kwargs["submodules"] = submodules
    try:
        return module(*args, **params, **kwargs)
    except Exception as error:
        try:
            renamed = type(error)(f"{str(error)} when instantiating {module.__name__}")
        except Exception:
            raise error
        raise renamed.with_traceback(error.__traceback__) from None


__all__ = ["ModuleSpec", "build_module", "import_module", "get_module"]
