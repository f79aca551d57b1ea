"""Serve a GPT checkpoint over REST (Megatron's `tools/run_text_generation_server.py`).

    python tools/run_text_generation_server.py <the training command's model/tokenizer flags> --load CKPT \
        [--port 5000] [--host 127.0.0.1] [--inference-max-requests 8] [--inference-max-seq-length 2560]

Routes: `PUT /api` (Megatron's schema), `POST /v1/completions`, `POST /v1/chat/completions` (OpenAI, with
`"stream": true`). `--prompts A B ...` generates for the prompts, prints the results and exits instead of serving.
Rank 0 (the first pipeline stage's tensor-parallel rank 0) serves; every other rank (other tensor-parallel
ranks, later pipeline stages) runs each generation rank 0 broadcasts, so all ranks stay in step.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.inference.engines.static_engine import StaticInferenceEngine  # noqa: E402
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper  # noqa: E402
from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig  # noqa: E402
from megatron.core.inference.text_generation_controllers.text_generation_controller import (  # noqa: E402
    TextGenerationController,
)
from megatron.inference.text_generation.mcore_engine_server import (  # noqa: E402
    ModelParallelSync,
    serve_follower_ranks,
)
from megatron.inference.model_loading import load_inference_model  # noqa: E402
from megatron.inference.text_generation_server import MegatronServer  # noqa: E402
from megatron.training import get_tokenizer  # noqa: E402
from pretrain_gpt import model_provider  # noqa: E402


def add_text_generate_args(parser):
    """Megatron's server flags (note the underscores of --top_k / --top_p), plus --host."""
    group = parser.add_argument_group(title="text generation")
    group.add_argument("--port", type=int, default=5000, help="Port of the REST server.")
    group.add_argument("--host", type=str, default="127.0.0.1", help="Address to bind (0.0.0.0: all interfaces).")
    group.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature (--prompts mode).")
    group.add_argument("--top_k", type=int, default=1, help="Top-k sampling (--prompts mode).")
    group.add_argument("--top_p", type=float, default=0.0, help="Top-p sampling (--prompts mode).")
    group.add_argument("--return-log-probs", action="store_true", default=True, help="Return log-probabilities.")
    group.add_argument("--num-tokens-to-generate", type=int, default=30, help="Tokens to generate (--prompts mode).")
    group.add_argument("--prompts", metavar="N", type=str, nargs="+", help="Generate for these prompts and exit.")
    group.add_argument("--max-batch-size", type=int, default=None, dest="max_batch_size",
                       help="Deprecated: use --inference-max-requests.")
    return parser


def get_inference_engine(args, model) -> StaticInferenceEngine:
    """Wrapper config -> GPT wrapper -> controller -> static engine, as Megatron builds them."""
    config = InferenceWrapperConfig(
        hidden_size=args.hidden_size, inference_batch_times_seqlen_threshold=args.inference_batch_times_seqlen_threshold,
        fp32_residual_connection=args.fp32_residual_connection, params_dtype=args.params_dtype,
        padded_vocab_size=args.padded_vocab_size, inference_max_seq_length=args.inference_max_seq_length,
        inference_max_requests=args.inference_max_batch_size, nccl_all_reduce_for_prefill=args.nccl_all_reduce_for_prefill,
        enable_cuda_graph=bool(getattr(args, "enable_cuda_graph", False)) and torch.cuda.is_available(),
        cuda_graph_warmup_steps=max(int(getattr(args, "cuda_graph_warmup_steps", 2)), 1),
    )
    controller = TextGenerationController(GPTInferenceWrapper(model, config), get_tokenizer())
    return StaticInferenceEngine(controller, max_batch_size=args.inference_max_batch_size)


def main() -> None:
    args, model = load_inference_model(model_provider, add_text_generate_args)
    if args.max_batch_size is not None:
        args.inference_max_batch_size = max(args.inference_max_batch_size, args.max_batch_size)
    engine = get_inference_engine(args, model)
    if engine.text_generation_controller.inference_wrapped_model.inference_wrapper_config.enable_cuda_graph:
        from megatron.core.inference.sampling_params import SamplingParams

        # Megatron's warm-up generation: every rank captures the batch-1 decode graph before serving.
        engine.generate(prompts=["warm up"], sampling_params=SamplingParams(top_k=1, num_tokens_to_generate=4))
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if args.prompts:
        sync = ModelParallelSync(engine)
        if rank == 0:
            results = sync.submit(prompts=args.prompts, temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, logprobs=args.return_log_probs,
                                  tokens_to_generate=args.num_tokens_to_generate)
            sync.stop()
            for result in results:
                print("=" * 80 + "\n" + result.prompt + result.generated_text, flush=True)
        else:
            serve_follower_ranks(engine)
        return
    if rank == 0:
        print(f"serving on http://{args.host}:{args.port} (PUT /api, POST /v1/completions, /v1/chat/completions)",
              flush=True)
        MegatronServer(engine, args).run(args.host, args.port)
    else:
        serve_follower_ranks(engine)


if __name__ == "__main__":
    main()
