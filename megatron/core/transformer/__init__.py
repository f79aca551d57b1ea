"""Transformer building blocks (Megatron Core names), re-exported lazily (`megatron.core.reexports`)."""
from megatron.core.reexports import lazy_attribute, reexported_names

__all__ = reexported_names(__name__)


def __getattr__(name):
    return lazy_attribute(__name__, name)
