"""`MambaModel`: embedding -> hybrid `MambaStack` -> output layer, with Megatron Core's signature and keys."""
from typing import Literal, Optional

import torch

from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig


class MambaModel(LanguageModule):
    """Mamba-2 / hybrid language model (one pipeline stage of it)."""

    def __init__(self, config: TransformerConfig, mamba_stack_spec: ModuleSpec, vocab_size: int,
                 max_sequence_length: int, pre_process: bool = True, hybrid_attention_ratio: float = 0.0,
                 hybrid_mlp_ratio: float = 0.0, hybrid_override_pattern: Optional[str] = None,
                 post_process: bool = True, fp16_lm_cross_entropy: bool = False, parallel_output: bool = True,
                 share_embeddings_and_output_weights: bool = False,
                 position_embedding_type: Literal["learned_absolute", "rope", "none"] = "none",
                 rotary_percent: float = 1.0, rotary_base: int = 10000,
                 scatter_embedding_sequence_parallel: bool = True, seq_len_interpolation_factor: Optional[float] = None,
                 model_comm_pgs=None):
        super().__init__(config=config, model_comm_pgs=model_comm_pgs)
        if position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ValueError(f"position_embedding_type ({position_embedding_type!r}) must be 'learned_absolute', "
                             "'rope' or 'none'.")
        self.mamba_stack_spec = mamba_stack_spec
        self.vocab_size, self.max_sequence_length = vocab_size, max_sequence_length
        self.pre_process, self.post_process = pre_process, post_process
        self.hybrid_attention_ratio, self.hybrid_mlp_ratio = hybrid_attention_ratio, hybrid_mlp_ratio
        self.hybrid_override_pattern = hybrid_override_pattern
        self.fp16_lm_cross_entropy, self.parallel_output = fp16_lm_cross_entropy, parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.model_type = ModelType.encoder_or_decoder
        self.vp_stage = None
        tp_group = getattr(model_comm_pgs, "tp", None) if model_comm_pgs is not None else None
        if pre_process:
            self.embedding = LanguageModelEmbedding(config=config, vocab_size=vocab_size,
                                                    max_sequence_length=max_sequence_length,
                                                    position_embedding_type=position_embedding_type,
                                                    scatter_to_sequence_parallel=scatter_embedding_sequence_parallel,
                                                    tp_group=tp_group)
        if position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=rotary_percent,
                                                  seq_len_interpolation_factor=seq_len_interpolation_factor,
                                                  rotary_base=rotary_base,
                                                  use_cpu_initialization=config.use_cpu_initialization)
        self.decoder = build_module(mamba_stack_spec, config, pre_process=pre_process,
                                    hybrid_attention_ratio=hybrid_attention_ratio, hybrid_mlp_ratio=hybrid_mlp_ratio,
                                    hybrid_override_pattern=hybrid_override_pattern, post_process=post_process,
                                    model_comm_pgs=model_comm_pgs)
        if post_process:
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size, vocab_size, config=config, init_method=config.init_method, bias=False,
                skip_bias_add=False, gather_output=not parallel_output,
                skip_weight_param_allocation=pre_process and share_embeddings_and_output_weights, tp_group=tp_group)
        if pre_process or post_process:
            self.setup_embeddings_and_output_layer()

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline input from the previous stage (a tensor or a one-element list)."""
        if isinstance(input_tensor, list):
            if len(input_tensor) != 1:
                raise ValueError(f"MambaModel.set_input_tensor expects one tensor, got {len(input_tensor)}.")
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                decoder_input: torch.Tensor = None, labels: torch.Tensor = None, inference_context=None,
                runtime_gather_output: Optional[bool] = None, *, inference_params=None,
                loss_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [b, s, V/TP] without labels, per-token loss [b, s] with labels, hidden states mid-pipeline."""
        inference_context = inference_context if inference_context is not None else inference_params
        if decoder_input is None and self.pre_process:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
        rotary_pos_emb = None
        if self.position_embedding_type == "rope":
            rotary_seq_len = self.rotary_pos_emb.get_rotary_seq_len(inference_context, self.decoder, decoder_input,
                                                                    self.config, None)
            rotary_pos_emb = self.rotary_pos_emb(rotary_seq_len)
        hidden_states = self.decoder(hidden_states=decoder_input, attention_mask=attention_mask,
                                     inference_context=inference_context, rotary_pos_emb=rotary_pos_emb)
        if not self.post_process:
            return hidden_states
        if inference_context is not None and inference_context.materialize_only_last_token_logits:
            hidden_states = inference_context.last_token_hidden_states(hidden_states)
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden_states, weight=weight, runtime_gather_output=runtime_gather_output)
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [s, b, V/TP] -> [b, s, V/TP]
        return self.compute_language_model_loss(labels, logits)


__all__ = ["MambaModel"]
