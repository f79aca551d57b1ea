"""convert.py loader `hf`: a local HuggingFace directory (same reader as `llama_mistral`)."""
from tools.checkpoint.loader_llama_mistral import add_arguments, load_checkpoint

__all__ = ["add_arguments", "load_checkpoint"]
