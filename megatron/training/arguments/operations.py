"""Flags of Megatron's cluster-operations groups: autoresume, straggler detection, workload
inspector, one logger, in-process restart, fault tolerance, rerun engine and MSC.

Option strings, dests, types, defaults, choices and nargs are Megatron-LM 0.13.1's; whether a
flag has an effect here is recorded in `manifest.json`.
"""
from megatron.training.arguments._spec import add_group, flag
from megatron.training.arguments.manifest import flag_help

AUTORESUME_FLAGS = (
    flag("--adlr-autoresume", action="store_true"),
    flag("--adlr-autoresume-interval", type=int, default=1000),
)

STRAGGLER_FLAGS = (
    flag("--log-straggler", action="store_true"),
    flag("--disable-straggler-on-startup", action="store_true"),
    flag("--straggler-ctrlr-port", type=int, default=65535),
    flag("--straggler-minmax-count", type=int, default=1),
)

WORKLOAD_INSPECTOR_FLAGS = (
    flag("--run-workload-inspector-server", action="store_true"),
)

ONE_LOGGER_FLAGS = (
    flag("--no-one-logger", action="store_false", dest="enable_one_logger"),
    flag("--one-logger-project", type=str, default="megatron-lm"),
    flag("--one-logger-run-name", type=str),
    flag("--one-logger-async", action="store_true"),
    flag("--app-tag-run-name", type=str),
    flag("--app-tag-run-version", type=str, default="0.0.0"),
)

INPROCESS_RESTART_FLAGS = (
    flag("--inprocess-restart", action="store_true"),
    flag("--inprocess-max-iterations", type=int),
    flag("--inprocess-monitor-thread-interval", type=float, default=1.0),
    flag("--inprocess-monitor-process-interval", type=float, default=1.0),
    flag("--inprocess-progress-watchdog-interval", type=float, default=1.0),
    flag("--inprocess-heartbeat-interval", type=float, default=30),
    flag("--inprocess-soft-timeout", type=float, default=60),
    flag("--inprocess-hard-timeout", type=float, default=90),
    flag("--inprocess-heartbeat-timeout", type=float, default=60),
    flag("--inprocess-barrier-timeout", type=float, default=120),
    flag("--inprocess-completion-timeout", type=float, default=120),
    flag("--inprocess-last-call-wait", type=float, default=1),
    flag("--inprocess-termination-grace-time", type=float, default=1),
    flag("--inprocess-granularity", type=str, default="node", choices=["node", "rank"]),
    flag("--inprocess-active-world-size", type=int, default=1),
    flag("--inprocess-empty-cuda-cache", action="store_true"),
)

FT_PACKAGE_FLAGS = (
    flag("--enable-ft-package", action="store_true"),
    flag("--calc-ft-timeouts", action="store_true"),
)

RERUN_ENGINE_FLAGS = (
    flag("--error-injection-rate", type=int, default=0),
    flag(
        "--error-injection-type",
        type=str,
        default="transient_error",
        choices=["correct_result", "transient_error", "persistent_error"],
    ),
    flag("--rerun-mode", type=str, default="disabled", choices=["disabled", "validate_results", "report_stats"]),
)

MSC_FLAGS = (
    flag("--disable-msc", action="store_false", dest="enable_msc"),
)


def _add_autoresume_args(parser):
    """Register the "autoresume" group."""
    return add_group(parser, "autoresume", AUTORESUME_FLAGS, flag_help)


def _add_straggler_detector_args(parser):
    """Register the "straggler" group."""
    return add_group(parser, "straggler", STRAGGLER_FLAGS, flag_help)


def _add_workload_inspector_server_args(parser):
    """Register the "workload inspector" group."""
    return add_group(parser, "workload inspector", WORKLOAD_INSPECTOR_FLAGS, flag_help)


def _add_one_logger_args(parser):
    """Register the "one logger" group."""
    return add_group(parser, "one logger", ONE_LOGGER_FLAGS, flag_help)


def _add_inprocess_restart_args(parser):
    """Register the "In-process restart" group."""
    return add_group(parser, "In-process restart", INPROCESS_RESTART_FLAGS, flag_help)


def _add_ft_package_args(parser):
    """Register the "ft_package" group."""
    return add_group(parser, "ft_package", FT_PACKAGE_FLAGS, flag_help)


def _add_rerun_machine_args(parser):
    """Register the "rerun engine" group."""
    return add_group(parser, "rerun engine", RERUN_ENGINE_FLAGS, flag_help)


def _add_msc_args(parser):
    """Register the "msc" group."""
    return add_group(parser, "msc", MSC_FLAGS, flag_help)
