"""Megatron Core compatible library.

Names are re-exported lazily (PEP 562; the table is `megatron.core.reexports`) so that `import megatron.core`
never imports torch submodules it does not need, never prints, and never touches CUDA.
"""
from megatron.core.package_info import __version__
from megatron.core.reexports import lazy_attribute, reexported_names

__all__ = ["__version__", *reexported_names(__name__)]


def __getattr__(name):
    return lazy_attribute(__name__, name)
