"""`TextGenerationController`: tokenization, the static-batch generation loop and the dynamic-batch step.

Static batch (`generate_all_output_tokens_static_batch`, Megatron Core's loop): every request uses the FIRST
request's sampling params; prompts are padded with EOD to `max_prompt + num_tokens_to_generate`; the first
forward covers columns `[0, min_prompt)`, then one column per step. A sampled token is written into column
`end` only for rows whose prompt has ended (`prompt_len <= end`); shorter prompts start generating earlier
while longer ones still read their own prompt tokens. A row is done after sampling EOD; the EOD is not part
of `generated_tokens`.

Several ranks: every rank runs the same loop; the wrapper returns the same logits on every rank (gathered
over TP, broadcast from the last pipeline stage) and the sampled tokens of the last stage's TP rank 0. A
dynamic step's schedule travels with its tokens, so a rank that drifted out of step raises instead of
generating for other requests.
"""
import zlib
from collections import OrderedDict
from typing import Callable, Dict, List, Optional

import torch

from megatron.core.inference.inference_request import InferenceRequest, Status
from megatron.core.inference.sampling import sample_from_logits
from megatron.core.inference.sampling_params import SamplingParams


class _LaggedFlag:
    """A device boolean read one step late on CUDA (no host sync per token), at once elsewhere.

    `update(flag)` starts copying `flag` to pinned host memory and returns the value copied at the previous
    call: the loop stops one step after every row is done, and that extra step only writes columns past
    each row's generated length, which are never read."""

    def __init__(self, device: torch.device):
        self.lagged = device.type == "cuda"
        self._host = torch.zeros(2, dtype=torch.bool, pin_memory=True) if self.lagged else None
        self._event = None
        self._slot = 0

    def update(self, flag: torch.Tensor) -> bool:
        if not self.lagged:
            return bool(flag)
        previous = False
        if self._event is not None:
            self._event.synchronize()
            previous = bool(self._host[1 - self._slot])
        self._host[self._slot].copy_(flag, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()
        self._slot = 1 - self._slot
        return previous


def _step_fingerprint(layout) -> List[int]:
    """(requests, tokens, CRC-32 of the (request id, query length) pairs) of a dynamic step: equal on every
    rank that is in step (checked by `broadcast_sampled_tokens`)."""
    pairs = repr(list(zip(layout.request_ids, layout.query_lengths))).encode()
    return [len(layout.request_ids), sum(layout.query_lengths), zlib.crc32(pairs)]


class TextGenerationController:
    """Turns requests into tokens with an inference-wrapped model and a tokenizer."""

    def __init__(self, inference_wrapped_model, tokenizer):
        self.inference_wrapped_model = inference_wrapped_model
        self.tokenizer = tokenizer
        self.stream_callbacks: Dict[str, Callable] = {}
        """request_id -> callback(request_id, generated token ids so far), called after every step."""

    def tokenize_prompt(self, prompt: str, add_BOS: bool = False) -> List[int]:
        """Prompt token ids (BOS first when asked and the tokenizer has one)."""
        tokens = list(self.tokenizer.tokenize(prompt))
        if not add_BOS:
            return tokens
        try:
            bos = self.tokenizer.bos
        except (AttributeError, NotImplementedError):
            bos = None
        return tokens if bos is None else [bos] + tokens

    def detokenize_generations(self, tokens: List[int]) -> str:
        """Text of token ids."""
        return self.tokenizer.detokenize(tokens)

    def _segments(self, tokens: List[int], text: str) -> List[str]:
        offsets_of = getattr(self.tokenizer, "offsets", None)
        try:
            offsets = offsets_of(tokens, text) if offsets_of is not None else None
        except (NotImplementedError, TypeError, ValueError):
            offsets = None
        if offsets is None:
            return [self.tokenizer.detokenize([t]) for t in tokens]
        ends = list(offsets[1:]) + [len(text)]
        return [text[start:end] for start, end in zip(offsets, ends)]

    def sample_from_logits(self, last_token_logits: torch.Tensor, sampling_params: Optional[SamplingParams] = None,
                           vocab_size: Optional[int] = None, generator: Optional[torch.Generator] = None,
                           **kwargs) -> torch.Tensor:
        """Next tokens [b] from logits [b, V] (greedy / temperature / top-k / top-p), equal on all ranks."""
        if sampling_params is None:
            sampling_params = SamplingParams(**kwargs)
        return self._sample(last_token_logits, sampling_params, vocab_size, generator)

    def _sample(self, logits: torch.Tensor, params: SamplingParams, vocab_size: Optional[int] = None,
                generator: Optional[torch.Generator] = None, step_fingerprint: Optional[List[int]] = None):
        """Tokens [b] sampled from `logits` [b, V], those of the last stage's TP rank 0 on every rank."""
        if vocab_size is None:
            vocab_size = getattr(self.tokenizer, "vocab_size", None)
        tokens = sample_from_logits(logits, params.top_k, params.top_p, params.temperature, vocab_size, generator)
        return self.inference_wrapped_model.broadcast_sampled_tokens(tokens, step_fingerprint)

    def _top_n(self, log_probs: torch.Tensor, n: int) -> List[Dict[str, float]]:
        values, indices = torch.topk(log_probs, n, dim=-1)
        return [{self.tokenizer.detokenize([int(i)]): float(v) for v, i in zip(vs, ids)}
                for vs, ids in zip(values.tolist(), indices.tolist())]

    def _padded_batch(self, requests: List[InferenceRequest], num_tokens: int):
        lengths = [len(r.prompt_tokens) for r in requests]
        max_len = max(lengths) + num_tokens
        limit = self.inference_wrapped_model.inference_wrapper_config.inference_max_seq_length
        if max_len > limit:
            raise ValueError(f"the longest prompt ({max(lengths)} tokens) + tokens to generate ({num_tokens}) = "
                             f"{max_len} exceed --inference-max-seq-length ({limit})")
        device = self.inference_wrapped_model.device
        tokens = torch.full((len(requests), max_len), self.tokenizer.eod, dtype=torch.long, device=device)
        for row, request in enumerate(requests):
            tokens[row, :lengths[row]] = torch.tensor(request.prompt_tokens, dtype=torch.long, device=device)
        return tokens, torch.tensor(lengths, device=device), max_len

    @torch.no_grad()
    def generate_all_output_tokens_static_batch(
        self, active_requests: "OrderedDict[str, InferenceRequest]"
    ) -> "OrderedDict[str, InferenceRequest]":
        """Generate for a whole batch at once; returns the requests, completed."""
        requests = list(active_requests.values())
        params = requests[0].sampling_params
        num_tokens = params.num_tokens_to_generate
        tokens, lengths, max_len = self._padded_batch(requests, num_tokens)
        wrapper = self.inference_wrapped_model
        wrapper.prep_model_for_inference(tokens)
        inference_input = wrapper.prep_inference_input(tokens)
        context = wrapper.inference_context
        want_prompt_scores = params.return_log_probs or (params.top_n_logprobs and params.return_prompt_top_n_logprobs)
        context.materialize_only_last_token_logits = not want_prompt_scores
        batch = tokens.size(0)
        log_probs = torch.zeros(batch, max(max_len - 1, 0), device=tokens.device)
        top_n: List[List[Dict[str, float]]] = [[] for _ in range(batch)]
        done = torch.zeros(batch, dtype=torch.bool, device=tokens.device)
        gen_len = torch.zeros(batch, dtype=torch.long, device=tokens.device)
        host_lengths = [len(r.prompt_tokens) for r in requests]
        all_done = _LaggedFlag(tokens.device)
        start, end = 0, min(host_lengths) if num_tokens > 0 else max_len
        while True:
            window = wrapper.get_batch_for_context_window(inference_input, start, end)
            logits = wrapper.run_one_forward_step(window)  # [b, end - start or 1, V]
            if end < max_len:  # with num_tokens_to_generate == 0 the prompts are only scored
                started = lengths <= end
                last = logits[:, -1, :]
                sampled = self.sample_from_logits(last, params)
                tokens[:, end] = torch.where(started, sampled, tokens[:, end])
                if params.top_n_logprobs and not want_prompt_scores:
                    for row, entry in enumerate(self._top_n(torch.log_softmax(last.float(), -1), params.top_n_logprobs)):
                        if bool(started[row]):
                            top_n[row].append(entry)
                done |= (sampled == self.tokenizer.eod) & started
                gen_len += (~done & started).long()
                self._stream(requests, tokens, lengths, gen_len, num_tokens)
            if want_prompt_scores:  # after the write: column `end` is a target of this window
                self._record_log_probs(logits, tokens, start, end, log_probs, top_n, params)
            if end + 1 > max_len - 1 or all_done.update(done.all()):
                break
            if max(host_lengths) <= end:
                context.enable_decode_mode()
            start, end = end, end + 1
        for row, request in enumerate(requests):
            self._finish_request(request, tokens[row], int(lengths[row]), int(gen_len[row]), num_tokens,
                                 log_probs[row], top_n[row], params)
        return active_requests

    def _record_log_probs(self, logits, tokens, start, end, log_probs, top_n, params):
        """log P(token j+1 | tokens <= j) for the window's columns j in [start, end) (j < max_len - 1)."""
        stop = min(end, tokens.size(1) - 1)
        if stop <= start:
            return
        scores = torch.log_softmax(logits[:, : stop - start].float(), dim=-1)  # [b, w, V]
        targets = tokens[:, start + 1: stop + 1]
        log_probs[:, start:stop] = scores.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [b, w, 1] -> [b, w]
        if params.top_n_logprobs:
            for row in range(tokens.size(0)):
                top_n[row].extend(self._top_n(scores[row], params.top_n_logprobs))

    def _stream(self, requests, tokens, lengths, gen_len, num_tokens):
        for row, request in enumerate(requests):
            callback = self.stream_callbacks.get(request.request_id)
            if callback is not None:
                count = min(int(gen_len[row]), num_tokens)
                start = int(lengths[row])
                callback(request.request_id, tokens[row, start:start + count].tolist())

    def _finish_request(self, request, row_tokens, prompt_len, gen_len, num_tokens, log_probs, top_n, params):
        generated = min(gen_len, num_tokens)
        all_tokens = row_tokens[: prompt_len + generated].tolist()
        request.generated_tokens = all_tokens[prompt_len:]
        request.generated_length = generated
        text = self.detokenize_generations(all_tokens)
        if text.startswith(request.prompt):
            request.generated_text = text[len(request.prompt):]
        else:
            request.generated_text = self.detokenize_generations(request.generated_tokens)
        if params.return_log_probs:
            request.prompt_log_probs = log_probs[: prompt_len - 1].tolist()
            request.generated_log_probs = log_probs[prompt_len - 1: prompt_len - 1 + generated].tolist()
        if params.top_n_logprobs:
            if params.return_prompt_top_n_logprobs:
                request.prompt_top_n_logprobs = top_n[: prompt_len - 1]
                request.generated_top_n_logprobs = top_n[prompt_len - 1: prompt_len - 1 + generated]
            else:
                request.generated_top_n_logprobs = top_n[:generated]
        if params.return_segments:
            request.segments = self._segments(all_tokens, text)
            request.generated_segments = request.segments[prompt_len:]
        request.status = Status.COMPLETED

    @torch.no_grad()
    def generate_output_tokens_dynamic_batch(self, sampling_params: SamplingParams, termination_id: int):
        """One dynamic step: (request ids that got a token, their tokens [R'], ids of finished requests)."""
        wrapper = self.inference_wrapped_model
        context = wrapper.inference_context
        input_ids, position_ids = context.initialize_step(device=wrapper.device)
        logits = wrapper.run_one_forward_step({"tokens": input_ids, "position_ids": position_ids,
                                               "attention_mask": None})
        if not context.materialize_only_last_token_logits and context.step_layout.graph_key is None:
            logits = logits[:, context.step_layout.last_token_index]  # [1, T, V] -> [1, R, V]
        sampled = self._sample(logits[0], sampling_params, step_fingerprint=_step_fingerprint(context.step_layout))
        scheduled = context.step_layout.request_ids
        sampling = set(context.sampling_request_ids())
        finished = context.update_requests(sampled, termination_id)
        got = [(rid, int(tok)) for rid, tok in zip(scheduled, sampled.tolist()) if rid in sampling]
        return got, finished


SimpleTextGenerationController = TextGenerationController

__all__ = ["TextGenerationController", "SimpleTextGenerationController"]
