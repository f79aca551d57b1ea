"""convert.py loader: a local HuggingFace directory (Llama, Mistral, Qwen2, Qwen3, and GPT-2)."""
from tools.checkpoint import hf_mapping
from tools.checkpoint.hf_convert import read_hf_dir
from tools.checkpoint.messages import make_metadata, send_model
from tools.checkpoint.model_description import from_hf_config, to_megatron_args


def add_arguments(parser):
    group = parser.add_argument_group(title="HuggingFace loader")
    group.add_argument("--checkpoint-type", default="hf", choices=["hf", "meta"], help="only 'hf' is supported")
    group.add_argument("--model-size", default=None, help="accepted for compatibility; read from config.json")
    group.add_argument("--tokenizer-model", default=None, help="accepted for compatibility; not needed")
    group.add_argument("--bf16", action="store_true", help="convert weights to bfloat16")
    group.add_argument("--fp16", action="store_true", help="convert weights to float16")
    group.add_argument("--true-vocab-size", type=int, default=None, help="accepted; read from config.json")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                       help="pad the Megatron vocab (default: no padding)")
    group.add_argument("--loader-transformer-impl", default="local", choices=["local", "transformer_engine"],
                       help="accepted for compatibility; the local spec is written")


def load_checkpoint(queue, args):
    """Read the HF directory `args.load_dir` and send it on `queue`; puts "exit" on failure."""
    try:
        if args.checkpoint_type != "hf":
            raise ValueError("--checkpoint-type meta is not supported: convert Meta weights to HF format first")
        config, hf_state = read_hf_dir(args.load_dir)
        desc = from_hf_config(config, args.make_vocab_size_divisible_by)
        if args.bf16 or args.fp16:
            desc.params_dtype = "bfloat16" if args.bf16 else "float16"
        full = hf_mapping.hf_to_megatron(hf_state, desc, with_extra_state=False)
        checkpoint_args = to_megatron_args(desc)
        if args.make_vocab_size_divisible_by:
            checkpoint_args["make_vocab_size_divisible_by"] = args.make_vocab_size_divisible_by
        send_model(queue, make_metadata(desc, checkpoint_args, None), full, desc)
    except BaseException:
        queue.put("exit")
        raise
