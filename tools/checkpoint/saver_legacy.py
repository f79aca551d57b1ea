"""convert.py saver `legacy`: the same legacy `torch` layout writer as `core`."""
from tools.checkpoint.saver_core import add_arguments, save_checkpoint

__all__ = ["add_arguments", "save_checkpoint"]
