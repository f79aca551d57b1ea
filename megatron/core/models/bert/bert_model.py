"""`BertModel`: embeddings (word, position, token type) -> encoder -> LM head + optional pooler and binary head.

Megatron Core's signature, module names and state-dict keys (`embedding.*`, `encoder.*`, `lm_head.*`,
`output_layer.bias` (+ `.weight` when untied), `pooler.dense.*`, `binary_head.*`). The padding mask
[b, s] (1 = real token) becomes Megatron's boolean key mask [b, 1, 1, s] (True = masked; the form Megatron
passes Transformer Engine >= 1.10): every real token attends to every real token; rows of padded queries
are never read by the loss, the pooler (token 0) or the next layer's real tokens. A batch without padding
passes no mask at all (`attention_mask=None`, non-causal), so SDPA runs its flash kernel; a padded batch
keeps the broadcast [b, 1, 1, s] key mask (memory-efficient / cuDNN kernels; no [b, 1, s, s] mask is built).
"""
from typing import Literal, Optional

import torch

from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.bert.bert_lm_head import BertLMHead
from megatron.core.models.bert.pooler import Pooler
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import get_linear_layer


class BertModel(LanguageModule):
    """BERT encoder language model (one pipeline stage of it)."""

    def __init__(
        self,
        config: TransformerConfig,
        num_tokentypes: int,
        transformer_layer_spec: ModuleSpec,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute",
        rotary_percent: float = 1.0,
        seq_len_interpolation_factor: Optional[float] = None,
        add_binary_head: bool = True,
        return_embeddings: bool = False,
        vp_stage: Optional[int] = None,
        model_comm_pgs=None,
    ):
        super().__init__(config=config, model_comm_pgs=model_comm_pgs)
        if position_embedding_type not in ("learned_absolute", "rope"):
            raise ValueError(f"position_embedding_type ({position_embedding_type!r}) must be 'learned_absolute' or "
                             "'rope' for BERT.")
        if return_embeddings and parallel_output is False:
            raise ValueError("return_embeddings needs parallel_output=True (as in Megatron-LM).")
        self.config = config
        self.transformer_layer_spec = transformer_layer_spec
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.add_binary_head = add_binary_head
        self.return_embeddings = return_embeddings
        self.model_type = ModelType.encoder_or_decoder
        self.vp_stage = vp_stage
        tp_group = getattr(model_comm_pgs, "tp", None) if model_comm_pgs is not None else None
        if self.pre_process:
            self.embedding = LanguageModelEmbedding(
                config=config, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                position_embedding_type=position_embedding_type, num_tokentypes=num_tokentypes, tp_group=tp_group)
        if position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(
                kv_channels=config.kv_channels, rotary_percent=rotary_percent,
                rotary_interleaved=config.rotary_interleaved, seq_len_interpolation_factor=seq_len_interpolation_factor,
                use_cpu_initialization=config.use_cpu_initialization)
        self.encoder = TransformerBlock(config=config, spec=transformer_layer_spec, pre_process=pre_process,
                                        post_process=post_process, model_comm_pgs=model_comm_pgs, vp_stage=vp_stage)
        if self.post_process:
            self.lm_head = BertLMHead(config.hidden_size, config)
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size, vocab_size, config=config, init_method=config.init_method, bias=True,
                skip_bias_add=False, gather_output=not parallel_output,
                skip_weight_param_allocation=pre_process and share_embeddings_and_output_weights, tp_group=tp_group)
            self.binary_head = None
            if add_binary_head:
                self.binary_head = get_linear_layer(config.hidden_size, 2, config.init_method,
                                                    config.perform_initialization)
                self.pooler = Pooler(config.hidden_size, config.init_method, config, config.sequence_parallel)
        if self.pre_process or self.post_process:
            self.setup_embeddings_and_output_layer()

    @staticmethod
    def bert_extended_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
        """Padding mask [b, s] (1 = token) -> boolean key mask [b, 1, 1, s], True = masked."""
        return attention_mask[:, None, None, :] < 0.5  # [b, s] -> [b, 1, 1, s]

    @staticmethod
    def encoder_attention_mask(attention_mask: torch.Tensor) -> Optional[torch.Tensor]:
        """The key mask the encoder gets: None when no row has padding (attention over all tokens is then
        the same, and SDPA can use its flash kernel), else `bert_extended_attention_mask`. The check reads
        one value on the host; it is skipped (mask kept) while compiling or capturing a CUDA graph."""
        capturing = attention_mask.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and not torch.compiler.is_compiling() and bool(attention_mask.bool().all()):
            return None
        return BertModel.bert_extended_attention_mask(attention_mask)

    @staticmethod
    def bert_position_ids(token_ids: torch.Tensor) -> torch.Tensor:
        """Positions 0..s-1 of every row: [b, s]."""
        seq_length = token_ids.size(1)
        position_ids = torch.arange(seq_length, dtype=torch.long, device=token_ids.device)
        return position_ids.unsqueeze(0).expand_as(token_ids)  # [s] -> [b, s]

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline input from the previous stage (a tensor or a one-element list)."""
        if not isinstance(input_tensor, list):
            input_tensor = [input_tensor]
        if len(input_tensor) != 1:
            raise ValueError(f"BertModel.set_input_tensor expects one tensor, got {len(input_tensor)}.")
        self.encoder.set_input_tensor(input_tensor[0])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, tokentype_ids: torch.Tensor = None,
                lm_labels: torch.Tensor = None, inference_params=None):
        """(per-token LM loss [b, s] with `lm_labels`, else logits [b, s, V/TP]; binary logits [b, 2] or None);
        hidden states [s, b, h] on stages before the last."""
        extended_attention_mask = self.encoder_attention_mask(attention_mask)
        encoder_input = None
        if self.pre_process:
            encoder_input = self.embedding(input_ids=input_ids, position_ids=self.bert_position_ids(input_ids),
                                           tokentype_ids=tokentype_ids)
        rotary_pos_emb = None
        if self.position_embedding_type == "rope":
            rotary_seq_len = self.rotary_pos_emb.get_rotary_seq_len(None, self.encoder, encoder_input, self.config,
                                                                    None)
            rotary_pos_emb = self.rotary_pos_emb(rotary_seq_len)
        hidden_states = self.encoder(hidden_states=encoder_input, attention_mask=extended_attention_mask,
                                     rotary_pos_emb=rotary_pos_emb)
        if not self.post_process:
            return hidden_states
        if self.return_embeddings:
            return self._mean_embeddings(hidden_states, attention_mask)
        pooled_output = self.pooler(hidden_states, 0) if self.add_binary_head else None
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(self.lm_head(hidden_states), weight=output_weight)
        binary_logits = self.binary_head(pooled_output) if self.binary_head is not None else None
        if lm_labels is None:
            return logits.transpose(0, 1).contiguous(), binary_logits  # [s, b, V/TP] -> [b, s, V/TP]
        return self.compute_language_model_loss(lm_labels, logits), binary_logits

    @staticmethod
    def _mean_embeddings(hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Mean of every row's hidden states between [CLS] and the last [SEP]: [b, h] (float32)."""
        embeddings = hidden_states.transpose(0, 1)  # [s, b, h] -> [b, s, h]
        lengths = attention_mask.sum(dim=1).tolist()
        rows = [embeddings[i, 1 : int(n) - 1].float().mean(dim=0) for i, n in enumerate(lengths)]
        return torch.stack(rows)  # b x [h] -> [b, h]


__all__ = ["BertModel"]
