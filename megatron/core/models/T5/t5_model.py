"""`T5Model`: shared embeddings -> encoder -> decoder (self + cross attention) -> LM head.

Megatron Core's signature and keys: `embedding.*`, `encoder.*`, `decoder.*` (cross attention under
`decoder.layers.{i}.cross_attention.*`), `lm_head.output_layer.*` (tied default: a bias and no weight;
untied: a weight and no bias), and with `position_embedding_type='relative'`
`{encoder,decoder}_relative_pos_emb.relative_attention_bias.weight`. The encoder and decoder inputs each get
positions 0..s-1. Masks come from the caller (`T5MaskedWordPieceDataset.config_attention_mask`), boolean,
True = masked. One pipeline stage holds the whole model (Megatron's encoder-decoder pipeline split relies
on its deprecated `--encoder-pipeline-model-parallel-size`, removed here).
"""
from typing import List, Literal, Optional

import torch

from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.relative_pos_embedding import RelativePositionEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig


def t5_position_ids(token_ids: torch.Tensor) -> torch.Tensor:
    """Positions 0..s-1 of every row: [b, s]."""
    position_ids = torch.arange(token_ids.size(1), dtype=torch.long, device=token_ids.device)
    return position_ids.unsqueeze(0).expand_as(token_ids)  # [s] -> [b, s]


class T5LMHead(MegatronModule):
    """Output projection H -> V/TP; with tied embeddings it owns only a bias (the weight is the embedding's)."""

    def __init__(self, config: TransformerConfig, parallel_output: bool, vocab_size: int, pre_process: bool = True,
                 share_embeddings_and_output_weights: bool = False, tp_group=None):
        super().__init__(config=config)
        self.parallel_output = parallel_output
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, vocab_size, config=config, init_method=config.init_method,
            bias=share_embeddings_and_output_weights, skip_bias_add=not share_embeddings_and_output_weights,
            gather_output=not parallel_output,
            skip_weight_param_allocation=pre_process and share_embeddings_and_output_weights, tp_group=tp_group)

    def forward(self, hidden_states: torch.Tensor, word_embeddings_weight: Optional[torch.Tensor]) -> torch.Tensor:
        """[s, b, h] -> logits [s, b, V/TP]."""
        logits, _ = self.output_layer(hidden_states, weight=word_embeddings_weight)
        return logits


