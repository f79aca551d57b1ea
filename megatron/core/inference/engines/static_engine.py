"""`StaticInferenceEngine`: batches of up to `max_batch_size` requests generated together (Megatron Core).

`generate(prompts | inference_requests, sampling_params)` queues the requests, then `run_engine` generates
the active pool as one static batch, moves the results to the completed pool and promotes waiting
requests until none is left; results come back in request order. `random_seed` seeds torch's RNG at every
`generate`.

With tensor and/or pipeline parallelism every rank calls `generate` with the same requests (the REST server
broadcasts them from rank 0); every rank ends with the same completed requests, since each forward's logits
come from the last pipeline stage and the sampled tokens from its tensor-parallel rank 0.
"""
import warnings
from typing import Callable, Dict, List, Optional

import torch

from megatron.core.inference.engines.abstract_engine import AbstractEngine
from megatron.core.inference.inference_request import InferenceRequest
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.scheduler import Scheduler


class StaticInferenceEngine(AbstractEngine):
    """Static batching over a `TextGenerationController`."""

    def __init__(self, text_generation_controller, max_batch_size: Optional[int] = None,
                 random_seed: Optional[int] = None):
        limit = text_generation_controller.inference_wrapped_model.inference_wrapper_config.inference_max_requests
        if max_batch_size is None:
            max_batch_size = limit
        elif max_batch_size > limit:
            warnings.warn(f"max_batch_size ({max_batch_size}) exceeds inference_max_requests ({limit}): using {limit}")
            max_batch_size = limit
        self.text_generation_controller = text_generation_controller
        self.random_seed = random_seed
        self.scheduler = Scheduler(max_batch_size=max_batch_size)

    def get_new_request_id(self) -> str:
        """The next request id."""
        return self.scheduler.get_new_request_id()

    def add_request(self, prompt: Optional[str] = None, add_BOS: bool = False, encoder_prompt: Optional[str] = None,
                    sampling_params: Optional[SamplingParams] = None, streaming: Optional[Callable] = None,
                    inference_request: Optional[InferenceRequest] = None, *, inference_parameters=None,
                    prompt_tokens: Optional[List[int]] = None) -> str:
        """Queue one request; `streaming(request_id, generated_tokens)` is called after every step."""
        sampling_params = sampling_params or inference_parameters or SamplingParams()
        if inference_request is not None:
            if inference_request.prompt_tokens is None:
                inference_request.prompt_tokens = self.text_generation_controller.tokenize_prompt(
                    inference_request.prompt, add_BOS)
            request_id = self.scheduler.add_request(inference_request=inference_request)
        else:
            tokens = prompt_tokens if prompt_tokens is not None else \
                self.text_generation_controller.tokenize_prompt(prompt, add_BOS)
            request_id = self.scheduler.add_request(prompt=prompt, prompt_tokens=tokens, encoder_prompt=encoder_prompt,
                                                    inference_parameters=sampling_params)
        if streaming is not None:
            self.text_generation_controller.stream_callbacks[request_id] = streaming
        return request_id

    def generate(self, prompts: Optional[List[str]] = None, add_BOS: bool = False,
                 encoder_prompts: Optional[List[str]] = None, common_inference_params=None,
                 sampling_params: Optional[SamplingParams] = None,
                 inference_requests: Optional[List[InferenceRequest]] = None) -> List[InferenceRequest]:
        """Completed requests for `prompts` (or `inference_requests`), in order."""
        if self.random_seed is not None:
            torch.random.manual_seed(self.random_seed)
        sampling_params = sampling_params or common_inference_params or SamplingParams()
        if inference_requests is not None:
            ids = [self.add_request(inference_request=r, add_BOS=add_BOS) for r in inference_requests]
        else:
            if prompts is None:
                raise ValueError("StaticInferenceEngine.generate needs prompts or inference_requests")
            encoder_prompts = encoder_prompts or [None] * len(prompts)
            ids = [self.add_request(prompt=p, add_BOS=add_BOS, encoder_prompt=e, sampling_params=sampling_params)
                   for p, e in zip(prompts, encoder_prompts)]
        self.run_engine()
        results = [self.scheduler.completed_request_pool.pop(request_id) for request_id in ids]
        for request_id in ids:
            self.text_generation_controller.stream_callbacks.pop(request_id, None)
        return results

    def run_engine(self) -> None:
        """Generate batches until no request is active or waiting."""
        while self.scheduler.have_requests_pending():
            batch = self.scheduler.active_request_pool.copy()
            try:
                result = self.text_generation_controller.generate_all_output_tokens_static_batch(batch)
            except Exception:  # a failed batch leaves the engine: later requests still run
                for request_id in batch:
                    self.scheduler.active_request_pool.pop(request_id, None)
                    self.text_generation_controller.stream_callbacks.pop(request_id, None)
                self.scheduler.update_requests_pools()
                raise
            self.scheduler.update_requests_pools(result_dict=result)


__all__ = ["StaticInferenceEngine"]
