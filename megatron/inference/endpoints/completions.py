"""OpenAI-compatible bodies: `POST /v1/completions` (also `/completions`) and `POST /v1/chat/completions`.

Parsing turns a body into generation arguments; the response builders turn finished requests into OpenAI's
JSON (`text_completion` / `chat.completion`, with `usage`) and their streaming chunks. Differences from
Megatron's `/completions`: `max_tokens` defaults to 16 (OpenAI's default) instead of being required, a list
of ints is one tokenized prompt (OpenAI's meaning; Megatron detokenizes only its first id), and `logprobs`
(top-n, at most 10) is also returned for generated tokens.
"""
import time
import uuid
from typing import Any, Dict, List, Optional

from megatron.inference.endpoints.common import MAX_PROMPTS, RequestError, get_bool, get_int, get_number, is_int

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def _check_ids(lists, tokenizer):
    vocab = tokenizer.vocab_size
    for ids in lists:
        if any(not 0 <= t < vocab for t in ids):
            raise RequestError(f"token ids must be in [0, {vocab})")
    return lists


def _prompts_of(prompt: Any, tokenizer):
    """(texts, token lists) of an OpenAI `prompt` value."""
    if isinstance(prompt, str):
        return [prompt], [list(tokenizer.tokenize(prompt))]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt), [list(tokenizer.tokenize(p)) for p in prompt]
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return [tokenizer.detokenize(prompt)], _check_ids([list(prompt)], tokenizer)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(is_int(t) for t in p)
                                                   for p in prompt):
        _check_ids(prompt, tokenizer)
        return [tokenizer.detokenize(p) for p in prompt], [list(p) for p in prompt]
    raise RequestError("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists")


def _sampling_of(body: Dict[str, Any]) -> Dict[str, Any]:
    temperature = get_number(body, "temperature", 1.0)
    if not 0.0 <= temperature <= 100.0:
        raise RequestError("temperature must be in [0, 100]")
    top_k = get_int(body, "top_k", 0, low=0, high=1000)
    top_p = get_number(body, "top_p", 1.0)
    if not 0.0 <= top_p <= 1.0:
        raise RequestError("top_p must be in [0, 1]")
    top_p = 0.0 if top_p == 1.0 else top_p  # 1.0 keeps every token: no nucleus filter
    if temperature == 0.0:  # greedy
        return dict(temperature=1.0, top_k=1, top_p=0.0)
    if top_k > 0 and top_p > 0.0:
        raise RequestError("cannot set both top_k and top_p (< 1.0)")
    return dict(temperature=temperature, top_k=top_k, top_p=top_p)


