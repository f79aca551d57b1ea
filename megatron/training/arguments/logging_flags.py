"""Flags of Megatron's "logging" and "config logger" groups.

Option strings, dests, types, defaults, choices and nargs are Megatron-LM 0.13.1's; whether a
flag has an effect here is recorded in `manifest.json`.
"""
from megatron.training.arguments._spec import add_group, flag
from megatron.training.arguments.manifest import flag_help

LOGGING_FLAGS = (
    flag("--log-params-norm", action="store_true"),
    flag("--log-num-zeros-in-grad", action="store_true"),
    flag("--log-throughput", action="store_true"),
    flag("--log-progress", action="store_true"),
    flag("--timing-log-level", type=int, default=0, choices=[0, 1, 2]),
    flag("--log-energy", action="store_true"),
    flag("--no-barrier-with-level-1-timing", action="store_false", dest="barrier_with_L1_time"),
    flag("--timing-log-option", type=str, default="minmax", choices=["max", "minmax", "all"]),
    flag("--tensorboard-log-interval", type=int, default=1),
    flag("--tensorboard-queue-size", type=int, default=1000),
    flag("--log-timers-to-tensorboard", action="store_true"),
    flag("--no-log-loss-scale-to-tensorboard", action="store_false", dest="log_loss_scale_to_tensorboard"),
    flag("--log-validation-ppl-to-tensorboard", action="store_true"),
    flag("--log-memory-to-tensorboard", action="store_true"),
    flag("--log-world-size-to-tensorboard", action="store_true"),
    flag("--wandb-project", type=str, default=""),
    flag("--wandb-exp-name", type=str, default=""),
    flag("--wandb-save-dir", type=str, default=""),
    flag("--logging-level", type=int),
)

CONFIG_LOGGER_FLAGS = (
    flag("--config-logger-dir", type=str, default=""),
)


def _add_logging_args(parser):
    """Register the "logging" group."""
    return add_group(parser, "logging", LOGGING_FLAGS, flag_help)


def _add_config_logger_args(parser):
    """Register the "config logger" group."""
    return add_group(parser, "config logger", CONFIG_LOGGER_FLAGS, flag_help)