class T5Model(LanguageModule):
    """T5 encoder-decoder language model."""

    def __init__(
        self,
        config: TransformerConfig,
        encoder_config: TransformerConfig,
        transformer_encoder_layer_spec: ModuleSpec,
        transformer_decoder_layer_spec: ModuleSpec,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: Literal["learned_absolute", "rope", "relative"] = "learned_absolute",
        rotary_percent: float = 1.0,
        seq_len_interpolation_factor: Optional[float] = None,
        relative_attention_num_buckets: int = 32,
        relative_attention_max_distance: int = 128,
        add_encoder: bool = True,
        add_decoder: bool = True,
        model_comm_pgs=None,
    ):
        super().__init__(config=config, model_comm_pgs=model_comm_pgs)
        problems = []
        if not (add_encoder and add_decoder and pre_process and post_process):
            problems.append("T5Model holds the encoder and the decoder on one pipeline stage: add_encoder, "
                            "add_decoder, pre_process and post_process must be True (use "
                            "--pipeline-model-parallel-size 1 for T5).")
        if position_embedding_type not in ("learned_absolute", "rope", "relative"):
            problems.append(f"position_embedding_type ({position_embedding_type!r}) must be 'learned_absolute', "
                            "'rope' or 'relative' for T5.")
        if problems:
            raise ValueError(" ".join(problems))
        self.encoder_config = encoder_config
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.add_encoder = add_encoder
        self.add_decoder = add_decoder
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.model_type = ModelType.encoder_and_decoder
        tp_group = getattr(model_comm_pgs, "tp", None) if model_comm_pgs is not None else None
        self.embedding = LanguageModelEmbedding(
            config=config, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
            position_embedding_type=position_embedding_type, tp_group=tp_group)
        if position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(
                kv_channels=config.kv_channels, rotary_percent=rotary_percent,
                rotary_interleaved=config.rotary_interleaved, seq_len_interpolation_factor=seq_len_interpolation_factor,
                use_cpu_initialization=config.use_cpu_initialization)
        if position_embedding_type == "relative":
            relative = dict(init_method=config.init_method, num_attention_heads=config.num_attention_heads,
                            relative_attention_num_buckets=relative_attention_num_buckets,
                            relative_attention_max_distance=relative_attention_max_distance)
            self.encoder_relative_pos_emb = RelativePositionEmbedding(bidirectional=True, **relative)
            self.decoder_relative_pos_emb = RelativePositionEmbedding(bidirectional=False, **relative)
        self.encoder = TransformerBlock(config=encoder_config, spec=transformer_encoder_layer_spec,
                                        model_comm_pgs=model_comm_pgs)
        self.decoder = TransformerBlock(config=config, spec=transformer_decoder_layer_spec,
                                        model_comm_pgs=model_comm_pgs)
        self.lm_head = T5LMHead(config, parallel_output, vocab_size, pre_process,
                                share_embeddings_and_output_weights, tp_group=tp_group)
        self.setup_embeddings_and_output_layer()

    @property
    def output_layer(self):
        """The LM head's projection (Megatron's alias; saved once, under `lm_head.output_layer`)."""
        return self.lm_head.output_layer

    def set_input_tensor(self, input_tensor) -> None:
        """T5 runs on one pipeline stage: there is never an input tensor from a previous stage."""
        tensors: List = input_tensor if isinstance(input_tensor, list) else [input_tensor]
        if any(t is not None for t in tensors):
            raise ValueError("T5Model runs on one pipeline stage and takes no pipeline input tensor.")

    def _rotary(self, block, hidden_states):
        if self.position_embedding_type != "rope":
            return None
        seq_len = self.rotary_pos_emb.get_rotary_seq_len(None, block, hidden_states, self.config, None)
        return self.rotary_pos_emb(seq_len)

    def forward(
        self,
        encoder_input_ids: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        encoder_attn_mask: torch.Tensor,
        decoder_attn_mask: torch.Tensor,
        encoder_decoder_attn_mask: torch.Tensor,
        lm_labels: torch.Tensor = None,
        encoder_hidden_states: torch.Tensor = None,
        output_encoder_hidden_only: bool = False,
        inference_context=None,
        packed_seq_params=None,
        *,
        inference_params=None,
    ) -> torch.Tensor:
        """Per-token loss [b, s_dec] with `lm_labels`, else logits [b, s_dec, V/TP]; the encoder output
        [s_enc, b, h] with `output_encoder_hidden_only`."""
        if encoder_hidden_states is None:
            encoder_input = self.embedding(input_ids=encoder_input_ids, position_ids=t5_position_ids(encoder_input_ids))
            bias = None
            if self.position_embedding_type == "relative":
                length = encoder_input_ids.size(1)
                bias = self.encoder_relative_pos_emb(query_seq_length=length, key_seq_length=length)
            encoder_hidden_states = self.encoder(
                hidden_states=encoder_input, attention_mask=encoder_attn_mask,
                rotary_pos_emb=self._rotary(self.encoder, encoder_input), attention_bias=bias)
        if output_encoder_hidden_only:
            return encoder_hidden_states
        decoder_input = self.embedding(input_ids=decoder_input_ids, position_ids=t5_position_ids(decoder_input_ids))
        bias = None
        if self.position_embedding_type == "relative":
            length = decoder_input_ids.size(1)
            bias = self.decoder_relative_pos_emb(query_seq_length=length, key_seq_length=length)
        decoder_hidden_states = self.decoder(
            hidden_states=decoder_input, attention_mask=decoder_attn_mask, context=encoder_hidden_states,
            context_mask=encoder_decoder_attn_mask, rotary_pos_emb=self._rotary(self.decoder, decoder_input),
            attention_bias=bias)
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits = self.lm_head(decoder_hidden_states, word_embeddings_weight=output_weight)
        if lm_labels is None:
            return logits.transpose(0, 1).contiguous()  # [s, b, V/TP] -> [b, s, V/TP]
        return self.compute_language_model_loss(lm_labels, logits)


__all__ = ["T5Model", "T5LMHead", "t5_position_ids"]
