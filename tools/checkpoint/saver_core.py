"""convert.py saver: the legacy `torch` layout at a target TP/PP (what Megatron's converters emit)."""
import torch

from tools.checkpoint.legacy_layout import write_legacy_checkpoint
from tools.checkpoint.messages import receive_model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser):
    group = parser.add_argument_group(title="Megatron saver")
    group.add_argument("--target-tensor-parallel-size", type=int, default=None,
                       help="TP of the written checkpoint (default: the source's)")
    group.add_argument("--target-pipeline-parallel-size", type=int, default=None,
                       help="PP of the written checkpoint (default: the source's)")
    group.add_argument("--target-expert-parallel-size", type=int, default=1, help="must be 1 (no MoE yet)")
    group.add_argument("--saver-transformer-impl", default="local", choices=["local", "transformer_engine"],
                       help="layer names to write; only local-spec names are written")


def save_checkpoint(queue, args):
    """Receive a model on `queue` and write it under `args.save_dir`."""
    md, full, desc = receive_model(queue, checking=args.checking)
    problems = []
    if args.target_expert_parallel_size != 1:
        problems.append(f"--target-expert-parallel-size {args.target_expert_parallel_size}: only 1 is supported")
    if args.saver_transformer_impl != "local":
        problems.append("--saver-transformer-impl transformer_engine: only local-spec names are written; use local")
    if problems:
        raise ValueError("; ".join(problems))
    tp = args.target_tensor_parallel_size or md.previous_tensor_parallel_size
    pp = args.target_pipeline_parallel_size or md.previous_pipeline_parallel_size
    dtype = _DTYPES[desc.params_dtype]
    full = {k: (v.to(dtype) if isinstance(v, torch.Tensor) else v) for k, v in full.items()}
    if desc.tie_embeddings:
        full.pop("output_layer.weight", None)
    write_legacy_checkpoint(args.save_dir, full, dict(md.checkpoint_args), desc, md.iteration, tp, pp)
    print(f"saved {md.num_layers}-layer model at TP={tp} PP={pp} to {args.save_dir}")
