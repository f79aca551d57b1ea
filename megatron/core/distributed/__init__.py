"""Data parallelism: DDP with bucketed, overlapped gradient reduction; gradient finalisation; FSDP2.

Names are Megatron Core 0.13.1's and are loaded lazily (PEP 562; the table is `megatron.core.reexports`) so
importing the package is cheap.
"""
from megatron.core.reexports import lazy_attribute, reexported_names

__all__ = reexported_names(__name__)


def __getattr__(name):
    return lazy_attribute(__name__, name)
