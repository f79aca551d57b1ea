"""`Pooler`: tanh(W h[first token] + b), the input of BERT's binary head."""
from typing import Callable

import torch

from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import get_linear_layer


class Pooler(MegatronModule):
    """Dense + tanh over the hidden state at `sequence_index` (gathered first under sequence parallelism)."""

    def __init__(self, hidden_size: int, init_method: Callable, config: TransformerConfig,
                 sequence_parallel: bool = False):
        super().__init__(config)
        self.dense = get_linear_layer(hidden_size, hidden_size, init_method, config.perform_initialization)
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, sequence_index: int = 0) -> torch.Tensor:
        """[s, b, h] (or [s/tp, b, h] under SP) -> [b, h]."""
        if self.sequence_parallel:
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False)
        pooled = hidden_states[sequence_index, :, :]  # [s, b, h] -> [b, h]
        return torch.tanh(self.dense(pooled))


__all__ = ["Pooler"]
