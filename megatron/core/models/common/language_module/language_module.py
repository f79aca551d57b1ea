"""`LanguageModule`: loss computation and tied input/output embeddings shared by language models.

Tied weights: with one pipeline stage the output layer reuses the embedding parameter. With several
stages the last stage owns a copy that starts at zero and is summed with the first stage's weight over
the embedding group once at construction (the documented exception to "layers never call
torch.distributed": it is a one-time parameter sync, not a TP/PP/DP collective of the forward pass);
afterwards `finalize_model_grads` keeps the two copies equal by all-reducing their gradients.
"""
import logging
import os

import torch

from megatron.core import parallel_state
from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from megatron.core.optimization_plan.apply import apply_plan_if_missing
from megatron.core.tensor_parallel.utils import make_tp_sharded_tensor_for_checkpoint
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

logger = logging.getLogger(__name__)

_BACKEND_ENV = {
    AttnBackend.flash: {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"},
    AttnBackend.fused: {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "0"},
    AttnBackend.unfused: {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "1"},
    AttnBackend.local: {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"},
    AttnBackend.auto: {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "1"},
}


def _apply_plan_on_first_forward(module, args):
    """Forward pre-hook: a model built outside `megatron.training.get_model` gets its config's optimisation plan
    at the first forward (`apply_plan_if_missing`); then the hook removes itself."""
    module._plan_hook.remove()
    apply_plan_if_missing(module)


class LanguageModule(MegatronModule):
    """Base class of GPT-like models: cross-entropy loss and embedding/output weight tying."""

    def __init__(self, config: TransformerConfig, model_comm_pgs=None):
        super().__init__(config=config)
        self.model_comm_pgs = model_comm_pgs
        self._set_attention_backend()
        self._plan_hook = self.register_forward_pre_hook(_apply_plan_on_first_forward)

    def _set_attention_backend(self):
        """Export Transformer Engine's backend variables for `config.attention_backend` (unset ones only)."""
        for name, value in _BACKEND_ENV.get(self.config.attention_backend, {}).items():
            os.environ.setdefault(name, value)

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy: labels [b, s], logits [s, b, V/TP] -> loss [b, s].

        Always the memory-lean fused cross-entropy (fp32 math in chunks, no full fp32 copy of the logits;
        see `fusions/fused_cross_entropy.py`), whatever `cross_entropy_loss_fusion` or
        `fp16_lm_cross_entropy` say: it computes the same fp32 value as Megatron's unfused path.
        """
        labels = labels.transpose(0, 1).contiguous()  # [b, s] -> [s, b]
        tp_group = getattr(self.model_comm_pgs, "tp", None) if self.model_comm_pgs is not None else None
        loss = fused_vocab_parallel_cross_entropy(logits, labels, tp_group=tp_group)
        return loss.transpose(0, 1).contiguous()  # [s, b] -> [b, s]

    def setup_embeddings_and_output_layer(self) -> None:
        """Mark embedding/output weights and, for tied weights, make every copy start equal."""
        if self.post_process and self.output_layer.weight is not None:
            self.output_layer.weight.is_embedding_or_output_parameter = True
        if self.pre_process or getattr(self, "mtp_process", False):
            self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
        mtp = bool(getattr(self.config, "mtp_num_layers", None))
        if not self.share_embeddings_and_output_weights and not mtp:
            return
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            self.shared_embedding_or_output_weight().zero_out_wgrad = True
            return
        vp_stage = getattr(self, "vp_stage", None)
        if self.pre_process and not self.post_process:
            self.shared_embedding_or_output_weight().shared_embedding = True
        if (self.post_process or getattr(self, "mtp_process", False)) and not self.pre_process:
            # the copy on the last stage (output layer or MTP embedding) starts from the first stage's weight
            weight = self.shared_embedding_or_output_weight()
            weight.data.fill_(0)
            weight.shared = True
            weight.shared_embedding = True
        if torch.distributed.is_initialized():
            if parallel_state.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=vp_stage):
                weight = self.shared_embedding_or_output_weight()
                if torch.cuda.is_available() and not weight.is_cuda:
                    weight.data = weight.data.cuda()
                torch.distributed.all_reduce(weight.data, group=parallel_state.get_embedding_group())
        else:
            logger.warning(
                "torch.distributed is not initialized: tied embedding and output weights on different pipeline "
                "stages are not synchronised."
            )

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        """The word-embedding weight on the first stage and the MTP stage, the output weight on the last, else
        None."""
        if self.pre_process or getattr(self, "mtp_process", False):
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Tied output weights are saved under the embedding's key; vocab-sized tensors may change shape.

        Like Megatron, the output layer's `_extra_state` is never saved (tied or not): its checkpoints have no
        `output_layer._extra_state`, and the layer (a plain ColumnParallelLinear) has none to keep.
        """
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        embedding_key = f"{prefix}embedding.word_embeddings.weight"
        output_key = f"{prefix}output_layer.weight"
        sharded.pop(f"{prefix}output_layer._extra_state", None)
        if self.share_embeddings_and_output_weights:
            sharded.pop(output_key, None)
            if self.post_process and not self.pre_process:
                sharded[output_key] = make_tp_sharded_tensor_for_checkpoint(
                    self.shared_embedding_or_output_weight(),
                    key=embedding_key,
                    replica_id=(1, 0, parallel_state.get_data_parallel_rank(with_context_parallel=True)),
                    allow_shape_mismatch=True,
                )
        elif output_key in sharded:
            sharded[output_key].allow_shape_mismatch = True
        return sharded


__all__ = ["LanguageModule"]
