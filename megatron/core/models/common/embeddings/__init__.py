"""Token, position and rotary embeddings."""
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

__all__ = ["LanguageModelEmbedding", "RotaryEmbedding", "apply_rotary_pos_emb"]
