"""The Megatron-LM framework layer: CLI, global state, the training loop, checkpoints, logging.

Names are re-exported lazily so that importing the package stays cheap.
"""
import importlib

_LAZY_ATTRS = {
    "get_args": "megatron.training.global_vars",
    "get_signal_handler": "megatron.training.global_vars",
    "get_timers": "megatron.training.global_vars",
    "get_tokenizer": "megatron.training.global_vars",
    "get_tensorboard_writer": "megatron.training.global_vars",
    "get_wandb_writer": "megatron.training.global_vars",
    "get_one_logger": "megatron.training.global_vars",
    "get_adlr_autoresume": "megatron.training.global_vars",
    "initialize_megatron": "megatron.training.initialize",
    "pretrain": "megatron.training.training",
    "get_model": "megatron.training.training",
    "print_rank_0": "megatron.training.utils",
    "print_rank_last": "megatron.training.utils",
    "is_last_rank": "megatron.training.utils",
}

__all__ = list(_LAZY_ATTRS)


def __getattr__(name):
    if name in _LAZY_ATTRS:
        value = getattr(importlib.import_module(_LAZY_ATTRS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'megatron.training' has no attribute {name!r}")
