"""convert.py loader `legacy`: the same legacy `torch` layout reader as `core` (local-spec names)."""
from tools.checkpoint.loader_core import add_arguments, load_checkpoint

__all__ = ["add_arguments", "load_checkpoint"]
