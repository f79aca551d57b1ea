"""`InferenceParams`: the key/value cache bookkeeping of Megatron Core's static-batch inference.

Kept for import compatibility (`from megatron.core import InferenceParams`). The native attention of
this framework does not implement KV-cache decoding yet and rejects a non-None inference context.
"""
from typing import Dict, Tuple

import torch


class InferenceParams:
    """Per-layer key/value memory plus the current batch and sequence offsets."""

    def __init__(self, max_batch_size: int, max_sequence_length: int):
        self.max_sequence_length = max_sequence_length
        self.max_batch_size = max_batch_size
        self.current_batch_size = max_batch_size
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.decode_mode = False
        self.key_value_memory_dict: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    def swap_key_value_dict(self, batch_idx: torch.Tensor) -> None:
        """Reorder every cached key/value along the batch dimension (beam search)."""
        if not self.key_value_memory_dict:
            raise ValueError("swap_key_value_dict: the key/value cache is empty")
        for layer_number, (key, value) in self.key_value_memory_dict.items():
            self.key_value_memory_dict[layer_number] = (key[:, batch_idx], value[:, batch_idx])

    def reset(self) -> None:
        """Start a new sequence: offsets back to 0, cache kept allocated."""
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.decode_mode = False

    def __str__(self) -> str:
        return (
            f"InferenceParams(max_seq_len={self.max_sequence_length}, max_batch_size={self.max_batch_size}, "
            f"sequence_len_offset={self.sequence_len_offset}, batch_size_offset={self.batch_size_offset})"
        )


__all__ = ["InferenceParams"]
