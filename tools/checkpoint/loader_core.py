"""convert.py loader: a Megatron checkpoint in the legacy `torch` layout (any TP/PP, local spec)."""
import argparse

from megatron.training.checkpoint_args import args_to_plain_dict, to_plain
from tools.checkpoint.legacy_layout import read_legacy_checkpoint
from tools.checkpoint.messages import make_metadata, send_model
from tools.checkpoint.model_description import from_megatron_args


def add_arguments(parser):
    group = parser.add_argument_group(title="Megatron loader")
    group.add_argument("--true-vocab-size", type=int, default=None, help="original vocab size (before padding)")
    group.add_argument("--position-embedding-type", default=None, help="accepted for compatibility; read from args")
    group.add_argument("--loader-transformer-impl", default="local", choices=["local", "transformer_engine"],
                       help="layer names of the checkpoint; only local-spec names are read")


def _plain_args(args):
    if isinstance(args, argparse.Namespace):
        return args_to_plain_dict(args)
    return {str(k): to_plain(v) for k, v in args.items()}


def load_checkpoint(queue, args):
    """Read `args.load_dir` and send it on `queue`; puts "exit" on failure."""
    try:
        if args.loader_transformer_impl != "local":
            raise ValueError("--loader-transformer-impl transformer_engine: only local-spec checkpoints are read "
                             "(this framework writes local-spec names); pass --loader-transformer-impl local")
        full, ckpt_args, iteration, desc = read_legacy_checkpoint(args.load_dir, from_megatron_args)
        plain = _plain_args(ckpt_args)
        if args.true_vocab_size is not None:
            desc.true_vocab_size = args.true_vocab_size
        md = make_metadata(desc, plain, iteration, plain.get("tensor_model_parallel_size", 1),
                           plain.get("pipeline_model_parallel_size", 1))
        send_model(queue, md, full, desc)
    except BaseException:
        queue.put("exit")
        raise
