"""`BertLMHead`: dense -> GeLU -> layer norm before BERT's (tied) output layer."""
import torch

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import get_linear_layer


class BertLMHead(MegatronModule):
    """Transform of the encoder output before the output projection (keys `dense.*`, `layer_norm.*`)."""

    def __init__(self, hidden_size: int, config: TransformerConfig):
        super().__init__(config=config)
        self.dense = get_linear_layer(hidden_size, hidden_size, config.init_method, config.perform_initialization)
        # replicated over TP but applied to sequence shards under SP: gradients are all-reduced over TP
        setattr(self.dense.weight, "sequence_parallel", config.sequence_parallel)
        setattr(self.dense.bias, "sequence_parallel", config.sequence_parallel)
        self.layer_norm = WrappedTorchNorm(config=config, hidden_size=hidden_size, eps=config.layernorm_epsilon)
        self.gelu = torch.nn.functional.gelu

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[s, b, h] -> [s, b, h]."""
        return self.layer_norm(self.gelu(self.dense(hidden_states)))


__all__ = ["BertLMHead"]
