"""`GPTModel`: embedding -> transformer block -> output layer, with Megatron Core's signatures."""
from typing import Dict, Literal, Optional

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig


def _default_extra_state(module, state_dict, prefix, *args, **kwargs):
    """A state dict without the output layer's (empty) extra state, as Megatron writes them, still loads."""
    state_dict.setdefault(f"{prefix}_extra_state", None)


class GPTModel(LanguageModule):
    """Decoder-only transformer language model (one pipeline stage / virtual stage of it)."""

    def __init__(
        self,
        config: TransformerConfig,
        transformer_layer_spec: ModuleSpec,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: Literal["learned_absolute", "rope", "mrope", "none"] = "learned_absolute",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        scatter_embedding_sequence_parallel: bool = True,
        seq_len_interpolation_factor: Optional[float] = None,
        mtp_block_spec: Optional[ModuleSpec] = None,
        model_comm_pgs=None,
        vp_stage: Optional[int] = None,
    ):
        super().__init__(config=config, model_comm_pgs=model_comm_pgs)
        if position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ValueError(
                f"position_embedding_type ({position_embedding_type!r}) must be 'learned_absolute', 'rope' or 'none'."
            )
        self.transformer_layer_spec = transformer_layer_spec
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.model_type = ModelType.encoder_or_decoder
        self.max_position_embeddings = max_sequence_length
        self.rotary_percent = rotary_percent
        self.rotary_base = rotary_base
        self.rotary_scaling = rope_scaling
        self.mtp_block_spec = mtp_block_spec
        self.mtp_process = mtp_block_spec is not None
        self.vp_stage = vp_stage
        tp_group = getattr(model_comm_pgs, "tp", None) if model_comm_pgs is not None else None

        if self.pre_process or self.mtp_process:  # the MTP stage embeds the rolled tokens itself
            self.embedding = LanguageModelEmbedding(
                config=config,
                vocab_size=vocab_size,
                max_sequence_length=max_sequence_length,
                position_embedding_type=position_embedding_type,
                scatter_to_sequence_parallel=scatter_embedding_sequence_parallel,
                tp_group=tp_group,
            )
        if position_embedding_type == "rope" and not config.multi_latent_attention:
            self.rotary_pos_emb = self._build_rotary_embedding(
                rotary_percent, rotary_base, rope_scaling, rope_scaling_factor, seq_len_interpolation_factor
            )
        self.decoder = TransformerBlock(
            config=config,
            spec=transformer_layer_spec,
            pre_process=self.pre_process,
            post_process=self.post_process,
            model_comm_pgs=model_comm_pgs,
            vp_stage=vp_stage,
        )
        if self.mtp_process:
            self.mtp = MultiTokenPredictionBlock(config=config, spec=self.mtp_block_spec, vp_stage=vp_stage,
                                                 model_comm_pgs=model_comm_pgs)
        if self.post_process:
            # With defer_embedding_wgrad_compute the output layer keeps every microbatch's input and output
            # gradient here; the schedule computes its weight gradients during the pipeline flush.
            deferred = config.defer_embedding_wgrad_compute
            self.embedding_activation_buffer = [] if deferred else None
            self.grad_output_buffer = [] if deferred else None
            self.output_layer = self._build_output_layer(tp_group)
            self.output_layer.register_load_state_dict_pre_hook(_default_extra_state)
        if self.pre_process or self.post_process or self.mtp_process:
            self.setup_embeddings_and_output_layer()

    def _build_rotary_embedding(self, rotary_percent, rotary_base, rope_scaling, rope_scaling_factor, interpolation):
        cp_group = getattr(self.model_comm_pgs, "cp", None) if self.model_comm_pgs is not None else None
        return RotaryEmbedding(
            kv_channels=self.config.kv_channels,
            rotary_percent=rotary_percent,
            rotary_interleaved=self.config.rotary_interleaved,
            seq_len_interpolation_factor=interpolation,
            rotary_base=rotary_base,
            rope_scaling=rope_scaling,
            rope_scaling_factor=rope_scaling_factor,
            use_cpu_initialization=self.config.use_cpu_initialization,
            cp_group=cp_group,
        )

    def _build_output_layer(self, tp_group):
        return tensor_parallel.ColumnParallelLinear(
            self.config.hidden_size,
            self.vocab_size,
            config=self.config,
            init_method=self.config.init_method,
            bias=False,
            skip_bias_add=False,
            gather_output=not self.parallel_output,
            # tied: the output layer uses the embedding weight of this stage (the MTP stage has its own copy)
            skip_weight_param_allocation=(self.pre_process or self.mtp_process)
            and self.share_embeddings_and_output_weights,
            embedding_activation_buffer=self.embedding_activation_buffer,
            grad_output_buffer=self.grad_output_buffer,
            tp_group=tp_group,
        )

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline input from the previous stage (a tensor or a one-element list)."""
        if not isinstance(input_tensor, list):
            input_tensor = [input_tensor]
        if len(input_tensor) != 1:
            raise ValueError(f"GPTModel.set_input_tensor expects one tensor, got {len(input_tensor)}.")
        self.decoder.set_input_tensor(input_tensor[0])

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        decoder_input: torch.Tensor = None,
        labels: torch.Tensor = None,
        inference_context=None,
        packed_seq_params=None,
        extra_block_kwargs: dict = None,
        runtime_gather_output: Optional[bool] = None,
        *,
        inference_params=None,
        loss_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Logits [b, s, V/TP] without labels, per-token loss [b, s] with labels, hidden states mid-pipeline."""
        inference_context = inference_context if inference_context is not None else inference_params
        if decoder_input is None and self.pre_process:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
        rotary_pos_emb = None
        if self.position_embedding_type == "rope" and not self.config.multi_latent_attention:
            rotary_seq_len = self.rotary_pos_emb.get_rotary_seq_len(
                inference_context, self.decoder, decoder_input, self.config, packed_seq_params
            )
            packed = packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd"
            rotary_pos_emb = self.rotary_pos_emb(rotary_seq_len, packed_seq=packed)
        hidden_states = self.decoder(
            hidden_states=decoder_input,
            attention_mask=attention_mask,
            inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb,
            packed_seq_params=packed_seq_params,
            **(extra_block_kwargs or {}),
        )
        if not self.post_process:
            return hidden_states
        if inference_context is not None and inference_context.materialize_only_last_token_logits:
            hidden_states = inference_context.last_token_hidden_states(hidden_states)
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        if self.mtp_process and labels is not None:
            hidden_states = self.mtp(
                input_ids, position_ids, hidden_states, attention_mask, labels, loss_mask, self.embedding,
                self.output_layer, output_weight, self.compute_language_model_loss, rotary_pos_emb=rotary_pos_emb,
                packed_seq_params=packed_seq_params, runtime_gather_output=runtime_gather_output)
        logits, _ = self.output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [s, b, V/TP] -> [b, s, V/TP]
        return self.compute_language_model_loss(labels, logits)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """As LanguageModule's, without `output_layer._extra_state`: Megatron's GPT checkpoints never store it
        (it is always empty), so the key set equals theirs; loading fills it in (`_default_extra_state`)."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        sharded.pop(f"{prefix}output_layer._extra_state", None)
        embedding_key = f"{prefix}embedding.word_embeddings.weight"
        if self.mtp_process and not self.pre_process and embedding_key in sharded:
            # the MTP stage's embedding copy: the first stage's is the primary (Megatron's replica id)
            if self.share_embeddings_and_output_weights:
                sharded.pop(f"{prefix}output_layer.weight", None)
            dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
            sharded[embedding_key].replica_id = (1, 0, dp_rank)
        return sharded

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> Dict[str, torch.Tensor]:
        """State dict for legacy checkpoints (the same keys as `state_dict`)."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)


__all__ = ["GPTModel"]
