"""`LanguageModelEmbedding`: token ids [b, s] -> embeddings [s, b, h] (scattered for sequence parallel).

Word embeddings are vocab-parallel; learned absolute position embeddings and token-type embeddings
are replicated. With sequence parallelism and no position embedding the vocab-parallel embedding
reduce-scatters straight to the sequence shard; otherwise the sum is scattered afterwards. Dropout
runs inside the model-parallel RNG fork only under sequence parallelism (each rank then holds a
different shard), as in Megatron.
"""
from typing import Literal, Optional

import torch

from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class LanguageModelEmbedding(MegatronModule):
    """Word (+ position, + token type) embeddings followed by dropout."""

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute",
        num_tokentypes: int = 0,
        scatter_to_sequence_parallel: bool = True,
        tp_group=None,
    ):
        super().__init__(config=config)
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.add_position_embedding = position_embedding_type == "learned_absolute"
        self.num_tokentypes = num_tokentypes
        self.scatter_to_sequence_parallel = scatter_to_sequence_parallel
        self.reduce_scatter_embeddings = (
            not self.add_position_embedding
            and num_tokentypes <= 0
            and config.sequence_parallel
            and scatter_to_sequence_parallel
        )
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            num_embeddings=vocab_size,
            embedding_dim=config.hidden_size,
            init_method=config.init_method,
            reduce_scatter_embeddings=self.reduce_scatter_embeddings,
            config=config,
            tp_group=tp_group,
        )
        if self.add_position_embedding:
            self.position_embeddings = torch.nn.Embedding(max_sequence_length, config.hidden_size)
            if config.perform_initialization:
                config.init_method(self.position_embeddings.weight)
        if num_tokentypes > 0:
            self.tokentype_embeddings = torch.nn.Embedding(num_tokentypes, config.hidden_size)
            if config.perform_initialization:
                config.init_method(self.tokentype_embeddings.weight)
        else:
            self.tokentype_embeddings = None
        self.embedding_dropout = torch.nn.Dropout(config.hidden_dropout)

    def zero_parameters(self):
        """Zero every embedding weight and mark them shared (used by tied-weight setups)."""
        for module in (self.word_embeddings, getattr(self, "position_embeddings", None), self.tokentype_embeddings):
            if module is not None:
                module.weight.data.fill_(0)
                module.weight.shared = True

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, tokentype_ids: Optional[torch.Tensor] = None):
        """[b, s] ids -> [s, b, h] (or [s/tp, b, h] under sequence parallelism)."""
        embeddings = self.word_embeddings(input_ids)
        if self.add_position_embedding:
            embeddings = embeddings + self.position_embeddings(position_ids)
        if not self.reduce_scatter_embeddings:
            embeddings = embeddings.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
        if tokentype_ids is not None:
            if self.tokentype_embeddings is None:
                raise ValueError("tokentype_ids were given but the embedding was built with num_tokentypes=0.")
            embeddings = embeddings + self.tokentype_embeddings(tokentype_ids).permute(1, 0, 2)  # [b, s, h] -> [s, b, h]
        if self.config.fp32_residual_connection:
            embeddings = embeddings.float()
        if not self.config.sequence_parallel:
            return self.embedding_dropout(embeddings)
        if not self.reduce_scatter_embeddings and self.scatter_to_sequence_parallel:
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
        if self.config.clone_scatter_output_in_embedding and self.scatter_to_sequence_parallel:
            embeddings = embeddings.clone()
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return self.embedding_dropout(embeddings)


__all__ = ["LanguageModelEmbedding"]