def _stop_of(body: Dict[str, Any]) -> List[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise RequestError("stop must be a non-empty string or a list of up to 4 non-empty strings")
    return stop


def _common(body: Dict[str, Any]) -> Dict[str, Any]:
    for name in ("n", "best_of"):
        if get_int(body, name, 1) != 1:
            raise RequestError(f"{name} must be 1")
    seed = get_int(body, "seed", None)
    return dict(stop=_stop_of(body), stream=get_bool(body, "stream", False),
                random_seed=None if seed is None or seed < 0 else seed, model=body.get("model", "megatron"))


def parse_completion_request(body: Any, tokenizer) -> Dict[str, Any]:
    """Generation arguments of a completions body."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if "prompt" not in body:
        raise RequestError("prompt is required")
    texts, tokens = _prompts_of(body["prompt"], tokenizer)
    if len(texts) > MAX_PROMPTS:
        raise RequestError(f"at most {MAX_PROMPTS} prompts per request")
    max_tokens = get_int(body, "max_tokens", 16, low=0)
    logprobs = get_int(body, "logprobs", 0, low=0, high=10) or 0
    echo = get_bool(body, "echo", False)
    if max_tokens == 0 and not echo:
        raise RequestError("max_tokens = 0 requires echo = true")
    parsed = dict(texts=texts, prompt_tokens=tokens, max_tokens=max_tokens, logprobs=logprobs, echo=echo,
                  **_sampling_of(body), **_common(body))
    if parsed["stream"] and len(texts) != 1:
        raise RequestError("stream = true needs exactly one prompt")
    return parsed


def render_chat(messages: List[Dict[str, str]], tokenizer) -> str:
    """The prompt text of a chat: the tokenizer's chat template when it has one, else 'role: content' lines."""
    hf = getattr(tokenizer, "_tokenizer", None)
    if hf is not None and getattr(hf, "chat_template", None) and hasattr(hf, "apply_chat_template"):
        return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nassistant:"


def parse_chat_request(body: Any, tokenizer) -> Dict[str, Any]:
    """Generation arguments of a chat-completions body."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES \
                or not isinstance(message.get("content"), str):
            raise RequestError(f"messages[{index}] must be an object with a role in {list(CHAT_ROLES)} and a "
                               "string content")
    text = render_chat(messages, tokenizer)
    max_tokens = get_int(body, "max_tokens", None, low=1)
    if max_tokens is None:
        max_tokens = get_int(body, "max_completion_tokens", 16, low=1)
    if body.get("logprobs") not in (None, False):
        raise RequestError("logprobs are not supported on /v1/chat/completions")
    return dict(texts=[text], prompt_tokens=[list(tokenizer.tokenize(text))], max_tokens=max_tokens, logprobs=0,
                echo=False, **_sampling_of(body), **_common(body))


def cut_at_stop(text: str, stop: List[str]):
    """(text before the first stop string, whether one was found)."""
    cuts = [text.find(s) for s in stop if s in text]
    if not cuts:
        return text, False
    return text[:min(cuts)], True


def finish_reason(request, max_tokens: int, stopped: bool) -> str:
    return "stop" if stopped or request.generated_length < max_tokens else "length"


def _logprobs_object(request, tokenizer, echo: bool, prompt_text: str) -> Dict[str, Any]:
    tokens = (list(request.prompt_tokens) if echo else []) + list(request.generated_tokens)
    values = ([None] + list(request.prompt_log_probs or []) if echo else []) + list(request.generated_log_probs or [])
    top = ([None] + list(request.prompt_top_n_logprobs or []) if echo else []) + \
        list(request.generated_top_n_logprobs or [])
    strings = [tokenizer.detokenize([t]) for t in tokens]
    offsets, position = [], 0 if echo else len(prompt_text)
    for piece in strings:
        offsets.append(position)
        position += len(piece)
    return {"tokens": strings, "token_logprobs": values, "text_offset": offsets, "top_logprobs": top}


def usage_of(requests) -> Dict[str, int]:
    prompt = sum(len(r.prompt_tokens) for r in requests)
    completion = sum(r.generated_length for r in requests)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_response(parsed: Dict[str, Any], requests, tokenizer) -> Dict[str, Any]:
    """OpenAI `text_completion` JSON of finished requests."""
    choices = []
    for index, request in enumerate(requests):
        text, stopped = cut_at_stop(request.generated_text, parsed["stop"])
        if parsed["echo"]:
            text = request.prompt + text
        choice = {"index": index, "text": text, "logprobs": None,
                  "finish_reason": finish_reason(request, parsed["max_tokens"], stopped)}
        if parsed["logprobs"]:
            choice["logprobs"] = _logprobs_object(request, tokenizer, parsed["echo"], request.prompt)
        choices.append(choice)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": parsed["model"], "choices": choices, "usage": usage_of(requests)}


def chat_response(parsed: Dict[str, Any], requests) -> Dict[str, Any]:
    """OpenAI `chat.completion` JSON of a finished request."""
    request = requests[0]
    text, stopped = cut_at_stop(request.generated_text, parsed["stop"])
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": parsed["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish_reason(request, parsed["max_tokens"], stopped)}],
            "usage": usage_of(requests)}


def stream_chunk(chat: bool, stream_id: str, model: str, delta: Optional[str], reason: Optional[str] = None,
                 first: bool = False) -> Dict[str, Any]:
    """One streaming chunk (`text_completion` or `chat.completion.chunk`)."""
    if chat:
        content = {} if delta is None else {"content": delta}
        if first:
            content["role"] = "assistant"
        choice = {"index": 0, "delta": content, "finish_reason": reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
        kind = "text_completion"
    return {"id": stream_id, "object": kind, "created": int(time.time()), "model": model, "choices": [choice]}


__all__ = ["parse_completion_request", "parse_chat_request", "completion_response", "chat_response",
           "stream_chunk", "cut_at_stop", "render_chat"]
