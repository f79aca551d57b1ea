"""Megatron-style checkpoint conversion with loader and saver plugins (spec §8.3).

    python tools/checkpoint/convert.py --model-type GPT --loader llama_mistral --saver core \
        --load-dir HF_DIR --save-dir CKPT --target-tensor-parallel-size 2

Plugins are modules `loader_<name>` / `saver_<name>` (falling back to `<name>`) in this folder;
`megatron` and `mcore` are the legacy names of `legacy` and `core`. The loader runs in this process,
the saver in a child process; they talk through a queue (see messages.py). Loaders: core, legacy,
llama_mistral, hf. Savers: core, legacy, hf. Output of core/legacy is the legacy `torch` layout.
"""
import argparse
import importlib
import os
import sys
from typing import List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.multiprocessing as mp

_RENAMES = {"megatron": "legacy", "mcore": "core"}


def load_plugin(plugin_type: str, name: str):
    """Import `loader_<name>` / `saver_<name>`, else `<name>`; ValueError naming what was tried."""
    name = _RENAMES.get(name, name)
    candidates = [f"tools.checkpoint.{plugin_type}_{name}", f"tools.checkpoint.{name}", name]
    for module_name in candidates:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name or module_name.startswith(f"{exc.name}."):
                continue
            raise
        entry = "load_checkpoint" if plugin_type == "loader" else "save_checkpoint"
        if not hasattr(module, entry):
            raise ValueError(f"--{plugin_type} {name}: module {module_name} has no {entry}()")
        return module
    raise ValueError(f"--{plugin_type} {name}: no plugin found (tried {', '.join(candidates)})")


def _parse(argv: Optional[List[str]]):
    parser = argparse.ArgumentParser(description="Megatron checkpoint converter", add_help=False, allow_abbrev=False)
    parser.add_argument("--model-type", type=str, required=True, choices=["GPT", "BERT"], help="model type")
    parser.add_argument("--loader", type=str, default="core", help="loader plugin")
    parser.add_argument("--saver", type=str, default="core", help="saver plugin")
    parser.add_argument("--load-dir", type=str, required=True, help="directory to load from")
    parser.add_argument("--save-dir", type=str, required=True, help="directory to save to")
    parser.add_argument("--max-queue-size", type=int, default=50, help="messages the queue may hold")
    parser.add_argument("--no-checking", action="store_false", dest="checking", help="skip message-name checks")
    known, _ = parser.parse_known_args(argv)
    if known.model_type != "GPT":
        parser.error(f"--model-type {known.model_type}: only GPT is supported by these plugins")
    loader = load_plugin("loader", known.loader)
    saver = load_plugin("saver", known.saver)
    parser.add_argument("-h", "--help", action="help", help="show this help message and exit")
    loader.add_arguments(parser)
    saver.add_arguments(parser)
    return parser.parse_args(argv), loader, saver


def main(argv: Optional[List[str]] = None) -> None:
    args, loader, saver = _parse(argv)
    queue = mp.Queue(maxsize=args.max_queue_size)
    saver_proc = mp.Process(target=saver.save_checkpoint, args=(queue, args))
    saver_proc.start()
    try:
        loader.load_checkpoint(queue, args)
    finally:
        saver_proc.join()
    if saver_proc.exitcode != 0:
        raise SystemExit(f"the saver ({args.saver}) failed with exit code {saver_proc.exitcode}")


if __name__ == "__main__":
    main()
