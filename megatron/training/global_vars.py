"""Process-wide state of a training run: args, timers, tokenizer, writers, the signal handler.

One of the two modules allowed to hold globals (the other is `megatron.core.parallel_state`).
`destroy_global_vars()` resets everything so that tests can run `pretrain` several times in one process.
TensorBoard and wandb writers exist only on the last rank (where the training log line is printed).
"""
import os
import time

from megatron.core import num_microbatches_calculator
from megatron.core.config import set_experimental_flag
from megatron.core.energy_monitor import EnergyMonitor
from megatron.core.timers import Timers
from megatron.core.utils import module_available
from megatron.training.dist_signal_handler import DistributedSignalHandler
from megatron.training.tokenizer import build_tokenizer
from megatron.training.wandb_utils import init_wandb

_GLOBAL_ARGS = None
_GLOBAL_TOKENIZER = None
_GLOBAL_TENSORBOARD_WRITER = None
_GLOBAL_WANDB_WRITER = None
_GLOBAL_ONE_LOGGER = None
_GLOBAL_ADLR_AUTORESUME = None
_GLOBAL_TIMERS = None
_GLOBAL_ENERGY_MONITOR = None
_GLOBAL_SIGNAL_HANDLER = None
_GLOBAL_TRAIN_START = None


class GlobalVariableError(RuntimeError, AssertionError):
    """A global read before it was set, or set twice. Megatron asserts there, so code written for it (e.g.
    `pytest.raises(AssertionError)`) catches this too."""


def _ensure_var_is_initialized(var, name):
    """Raise `GlobalVariableError` when the global `name` (value `var`) has not been set."""
    if var is None:
        raise GlobalVariableError(
            f"{name} is not initialized: call initialize_megatron() (or set_global_variables) first.")


def _ensure_var_is_not_initialized(var, name):
    """Raise `GlobalVariableError` when the global `name` (value `var`) is already set."""
    if var is not None:
        raise GlobalVariableError(
            f"{name} is already initialized: call destroy_global_vars() (or unset_global_variables) first.")


def get_args():
    """The parsed and validated command-line arguments."""
    _ensure_var_is_initialized(_GLOBAL_ARGS, "args")
    return _GLOBAL_ARGS


def get_tokenizer():
    """The tokenizer built from the args."""
    _ensure_var_is_initialized(_GLOBAL_TOKENIZER, "tokenizer")
    return _GLOBAL_TOKENIZER


def get_tensorboard_writer():
    """The TensorBoard `SummaryWriter` (None unless --tensorboard-dir is set and this is the last rank)."""
    return _GLOBAL_TENSORBOARD_WRITER


def get_wandb_writer():
    """The `wandb` module after `wandb.init` (None unless --wandb-project is set and this is the last rank)."""
    return _GLOBAL_WANDB_WRITER


def get_one_logger():
    """NVIDIA one-logger handle; this framework has none, so always None."""
    return _GLOBAL_ONE_LOGGER


def get_adlr_autoresume():
    """ADLR autoresume handle; not available here, so always None."""
    return _GLOBAL_ADLR_AUTORESUME


def get_timers():
    """The `Timers` of this process."""
    _ensure_var_is_initialized(_GLOBAL_TIMERS, "timers")
    return _GLOBAL_TIMERS


def get_energy_monitor():
    """The `EnergyMonitor` (used with --log-energy)."""
    _ensure_var_is_initialized(_GLOBAL_ENERGY_MONITOR, "energy monitor")
    return _GLOBAL_ENERGY_MONITOR


def get_signal_handler():
    """The `DistributedSignalHandler` installed by --exit-signal-handler."""
    _ensure_var_is_initialized(_GLOBAL_SIGNAL_HANDLER, "signal handler")
    return _GLOBAL_SIGNAL_HANDLER


def set_train_start(start_time: float, num_floating_point_operations_so_far: float = 0.0):
    """Record when the job started (MIN across ranks) and the FLOPs count it resumed from."""
    global _GLOBAL_TRAIN_START
    _GLOBAL_TRAIN_START = (start_time, num_floating_point_operations_so_far)


def get_train_start():
    """(start_time, flops_at_start) of this job; (now, 0) before `pretrain` recorded it."""
    if _GLOBAL_TRAIN_START is None:
        return time.time(), 0.0
    return _GLOBAL_TRAIN_START


def _set_signal_handler(exit_signal=None):
    global _GLOBAL_SIGNAL_HANDLER
    _ensure_var_is_not_initialized(_GLOBAL_SIGNAL_HANDLER, "signal handler")
    handler = DistributedSignalHandler(exit_signal) if exit_signal is not None else DistributedSignalHandler()
    _GLOBAL_SIGNAL_HANDLER = handler.__enter__()


def set_args(args):
    """Replace the global args."""
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args


def set_global_variables(args, build_tokenizer=True):
    """Set args, the microbatch calculator, tokenizer, writers, timers, the energy monitor and the signal handler
    (in that order); `--enable-experimental` switches on Megatron Core's experimental features."""
    if args is None:
        raise ValueError("set_global_variables needs the parsed args, got None.")
    _ensure_var_is_not_initialized(_GLOBAL_ARGS, "args")
    set_args(args)
    num_microbatches_calculator.init_num_microbatches_calculator(
        args.rank,
        args.rampup_batch_size,
        args.global_batch_size,
        args.micro_batch_size,
        args.data_parallel_size,
        getattr(args, "decrease_batch_size_if_needed", False),
    )
    if build_tokenizer:
        _build_tokenizer(args)
    _set_tensorboard_writer(args)
    _set_wandb_writer(args)
    _set_timers(args)
    _set_energy_monitor(args)
    if getattr(args, "enable_experimental", False):
        set_experimental_flag(True)
    if getattr(args, "exit_signal_handler", False):
        _set_signal_handler()


