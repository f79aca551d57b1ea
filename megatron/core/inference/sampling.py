"""Choosing the next token from last-position logits: greedy, temperature, top-k and top-p (nucleus).

`sample_from_logits(logits [b, V], top_k, top_p, temperature, vocab_size, generator)` follows Megatron Core's
`TextGenerationController.sample_from_logits`: `top_k == 1` is argmax; otherwise the logits are divided by the
temperature, filtered by top-k (k > 1) or top-p, and a token is drawn with `torch.multinomial`; the result is
clamped to `[0, vocab_size - 1]` (padded-vocabulary columns can never be returned).
"""
from typing import List, Optional

import torch


def check_sampling_values(top_k: int, top_p: float, temperature: float) -> List[str]:
    """The rule violations of one set of sampling values (empty when fine)."""
    problems = []
    if top_k < 0:
        problems.append(f"top_k ({top_k}) must be >= 0")
    if not 0.0 <= top_p <= 1.0:
        problems.append(f"top_p ({top_p}) must be in [0, 1]")
    if top_k > 0 and top_p > 0.0:
        problems.append(f"top_k ({top_k}) and top_p ({top_p}) cannot both be set: choose one")
    if temperature <= 0.0 and top_k != 1:
        problems.append(f"temperature ({temperature}) must be > 0 (or use top_k = 1 for greedy decoding)")
    return problems


def modify_logits_for_top_k_filtering(logits: torch.Tensor, top_k: int) -> None:
    """In place: logits below the k-th largest of their row become -inf."""
    kth = torch.topk(logits, top_k, dim=-1)[0][..., -1, None]  # [b, k] -> [b, 1]
    logits.masked_fill_(logits < kth, float("-inf"))


def modify_logits_for_top_p_filtering(logits: torch.Tensor, top_p: float) -> None:
    """In place: keep the most likely tokens until their cumulative probability exceeds `top_p`."""
    sorted_logits, sorted_indices = torch.sort(logits, descending=True, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative > top_p
    remove[..., 1:] = remove[..., :-1].clone()  # shift right: the token crossing the mass is kept
    remove[..., 0] = False
    remove_unsorted = remove.scatter(-1, sorted_indices, remove)
    logits.masked_fill_(remove_unsorted, float("-inf"))


def sample_from_logits(
    logits: torch.Tensor,
    top_k: int = 0,
    top_p: float = 0.0,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Next tokens [b] (int64) from logits [b, V]."""
    problems = check_sampling_values(top_k, top_p, temperature)
    if problems:
        raise ValueError("; ".join(problems))
    if vocab_size is not None and vocab_size < logits.size(-1):
        logits = logits[..., :vocab_size]
    if top_k == 1:
        return torch.argmax(logits, dim=-1)
    logits = logits.float().clone()
    if temperature != 1.0:
        logits.div_(temperature)
    if top_k > 1:
        modify_logits_for_top_k_filtering(logits, min(top_k, logits.size(-1)))
    elif top_p > 0.0:
        modify_logits_for_top_p_filtering(logits, top_p)
    probabilities = logits.softmax(dim=-1)
    sampled = torch.multinomial(probabilities, num_samples=1, generator=generator).view(-1)  # [b, 1] -> [b]
    limit = logits.size(-1) - 1 if vocab_size is None else vocab_size - 1
    return torch.clamp(sampled, min=0, max=limit)


__all__ = [
    "check_sampling_values",
    "modify_logits_for_top_k_filtering",
    "modify_logits_for_top_p_filtering",
    "sample_from_logits",
]
