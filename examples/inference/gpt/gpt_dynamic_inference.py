"""Generate with the dynamic (continuous-batching) engine from a GPT checkpoint (Megatron's
`examples/inference/gpt/gpt_dynamic_inference.py`).

    python examples/inference/gpt/gpt_dynamic_inference.py <the training command's model/tokenizer flags> \
        --load CKPT --prompts "A" "B" [--num-tokens-to-generate 30] [--top_k 1] \
        [--inference-dynamic-batching-buffer-size-gb 40] [--inference-dynamic-batching-chunk-size 256] \
        [--inference-dynamic-batching-buffer-guaranteed-fraction 0.2] [--inference-max-seq-length 2560] \
        [--incoming-requests-per-step N] [--output-path results.json]

The paged key/value memory is sized by the `--inference-dynamic-batching-*` flags (Megatron's
`DynamicInferenceContext` arithmetic, docs/inference.md). `--incoming-requests-per-step N` adds N prompts
before each step (requests join mid-flight) instead of all at once. Every rank (TP, PP) runs the same loop
over the same prompts, so the ranks stay in step; rank 0 prints the generations and writes `--output-path`.
"""
import json
import os
import sys

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir, os.path.pardir, os.path.pardir))
sys.path.insert(0, ROOT)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.inference.contexts.dynamic_context import (  # noqa: E402
    DynamicInferenceContext,
    attention_layer_numbers,
    kv_cache_dims,
)
from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine  # noqa: E402
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper  # noqa: E402
from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig  # noqa: E402
from megatron.core.inference.sampling_params import SamplingParams  # noqa: E402
from megatron.core.inference.text_generation_controllers.text_generation_controller import (  # noqa: E402
    TextGenerationController,
)
from megatron.inference.model_loading import load_inference_model  # noqa: E402
from megatron.training import get_tokenizer  # noqa: E402
from pretrain_gpt import model_provider  # noqa: E402


def add_dynamic_inference_args(parser):
    """The example's own flags (sampling flags spelled as the server's: --top_k / --top_p)."""
    group = parser.add_argument_group(title="dynamic inference")
    group.add_argument("--prompts", metavar="N", type=str, nargs="+", required=True, help="Prompts to generate for.")
    group.add_argument("--num-tokens-to-generate", type=int, default=30, help="Tokens to generate per prompt.")
    group.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature.")
    group.add_argument("--top_k", type=int, default=1, help="Top-k sampling (1: greedy).")
    group.add_argument("--top_p", type=float, default=0.0, help="Top-p sampling (0: off).")
    group.add_argument("--incoming-requests-per-step", type=int, default=None,
                       help="Prompts added before each step (default: all before the first step).")
    group.add_argument("--output-path", type=str, default=None, help="JSON file of the generations (rank 0).")
    return parser


def build_engine(args, model) -> DynamicInferenceEngine:
    """Context from the --inference-dynamic-batching-* flags -> GPT wrapper -> controller -> dynamic engine."""
    heads, key_dim, value_dim = kv_cache_dims(model.config)
    context = DynamicInferenceContext(
        params_dtype=args.params_dtype, num_layers=args.num_layers, kv_channels=key_dim, num_attention_heads=heads,
        max_sequence_length=args.inference_max_seq_length,
        buffer_size_gb=args.inference_dynamic_batching_buffer_size_gb,
        buffer_guaranteed_fraction=args.inference_dynamic_batching_buffer_guaranteed_fraction,
        chunk_size_tokens=args.inference_dynamic_batching_chunk_size,
        buffer_overflow_factor=args.inference_dynamic_batching_buffer_overflow_factor,
        max_requests_override=args.inference_dynamic_batching_max_requests_override,
        max_tokens_override=args.inference_dynamic_batching_max_tokens_override,
        tensor_model_parallel_size=args.tensor_model_parallel_size, value_channels=value_dim,
        kv_layer_numbers=attention_layer_numbers(model),
        device=torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None,
    )
    config = InferenceWrapperConfig(
        hidden_size=args.hidden_size, inference_batch_times_seqlen_threshold=args.inference_batch_times_seqlen_threshold,
        fp32_residual_connection=args.fp32_residual_connection, params_dtype=args.params_dtype,
        padded_vocab_size=args.padded_vocab_size, inference_max_seq_length=args.inference_max_seq_length,
        inference_max_requests=context.max_requests, nccl_all_reduce_for_prefill=args.nccl_all_reduce_for_prefill,
    )
    tokenizer = get_tokenizer()
    controller = TextGenerationController(GPTInferenceWrapper(model, config, inference_context=context), tokenizer)
    graphs = bool(getattr(args, "enable_cuda_graph", False)) and torch.cuda.is_available()
    return DynamicInferenceEngine(controller, context, termination_id=tokenizer.eod, enable_cuda_graph=graphs,
                                  random_seed=args.seed)


def run(engine, prompts, sampling_params, per_step=None):
    """Requests for `prompts` (ids 0..n-1), `per_step` of them added before each step (all at once when None);
    returns the finished requests in prompt order."""
    pending = list(enumerate(prompts))
    done = {}
    while pending or engine.has_unfinished_requests():
        for request_id, prompt in pending[:per_step or len(pending)]:
            engine.add_request(request_id, prompt, sampling_params.num_tokens_to_generate)
        pending = pending[per_step or len(pending):]
        finished, _ = engine.step(sampling_params)
        done.update((request.request_id, request) for request in finished)
    return [done[i] for i in range(len(prompts))]


def main() -> None:
    args, model = load_inference_model(model_provider, add_dynamic_inference_args)
    engine = build_engine(args, model)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            num_tokens_to_generate=args.num_tokens_to_generate)
    results = run(engine, args.prompts, params, args.incoming_requests_per_step)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        for request in results:
            print("=" * 80 + "\n" + args.prompts[request.request_id] + request.generated_text, flush=True)
        if args.output_path:
            with open(args.output_path, "w") as f:
                json.dump([{"prompt": args.prompts[r.request_id], "generated_text": r.generated_text,
                            "generated_tokens": list(r.generated_tokens)} for r in results], f, indent=1)
    parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    main()
