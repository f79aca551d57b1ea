"""Shared request checks of the REST routes; every failure is a `RequestError` (an HTTP status + message)."""
from typing import Any, Dict, List, Optional

MAX_PROMPTS = 128


class RequestError(Exception):
    """A bad request: answered with `status` and `message`, the server keeps serving."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return (isinstance(value, (int, float))) and not isinstance(value, bool)


def get_bool(body: Dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean value")
    return value


def get_int(body: Dict[str, Any], name: str, default: Optional[int], low: Optional[int] = None,
            high: Optional[int] = None) -> Optional[int]:
    value = body.get(name, default)
    if value is None:
        return None
    if not is_int(value):
        raise RequestError(f"{name} must be an integer")
    if low is not None and value < low:
        raise RequestError(f"{name} must be >= {low}")
    if high is not None and value > high:
        raise RequestError(f"{name} must be <= {high}")
    return value


def get_number(body: Dict[str, Any], name: str, default: float) -> float:
    value = body.get(name, default)
    if not is_number(value):
        raise RequestError(f"{name} must be a number")
    return float(value)


def check_prompt_lengths(tokenized: List[List[int]], tokens_to_generate: int, max_sequence_length: int) -> None:
    """Every prompt + tokens to generate must fit the engine's sequence length."""
    for index, tokens in enumerate(tokenized):
        if len(tokens) + tokens_to_generate > max_sequence_length:
            raise RequestError(
                f"prompt {index} has {len(tokens)} tokens; with {tokens_to_generate} tokens to generate that "
                f"exceeds the server's maximum sequence length ({max_sequence_length})"
            )
        if not tokens:
            raise RequestError(f"prompt {index} is empty after tokenization")


def parse_api_request(body: Any) -> Dict[str, Any]:
    """The generation arguments of a `PUT /api` body (Megatron's fields, defaults and rules)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if "prompts" not in body:
        raise RequestError("prompts argument required")
    if "max_len" in body:
        raise RequestError("max_len is no longer used.  Replace with tokens_to_generate")
    if "sentences" in body:
        raise RequestError("sentences is no longer used.  Replace with prompts")
    prompts = body["prompts"]
    if not isinstance(prompts, list):
        raise RequestError("prompts is not a list of strings")
    if not prompts:
        raise RequestError("prompts is empty")
    if len(prompts) > MAX_PROMPTS:
        raise RequestError(f"Maximum number of prompts is {MAX_PROMPTS}")
    if not all(isinstance(p, str) for p in prompts):
        raise RequestError("prompts is not a list of strings")
    tokens_to_generate = get_int(body, "tokens_to_generate", 64, low=0)
    logprobs = get_bool(body, "logprobs", False)
    if tokens_to_generate == 0 and not logprobs:
        raise RequestError("tokens_to_generate=0 implies logprobs should be True")
    temperature = get_number(body, "temperature", 1.0)
    if not 0.0 < temperature <= 100.0:
        raise RequestError("temperature must be a positive number less than or equal to 100.0")
    top_k = get_int(body, "top_k", 0)
    if not 0 <= top_k <= 1000:
        raise RequestError("top_k must be equal to or greater than 0 and less than or equal to 1000")
    top_p = body.get("top_p", 0.0)
    if not isinstance(top_p, float) and not (is_int(top_p) and top_p == 0):
        raise RequestError("top_p must be a positive float less than or equal to 1.0")
    top_p = float(top_p)
    if top_p > 0.0 and top_k > 0:
        raise RequestError("cannot set both top-k and top-p samplings.")
    if not 0.0 <= top_p <= 1.0:
        raise RequestError("top_p must be less than or equal to 1.0")
    _check_top_p_extras(body, top_p)
    add_bos = get_bool(body, "add_BOS", False)
    if any(len(p) == 0 for p in prompts) and not add_bos:
        raise RequestError("Empty prompts require add_BOS=true")
    for name in ("stop_on_double_eol", "stop_on_eol", "prevent_newline_after_colon", "no_log"):
        get_bool(body, name, False)
    random_seed = get_int(body, "random_seed", -1)
    if random_seed != -1 and random_seed < 0:
        raise RequestError("random_seed must be a positive integer")
    if body.get("beam_width") is not None:
        raise RequestError("beam search (beam_width) is not supported by this server", status=422)
    return dict(prompts=prompts, tokens_to_generate=tokens_to_generate, logprobs=logprobs, temperature=temperature,
                top_k=top_k, top_p=top_p, random_seed=None if random_seed < 0 else random_seed,
                no_log=body.get("no_log", False))


def _check_top_p_extras(body: Dict[str, Any], top_p: float) -> None:
    decay = body.get("top_p_decay", 0.0)
    if not isinstance(decay, float) and not (is_int(decay) and decay == 0):
        raise RequestError("top_p_decay must be a float")
    if decay and top_p == 0.0:
        raise RequestError("top_p_decay cannot be set without top_p")
    if not 0.0 <= decay <= 1.0:
        raise RequestError("top_p_decay must be less than or equal to 1.0")
    bound = body.get("top_p_bound", 0.0)
    if not isinstance(bound, float) and not (is_int(bound) and bound == 0):
        raise RequestError("top_p_bound must be a float")
    if bound and top_p == 0.0:
        raise RequestError("top_p_bound cannot be set without top_p")
    if bound and not 0.0 < bound <= top_p:
        raise RequestError("top_p_bound must be greater than 0 and less than top_p")


__all__ = ["RequestError", "parse_api_request", "check_prompt_lengths", "get_bool", "get_int", "get_number",
           "MAX_PROMPTS"]
