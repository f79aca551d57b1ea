"""`run_mcore_engine`: one generation call of the REST server, kept in step on every model-parallel rank.

The server runs on global rank 0. Before each generation it broadcasts the call's arguments to all ranks
(`ModelParallelSync.submit`); the other ranks wait in `serve_follower_ranks`, run the same generation with
the same arguments (tensor-parallel ranks must join every forward's collectives, and every pipeline stage
its p2p exchanges and the broadcast of the last stage's logits), and leave the loop when rank 0 broadcasts
the stop message at shutdown. Global rank 0 is the first pipeline stage's tensor-parallel rank 0, where
Megatron runs its server; every stage ends a generation with the same results.
"""
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from megatron.core.inference.inference_request import InferenceRequest
from megatron.core.inference.sampling_params import SamplingParams

GENERATE, STOP = 0, 2


def run_mcore_engine(engine, prompts: List[str], temperature: float = 1.0, top_k: int = 0, top_p: float = 0.0,
                     logprobs: bool = True, tokens_to_generate: int = 0, top_n_logprobs: int = 0,
                     random_seed: Optional[int] = None, prompt_tokens: Optional[List[List[int]]] = None,
                     streaming: Optional[Callable] = None) -> List[InferenceRequest]:
    """Generate for `prompts` (or pre-tokenized `prompt_tokens`) with one set of sampling values.

    As in Megatron, prompts are tokenized without BOS and the request prompt is the detokenized tokens, so
    `prompt + generated_text` is the text of `prompt_tokens + generated_tokens`."""
    controller = engine.text_generation_controller
    if prompt_tokens is None:
        prompt_tokens = [controller.tokenize_prompt(p) for p in prompts]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, return_log_probs=logprobs,
                            num_tokens_to_generate=tokens_to_generate, top_n_logprobs=top_n_logprobs,
                            return_segments=True, return_prompt_top_n_logprobs=top_n_logprobs > 0)
    requests = [InferenceRequest(request_id=engine.get_new_request_id(), prompt=controller.detokenize_generations(t),
                                 prompt_tokens=list(t), sampling_params=params) for t in prompt_tokens]
    if random_seed is not None:
        torch.random.manual_seed(random_seed)
    if streaming is not None:
        for index, request in enumerate(requests):
            controller.stream_callbacks[request.request_id] = (
                lambda request_id, tokens, index=index: streaming(index, tokens))
    return engine.generate(inference_requests=requests, sampling_params=params)


class ModelParallelSync:
    """Rank 0's side of keeping all ranks in step (a no-op in a one-process run)."""

    def __init__(self, engine):
        self.engine = engine
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def _broadcast(self, message):
        if self.world_size > 1:
            dist.broadcast_object_list([message], src=0)

    def submit(self, streaming: Optional[Callable] = None, **kwargs) -> List[InferenceRequest]:
        """Run one generation on every rank; rank 0 gets the results (and the streaming callbacks)."""
        self._broadcast((GENERATE, kwargs))
        return run_mcore_engine(self.engine, streaming=streaming, **kwargs)

    def stop(self) -> None:
        """Release the follower ranks."""
        self._broadcast((STOP, None))


def serve_follower_ranks(engine) -> None:
    """The loop of every rank but 0: run each broadcast generation until the stop message."""
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0)
        choice, kwargs = message[0]
        if choice == STOP:
            return
        try:
            run_mcore_engine(engine, **kwargs)
        except ValueError:  # rank 0 raises the same error and answers the client
            continue


__all__ = ["run_mcore_engine", "ModelParallelSync", "serve_follower_ranks", "GENERATE", "STOP"]
