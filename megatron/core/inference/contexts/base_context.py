"""`BaseInferenceContext`: what a model layer sees of an inference engine's key/value cache.

Attention layers call `inference_context.attend(layer_number, query, key, value, rotary_pos_emb,
softmax_scale, config)` with this step's un-rotated queries [sq, b, np, hn] and keys/values [sq, b, ng, hn];
the context rotates them at the tokens' positions, stores the keys/values, and returns the attention output
[sq, b, np * hv] over every cached token of each sequence. Key and value head dims may differ (hn, hv).

Layers that rotate their own keys (multi-latent attention) pass `rotary_pos_emb=None` and read the positions
of this forward's tokens from `token_positions`. `cache_mla_latents` (off by default) asks multi-latent
attention layers to hand over their compressed latent instead of per-head keys/values (the value then is a
view of the key's leading channels, and only keys are stored).
"""
import abc


class BaseInferenceContext(abc.ABC):
    """Common part of the static and dynamic contexts."""

    def __init__(self, materialize_only_last_token_logits: bool):
        self.materialize_only_last_token_logits = materialize_only_last_token_logits
        self.cache_mla_latents = False

    @abc.abstractmethod
    def is_static_batching(self) -> bool:
        """True for the static (one batch, one offset) context."""

    def is_dynamic_batching(self) -> bool:
        """True for the dynamic (paged, in-flight) context."""
        return not self.is_static_batching()

    @property
    @abc.abstractmethod
    def max_sequence_length(self) -> int:
        """Longest sequence (prompt + generation) a request may reach; the rotary table covers it."""

    @abc.abstractmethod
    def attend(self, layer_number, query, key, value, rotary_pos_emb, softmax_scale, config):
        """Store this step's keys/values of layer `layer_number` and attend over the cache."""

    @abc.abstractmethod
    def token_positions(self, num_tokens: int, device):
        """Positions [s] (int64, on the device) of the `num_tokens` tokens this forward feeds."""

    @abc.abstractmethod
    def last_token_hidden_states(self, hidden_states):
        """The hidden states whose logits are needed ([s, b, h] -> [s', b', h])."""


__all__ = ["BaseInferenceContext"]
