"""Start-up shared by the inference command lines (`tools/run_text_generation_server.py`,
`examples/inference/gpt/gpt_dynamic_inference.py`): Megatron's inference defaults, the model built without
DDP, the checkpoint loaded, eval mode."""
from megatron.core.enums import ModelType
from megatron.training import get_args, get_model, initialize_megatron
from megatron.training.checkpointing import load_checkpoint

INFERENCE_ARGS_DEFAULTS = {"no_load_rng": True, "no_load_optim": True, "exit_on_missing_checkpoint": True,
                           "micro_batch_size": 1}


def load_inference_model(model_provider, extra_args_provider):
    """(args, model chunk 0) for inference: `initialize_megatron` with the script's flags and Megatron's
    inference defaults, the model from `model_provider` (no DDP), `--load` applied when given."""
    initialize_megatron(extra_args_provider=extra_args_provider, args_defaults=dict(INFERENCE_ARGS_DEFAULTS))
    args = get_args()
    if args.virtual_pipeline_model_parallel_size is not None:
        raise SystemExit("error: interleaved pipeline schedules are not supported for inference")
    model = get_model(model_provider, ModelType.encoder_or_decoder, wrap_with_ddp=False)
    if args.load is not None:
        load_checkpoint(model, None, None)
    model[0].eval()
    return args, model[0]


__all__ = ["INFERENCE_ARGS_DEFAULTS", "load_inference_model"]
