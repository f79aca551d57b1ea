"""`Scheduler`: the request pools of the static engine (active, waiting, completed)."""
import time
from collections import OrderedDict
from typing import Optional

from megatron.core.inference.inference_request import InferenceRequest, Status
from megatron.core.inference.sampling_params import SamplingParams


class Scheduler:
    """Requests get ids `str(counter)` from 0; up to `max_batch_size` are active, the rest wait (FIFO)."""

    def __init__(self, max_batch_size: int):
        self.max_batch_size = max_batch_size
        self.active_request_pool: "OrderedDict[str, InferenceRequest]" = OrderedDict()
        self.waiting_request_pool: "OrderedDict[str, InferenceRequest]" = OrderedDict()
        self.completed_request_pool: "OrderedDict[str, InferenceRequest]" = OrderedDict()
        self.request_counter = 0

    def get_new_request_id(self) -> str:
        """The next request id."""
        request_id = str(self.request_counter)
        self.request_counter += 1
        return request_id

    def add_request(self, prompt: Optional[str] = None, prompt_tokens=None, encoder_prompt: Optional[str] = None,
                    inference_parameters: Optional[SamplingParams] = None, arrival_time: Optional[float] = None,
                    inference_request: Optional[InferenceRequest] = None) -> str:
        """Queue a request (a new one from the fields, or `inference_request`); returns its id."""
        if inference_request is None:
            inference_request = InferenceRequest(
                request_id=self.get_new_request_id(), prompt=prompt, sampling_params=inference_parameters,
                arrival_time=time.time() if arrival_time is None else arrival_time, prompt_tokens=prompt_tokens,
                encoder_prompt=encoder_prompt,
            )
        if len(self.active_request_pool) < self.max_batch_size:
            inference_request.status = Status.ACTIVE_BUT_NOT_GENERATING_TOKENS
            self.active_request_pool[inference_request.request_id] = inference_request
        else:
            inference_request.status = Status.WAITING_IN_QUEUE
            self.waiting_request_pool[inference_request.request_id] = inference_request
        return inference_request.request_id

    def have_requests_pending(self) -> bool:
        """Whether any request is active or waiting."""
        return bool(self.active_request_pool) or bool(self.waiting_request_pool)

    def update_requests_pools(self, result_dict: Optional["OrderedDict[str, InferenceRequest]"] = None) -> None:
        """Move completed requests out of the active pool and promote waiting ones."""
        for request_id, request in (result_dict or {}).items():
            if request.status == Status.COMPLETED:
                self.active_request_pool.pop(request_id, None)
                self.completed_request_pool[request_id] = request
        while self.waiting_request_pool and len(self.active_request_pool) < self.max_batch_size:
            request_id, request = self.waiting_request_pool.popitem(last=False)
            request.status = Status.ACTIVE_BUT_NOT_GENERATING_TOKENS
            self.active_request_pool[request_id] = request


__all__ = ["Scheduler"]