def unset_global_variables():
    """Forget every global (including the microbatch calculator) without closing anything, so that another run
    can set them again in this process (Megatron's helper for several runs in one process)."""
    global _GLOBAL_ARGS, _GLOBAL_TOKENIZER, _GLOBAL_TENSORBOARD_WRITER, _GLOBAL_WANDB_WRITER
    global _GLOBAL_ONE_LOGGER, _GLOBAL_ADLR_AUTORESUME, _GLOBAL_TIMERS, _GLOBAL_ENERGY_MONITOR
    global _GLOBAL_SIGNAL_HANDLER
    _GLOBAL_ARGS = _GLOBAL_TOKENIZER = _GLOBAL_TENSORBOARD_WRITER = _GLOBAL_WANDB_WRITER = None
    _GLOBAL_ONE_LOGGER = _GLOBAL_ADLR_AUTORESUME = _GLOBAL_TIMERS = _GLOBAL_ENERGY_MONITOR = None
    _GLOBAL_SIGNAL_HANDLER = None
    num_microbatches_calculator.unset_num_microbatches_calculator()


def _build_tokenizer(args):
    global _GLOBAL_TOKENIZER
    _ensure_var_is_not_initialized(_GLOBAL_TOKENIZER, "tokenizer")
    _GLOBAL_TOKENIZER = build_tokenizer(args)
    return _GLOBAL_TOKENIZER


def rebuild_tokenizer(args):
    """Build the tokenizer again (after args that affect it changed)."""
    global _GLOBAL_TOKENIZER
    _GLOBAL_TOKENIZER = None
    return _build_tokenizer(args)


def _is_last_rank(args) -> bool:
    return args.rank == args.world_size - 1


def _set_tensorboard_writer(args):
    global _GLOBAL_TENSORBOARD_WRITER
    _ensure_var_is_not_initialized(_GLOBAL_TENSORBOARD_WRITER, "tensorboard writer")
    if not getattr(args, "tensorboard_dir", None) or not _is_last_rank(args):
        return
    if not module_available("tensorboard"):
        print(
            "WARNING: --tensorboard-dir was given but the `tensorboard` package is not installed "
            "(pip install tensorboard, or the [logging] extra); no TensorBoard logs will be written.",
            flush=True,
        )
        return
    from torch.utils.tensorboard import SummaryWriter

    print("> setting tensorboard ...", flush=True)
    _GLOBAL_TENSORBOARD_WRITER = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size)


def _set_wandb_writer(args):
    global _GLOBAL_WANDB_WRITER
    _ensure_var_is_not_initialized(_GLOBAL_WANDB_WRITER, "wandb writer")
    if not getattr(args, "wandb_project", "") or not _is_last_rank(args):
        return
    if not args.wandb_exp_name:
        raise ValueError("--wandb-project is set but --wandb-exp-name is empty: give the run a name with --wandb-exp-name.")
    if not module_available("wandb"):
        print(
            "WARNING: --wandb-project was given but the `wandb` package is not installed "
            "(pip install wandb, or the [logging] extra); no wandb logs will be written.",
            flush=True,
        )
        return
    save_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else os.path.abspath("wandb"))
    _GLOBAL_WANDB_WRITER = init_wandb(args, save_dir)


def _set_timers(args):
    global _GLOBAL_TIMERS
    _ensure_var_is_not_initialized(_GLOBAL_TIMERS, "timers")
    _GLOBAL_TIMERS = Timers(args.timing_log_level, args.timing_log_option)


def _set_energy_monitor(args):
    """Create the `EnergyMonitor` (it reads NVML only once --log-energy sets it up)."""
    global _GLOBAL_ENERGY_MONITOR
    _ensure_var_is_not_initialized(_GLOBAL_ENERGY_MONITOR, "energy monitor")
    _GLOBAL_ENERGY_MONITOR = EnergyMonitor()


def destroy_global_vars():
    """Reset every global (closing writers, uninstalling the signal handler, switching Megatron Core's
    experimental flag back off); tests call this."""
    global _GLOBAL_ARGS, _GLOBAL_TOKENIZER, _GLOBAL_TENSORBOARD_WRITER, _GLOBAL_WANDB_WRITER
    global _GLOBAL_ONE_LOGGER, _GLOBAL_ADLR_AUTORESUME, _GLOBAL_TIMERS, _GLOBAL_ENERGY_MONITOR
    global _GLOBAL_SIGNAL_HANDLER, _GLOBAL_TRAIN_START
    if _GLOBAL_TENSORBOARD_WRITER is not None:
        _GLOBAL_TENSORBOARD_WRITER.close()
    if _GLOBAL_SIGNAL_HANDLER is not None:
        _GLOBAL_SIGNAL_HANDLER.release()
    _GLOBAL_ARGS = None
    _GLOBAL_TOKENIZER = None
    _GLOBAL_TENSORBOARD_WRITER = None
    _GLOBAL_WANDB_WRITER = None
    _GLOBAL_ONE_LOGGER = None
    _GLOBAL_ADLR_AUTORESUME = None
    _GLOBAL_TIMERS = None
    _GLOBAL_ENERGY_MONITOR = None
    _GLOBAL_SIGNAL_HANDLER = None
    _GLOBAL_TRAIN_START = None
    set_experimental_flag(False)
    num_microbatches_calculator.destroy_num_microbatches_calculator()
