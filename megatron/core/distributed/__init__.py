"""Data parallelism: DDP with bucketed, overlapped gradient reduction; gradient finalisation; FSDP2.

Names are Megatron Core 0.13.1's and are loaded lazily (PEP 562; the table is `megatron.core.reexports`) so
importing the package is cheap.
"""
from megatron.core.reexports import lazy_attribute, reexported_names

# `finalize_model_grads` is both a submodule and the function it defines. Bound lazily, the name would
# become the module as soon as anything imported the submodule first (the import system sets the parent's
# attribute once the submodule has loaded), e.g. `from megatron.core.distributed.finalize_model_grads import
# _allreduce_word_embedding_grads`; bound here, after that import, it stays the function, as in Megatron.
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

__all__ = ["finalize_model_grads", *reexported_names(__name__)]


def __getattr__(name):
    return lazy_attribute(__name__, name)
