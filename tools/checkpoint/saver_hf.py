"""convert.py saver `hf`: a HuggingFace directory (config.json + model.safetensors)."""
import torch

from tools.checkpoint import hf_mapping
from tools.checkpoint.hf_convert import write_hf_dir
from tools.checkpoint.messages import receive_model
from tools.checkpoint.model_description import to_hf_config

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser):
    group = parser.add_argument_group(title="HuggingFace saver")
    group.add_argument("--hf-dtype", default=None, choices=sorted(_DTYPES), help="weight dtype (default: source's)")


def save_checkpoint(queue, args):
    """Receive a model on `queue` and write an HF directory to `args.save_dir`."""
    md, full, desc = receive_model(queue, checking=args.checking)
    if args.hf_dtype:
        desc.params_dtype = args.hf_dtype
    state = hf_mapping.megatron_to_hf(full, desc)
    write_hf_dir(args.save_dir, to_hf_config(desc), {k: v.to(_DTYPES[desc.params_dtype]) for k, v in state.items()})
    print(f"saved {md.num_layers}-layer model as {to_hf_config(desc)['architectures'][0]} to {args.save_dir}")
