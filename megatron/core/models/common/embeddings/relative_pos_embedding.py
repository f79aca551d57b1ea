"""`RelativePositionEmbedding`: T5's bucketed relative position bias for self-attention.

`forward(query_seq_length, key_seq_length)` returns the additive bias [1, np/tp, sq, sk] of this
tensor-parallel rank's heads: one learned scalar per (bucket of key_pos - query_pos, head). The
embedding is replicated over TP; the head split is `scatter_to_tensor_model_parallel_region` (forward:
keep this rank's heads; backward: all-gather), so every rank's embedding gets the gradient of all heads.
Buckets (as Megatron and the T5 paper): half the buckets are exact offsets, the rest grow
logarithmically up to `max_distance`; bidirectional stacks (the encoder) split the buckets by sign.
"""
import math
from typing import Callable

import torch

from megatron.core import tensor_parallel
from megatron.core.transformer.utils import get_tp_world_size


def _relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int,
                              max_distance: int) -> torch.Tensor:
    """Bucket index of every key_pos - query_pos offset."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).to(torch.long) * num_buckets
        distance = torch.abs(relative_position)
    else:
        distance = -torch.clamp(relative_position, max=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    scaled = torch.log(distance.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (scaled * (num_buckets - max_exact)).to(torch.long)
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


class RelativePositionEmbedding(torch.nn.Module):
    """Learned relative position bias of one stack (encoder: bidirectional, decoder: causal)."""

    def __init__(self, bidirectional: bool, init_method: Callable, num_attention_heads: int,
                 relative_attention_num_buckets: int = 32, relative_attention_max_distance: int = 128):
        super().__init__()
        self.bidirectional = bidirectional
        self.relative_attention_num_buckets = relative_attention_num_buckets
        self.relative_attention_max_distance = relative_attention_max_distance
        self.relative_attention_bias = torch.nn.Embedding(relative_attention_num_buckets, num_attention_heads)
        init_method(self.relative_attention_bias.weight)

    def _compute_bias(self, query_length: int, key_length: int) -> torch.Tensor:
        device = self.relative_attention_bias.weight.device
        context_position = torch.arange(query_length, dtype=torch.long, device=device)[:, None]  # [sq, 1]
        memory_position = torch.arange(key_length, dtype=torch.long, device=device)[None, :]  # [1, sk]
        bucket = _relative_position_bucket(memory_position - context_position, self.bidirectional,
                                           self.relative_attention_num_buckets, self.relative_attention_max_distance)
        values = self.relative_attention_bias(bucket)  # [sq, sk] -> [sq, sk, np]
        if get_tp_world_size(None) > 1:
            values = tensor_parallel.scatter_to_tensor_model_parallel_region(values)  # [sq, sk, np] -> [sq, sk, np/tp]
        return values.permute(2, 0, 1).unsqueeze(0)  # [sq, sk, np/tp] -> [1, np/tp, sq, sk]

    def forward(self, query_seq_length: int, key_seq_length: int) -> torch.Tensor:
        """Bias [1, np/tp, sq, sk] added to the attention scores."""
        return self._compute_bias(query_seq_length, key_seq_length)


__all__ = ["RelativePositionEmbedding"]
