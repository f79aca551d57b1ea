"""`DynamicInferenceEngine`: in-flight (continuous) batching over a `DynamicInferenceContext`.

`add_request(request_id, prompt, num_tokens_to_generate)` queues a request at any time; every `step` first
admits waiting requests while the context has room (request slots and prompt chunks with the guaranteed
reserve kept), then runs one forward over all active tokens (new prompts, or chunks of long prompts, mixed
with one-token decodes) and appends one sampled token per request whose prompt is complete. A request
finishes at `termination_id` or when it reaches `prompt + num_tokens_to_generate` tokens (default: up to
`max_sequence_length`); its memory is released at once, so waiting requests can join the next step.

Several ranks (tensor and/or pipeline parallelism): every rank runs the same engine loop with the same
`add_request` calls before the same steps. Admission and scheduling depend only on the requests and the
context's memory book-keeping, never on time or rank, and the sampled tokens of a step are those of the
last pipeline stage's tensor-parallel rank 0 on every rank, so all ranks take identical decisions and stay
in step (a rank that drifted would fail the step's collectives instead of generating silently).
"""
import time
from collections import OrderedDict, deque
from typing import Dict, List, Optional, Tuple, Union

import torch

from megatron.core.inference.contexts.dynamic_context import ContextOverflowError
from megatron.core.inference.engines.abstract_engine import AbstractEngine
from megatron.core.inference.inference_request import DynamicInferenceRequest, Status
from megatron.core.inference.sampling_params import SamplingParams


class DynamicInferenceEngine(AbstractEngine):
    """Continuous batching: requests join and leave between steps."""

    def __init__(self, controller, context, termination_id: int, enable_cuda_graph: bool = False,
                 random_seed: Optional[int] = None):
        self.controller = controller
        self.context = context
        self.termination_id = termination_id
        self.enable_cuda_graph = enable_cuda_graph
        if enable_cuda_graph:  # decode-only steps replay CUDA graphs per (request, chunk) bucket pair
            controller.inference_wrapped_model.set_decode_graphs(True)
        self.random_seed = random_seed
        if random_seed is not None:
            torch.random.manual_seed(random_seed)
        self.requests: Dict[int, DynamicInferenceRequest] = OrderedDict()
        self.waiting_request_ids: deque = deque()
        self.step_count = 0

    def _tokens_of(self, prompt: Union[str, List[int], torch.Tensor]) -> List[int]:
        if isinstance(prompt, str):
            return self.controller.tokenize_prompt(prompt)
        if isinstance(prompt, torch.Tensor):
            return [int(t) for t in prompt.view(-1).tolist()]  # [..] -> [n]
        return [int(t) for t in prompt]

    def add_request(self, request_id: int, prompt: Union[str, List[int], torch.Tensor],
                    num_tokens_to_generate: Optional[int] = None) -> DynamicInferenceRequest:
        """Queue a request (MaxSequenceLengthOverflowError when it can never fit)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id} is already in the engine")
        tokens = self._tokens_of(prompt)
        if num_tokens_to_generate is None:
            num_tokens_to_generate = self.context.max_sequence_length - len(tokens)
        self.context.check_request(len(tokens), num_tokens_to_generate)
        request = DynamicInferenceRequest(
            request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
            prompt_tokens=torch.tensor(tokens, dtype=torch.long), arrival_time=time.time(),
            status=Status.WAITING_IN_QUEUE, sampling_params=SamplingParams(num_tokens_to_generate=num_tokens_to_generate),
        )
        self.requests[request_id] = request
        self.waiting_request_ids.append(request_id)
        return request

    def has_unfinished_requests(self) -> bool:
        """Whether any request is active or waiting."""
        return bool(self.context.total_request_count) or bool(self.waiting_request_ids)

    def _admit_waiting(self) -> None:
        while self.waiting_request_ids:
            request = self.requests[self.waiting_request_ids[0]]
            try:
                self.context.add_request(request.request_id, request.prompt_tokens.tolist(),
                                         request.sampling_params.num_tokens_to_generate)
            except ContextOverflowError:
                if not self.context.total_request_count:
                    raise
                return
            request.status = Status.ACTIVE_AND_GENERATING_TOKENS
            self.waiting_request_ids.popleft()

    def step(self, sampling_params: SamplingParams, *, verbose: bool = False) -> Tuple[List[DynamicInferenceRequest], float]:
        """One forward for every active request; returns (requests finished in this step, step seconds)."""
        start = time.time()
        self._admit_waiting()
        if not self.context.total_request_count:
            return [], 0.0
        got, finished_ids = self.controller.generate_output_tokens_dynamic_batch(sampling_params,
                                                                                 self.termination_id)
        for request_id, token in got:  # the termination token ends a request without being part of it
            if token != self.termination_id:
                self.requests[request_id].generated_tokens.append(token)
        finished = []
        for request_id in finished_ids:
            request = self.requests.pop(request_id)
            request.status = Status.COMPLETED
            request.generated_length = len(request.generated_tokens)
            request.generated_text = self.controller.detokenize_generations(request.generated_tokens)
            finished.append(request)
        self.step_count += 1
        elapsed = time.time() - start
        if verbose:
            print(f"dynamic step {self.step_count}: {len(got)} tokens, {len(finished)} finished, "
                  f"{self.context.total_request_count} active, {len(self.waiting_request_ids)} waiting, "
                  f"{elapsed * 1e3:.1f} ms", flush=True)
        return finished, elapsed

    def generate(self, prompts: List[Union[str, List[int]]], sampling_params: Optional[SamplingParams] = None
                 ) -> List[DynamicInferenceRequest]:
        """Completed requests for `prompts` (ids 0..n-1), in prompt order."""
        sampling_params = sampling_params or SamplingParams()
        first = max([r for r in self.requests if isinstance(r, int)], default=-1) + 1
        ids = []
        for offset, prompt in enumerate(prompts):
            self.add_request(first + offset, prompt, sampling_params.num_tokens_to_generate)
            ids.append(first + offset)
        done: Dict[int, DynamicInferenceRequest] = {}
        while self.has_unfinished_requests():
            finished, _ = self.step(sampling_params)
            done.update((r.request_id, r) for r in finished)
        return [done[i] for i in ids]


__all__ = ["DynamicInferenceEngine"]
