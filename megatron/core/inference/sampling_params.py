"""`SamplingParams`: how the tokens of one request are chosen (Megatron Core's field names and defaults)."""
from dataclasses import dataclass


@dataclass
class SamplingParams:
    """Sampling settings of a request.

    `top_k == 1` is greedy decoding; `top_k > 1` keeps the k most likely tokens; `0 < top_p <= 1` keeps the
    smallest set whose probability reaches `top_p`. `top_k > 0` and `top_p > 0` together are rejected.
    """

    temperature: float = 1.0
    """Divides the logits before top-k / top-p filtering and sampling (1.0: unchanged)."""

    top_k: int = 0
    """Keep the k largest logits (0: no top-k filter; 1: greedy argmax)."""

    top_p: float = 0.0
    """Nucleus sampling mass (0.0: no top-p filter)."""

    return_log_probs: bool = False
    """Return the log-probabilities of the prompt and generated tokens."""

    return_segments: bool = False
    """Return the per-token detokenized strings (`InferenceRequest.segments`)."""

    num_tokens_to_generate: int = 30
    """How many tokens to generate (0 with `echo`: only score the prompt)."""

    top_n_logprobs: int = 0
    """Per generated position, also return the n most likely tokens and their log-probabilities."""

    return_prompt_top_n_logprobs: bool = False
    """With `top_n_logprobs`, also return them for every prompt position."""

    def add_attributes(self, attribute_value_pair: dict) -> None:
        """Attach extra attributes (for example `echo`, `stop_words`, `stop_token_ids`)."""
        for key, value in attribute_value_pair.items():
            setattr(self, key, value)


__all__ = ["SamplingParams"]
