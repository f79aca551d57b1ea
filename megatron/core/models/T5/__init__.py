"""T5: encoder-decoder transformer with cross attention and an optional relative position bias."""
from megatron.core.models.T5.t5_model import T5Model

__all__ = ["T5Model"]
