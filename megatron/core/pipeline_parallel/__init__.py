"""Pipeline parallelism: schedules as data (`schedule_table`), one runner (`executor`), p2p transfers.

`get_forward_backward_func` is re-exported lazily (PEP 562) so importing the package stays cheap.
"""
import importlib

__all__ = ["get_forward_backward_func"]


def __getattr__(name):
    if name == "get_forward_backward_func":
        value = importlib.import_module("megatron.core.pipeline_parallel.schedules").get_forward_backward_func
        globals()[name] = value
        return value
    raise AttributeError(f"module 'megatron.core.pipeline_parallel' has no attribute {name!r}")
