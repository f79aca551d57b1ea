"""GPT model and its layer specs."""
from megatron.core.models.gpt.gpt_model import GPTModel

__all__ = ["GPTModel"]
