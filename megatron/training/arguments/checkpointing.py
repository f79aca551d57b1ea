"""Flags of Megatron's "checkpointing" group: save/load directories, formats and intervals.

Option strings, dests, types, defaults, choices and nargs are Megatron-LM 0.13.1's; whether a
flag has an effect here is recorded in `manifest.json`.
"""
from megatron.training.arguments._spec import add_group, flag
from megatron.training.arguments.manifest import flag_help

CHECKPOINTING_FLAGS = (
    flag("--save", type=str, help="Directory to save checkpoints to."),
    flag("--save-interval", "--persistent-save-interval", type=int, help="Required if --save."),
    flag("--no-save-optim", action="store_true", default=None, help="Do not save the optimizer state."),
    flag("--no-save-rng", action="store_true", default=None, help="Do not save the RNG state."),
    flag("--load", type=str, help="Directory to load a checkpoint from."),
    flag("--no-load-optim", action="store_true", default=None, help="Do not load the optimizer state."),
    flag("--no-load-rng", action="store_true", default=None, help="Do not load the RNG state."),
    flag("--non-persistent-save-interval", type=int,
         help="Iterations between non-persistent checkpoints (the newest is kept; loaded when newer than --load's)."),
    flag(
        "--non-persistent-ckpt-type",
        type=str,
        choices=["global", "local", "in_memory", None],
        help="global: a torch_dist checkpoint under --non-persistent-global-ckpt-dir (default <save>/non_persistent); "
        "local: one file per rank under --non-persistent-local-ckpt-dir (same layout needed to load).",
    ),
    flag("--non-persistent-global-ckpt-dir", type=str, help="Directory of global non-persistent checkpoints."),
    flag("--non-persistent-local-ckpt-dir", type=str, help="Node-local directory of local non-persistent checkpoints."),
    flag(
        "--non-persistent-local-ckpt-algo",
        type=str,
        default="fully_parallel",
        choices=["fully_parallel", "atomic"],
        help="Accepted for compatibility: every rank writes its own file atomically either way.",
    ),
    flag("--finetune", action="store_true", help="Load the model only; iteration=0."),
    flag("--pretrained-checkpoint", type=str, help="Fallback load dir (implies finetune)."),
    flag("--ckpt-step", type=int, help="Load this iteration instead of the tracker."),
    flag("--no-initialization", action="store_false", dest="perform_initialization", help="Skip weight init."),
    flag("--use-checkpoint-args", action="store_true", help="Take model (and MP) args from the checkpoint."),
    flag(
        "--use-mp-args-from-checkpoint-args",
        action="store_true",
        help="Take model (and MP) args from the checkpoint.",
    ),
    flag(
        "--no-use-tokenizer-model-from-checkpoint-args",
        action="store_false",
        dest="use_tokenizer_model_from_checkpoint_args",
    ),
    flag("--exit-on-missing-checkpoint", action="store_true", help="Error if --load is empty."),
    flag("--use-dist-ckpt", action="store_true", dest="use_dist_ckpt_deprecated", help="Deprecated no-op."),
    flag("--use-persistent-ckpt-worker", action="store_true"),
    flag("--auto-detect-ckpt-format", action="store_true", help="Detect on load."),
    flag("--dist-ckpt-format", dest="dist_ckpt_format_deprecated", help="Deprecated no-op."),
    flag(
        "--ckpt-format",
        default="torch_dist",
        choices=["torch", "torch_dist", "zarr", "torch_dcp"],
        help="Torch|torch_dist|zarr|torch_dcp.",
    ),
    flag("--ckpt-convert-format", choices=["torch", "torch_dist", "zarr"], help="Convert on load, then exit."),
    flag("--ckpt-convert-save", help="Convert on load, then exit."),
    flag("--ckpt-convert-update-legacy-dist-opt-format", action="store_true"),
    flag(
        "--ckpt-fully-parallel-save",
        action="store_true",
        dest="ckpt_fully_parallel_save_deprecated",
        help="Deprecated no-op.",
    ),
    flag(
        "--no-ckpt-fully-parallel-save",
        action="store_false",
        dest="ckpt_fully_parallel_save",
        help="Disables the DP-parallel save; the default (on) is required for a reshardable dist-opt checkpoint.",
    ),
    flag("--async-save", action="store_true", default=None, help="Async torch_dist save."),
    flag("--ckpt-fully-parallel-load", action="store_true", help="DP-parallel load."),
    flag("--ckpt-assume-constant-structure", action="store_true", help="Cache the save plan."),
    flag(
        "--dist-ckpt-strictness",
        type=str,
        default="assume_ok_unexpected",
        choices=[
            "assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
            "return_unexpected", "return_all", "ignore_all",
        ],
        help="How to handle missing/unexpected keys when loading a torch_dist checkpoint (StrictHandling).",
    ),
    flag("--load-model-opt-format", action="store_true"),
)


def _add_checkpointing_args(parser):
    """Register the "checkpointing" group."""
    return add_group(parser, "checkpointing", CHECKPOINTING_FLAGS, flag_help)
