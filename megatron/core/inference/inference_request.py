"""Requests of the inference engines: `InferenceRequest` (static engine) and `DynamicInferenceRequest`."""
import warnings
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

import torch

from megatron.core.inference.sampling_params import SamplingParams


class Status(Enum):
    """Where a request is in its life."""

    WAITING_IN_QUEUE = 1
    ACTIVE_AND_GENERATING_TOKENS = 2
    ACTIVE_BUT_NOT_GENERATING_TOKENS = 3
    COMPLETED = 4


@dataclass(kw_only=True)
class InferenceRequest:
    """One prompt and everything generated for it."""

    request_id: str
    """Engine-assigned id (`str(counter)` from 0)."""

    prompt: str
    """The prompt text."""

    sampling_params: Optional[SamplingParams] = None
    """How tokens are chosen."""

    inference_parameters: Optional[SamplingParams] = None
    """Deprecated name of `sampling_params` (copied into it)."""

    prompt_tokens: Optional[List[int]] = None
    """Token ids of the prompt."""

    arrival_time: Optional[float] = None
    """`time.time()` when the request was added."""

    status: Optional[Status] = None
    """Current status."""

    encoder_prompt: Optional[str] = None
    """Encoder input of encoder-decoder models (unused for GPT)."""

    generated_text: Optional[str] = None
    """Detokenized generation (without the prompt)."""

    segments: Optional[List[str]] = None
    """Per-token strings of prompt + generation (with `return_segments`)."""

    generated_segments: Optional[List[str]] = None
    """Per-token strings of the generation."""

    generated_sequence_lengths: Optional[List[int]] = None
    """Generated lengths (beam search)."""

    generated_tokens: Optional[Any] = None
    """Generated token ids (the final EOD is not included)."""

    prompt_log_probs: Optional[List[float]] = None
    """Log-probability of prompt token i+1 given tokens 0..i (p - 1 values)."""

    generated_log_probs: Optional[List[float]] = None
    """Log-probability of every generated token."""

    prompt_top_n_logprobs: Optional[List[Dict[str, float]]] = None
    """Per prompt position, {token string: log-prob} of the n most likely tokens."""

    generated_top_n_logprobs: Optional[List[Dict[str, float]]] = None
    """Per generated position, {token string: log-prob} of the n most likely tokens."""

    generated_length: Optional[int] = None
    """Number of generated tokens."""

    def __post_init__(self):
        if self.sampling_params is None and self.inference_parameters is not None:
            warnings.warn("InferenceRequest.inference_parameters is deprecated: use sampling_params",
                          DeprecationWarning, stacklevel=2)
            self.sampling_params = self.inference_parameters


@dataclass(kw_only=True)
class DynamicInferenceRequest(InferenceRequest):
    """A request of the dynamic engine: an integer id and a token tensor prompt."""

    request_id: int
    """Caller-chosen id."""

    prompt: Optional[str] = None
    """The prompt text, if it was given as text."""

    prompt_tokens: Optional[torch.Tensor] = None
    """Prompt token ids (int64 tensor)."""

    generated_tokens: List[int] = field(default_factory=list)
    """Tokens generated so far."""


@dataclass(kw_only=True)
class VLMInferenceRequest(InferenceRequest):
    """A request carrying images (vision-language models)."""

    num_img_embeddings_per_tile: int = 0
    """Image embeddings per tile."""

    imgs: Optional[torch.Tensor] = None
    """Image tiles."""

    num_tiles: Optional[torch.Tensor] = None
    """Tiles per image."""

    decoder_seq_length: int = 0
    """Decoder sequence length including image embeddings."""


__all__ = ["Status", "InferenceRequest", "DynamicInferenceRequest", "VLMInferenceRequest"]
