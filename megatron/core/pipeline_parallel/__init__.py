"""Pipeline parallelism: schedules as data (`schedule_table`), one runner (`executor`), p2p transfers.

`get_forward_backward_func` is re-exported lazily (PEP 562; the table is `megatron.core.reexports`) so
importing the package stays cheap.
"""
from megatron.core.reexports import lazy_attribute, reexported_names

__all__ = reexported_names(__name__)


def __getattr__(name):
    return lazy_attribute(__name__, name)
