"""Megatron tokenizers: `build_tokenizer(args)` and the tokenizer classes (`megatron.training.tokenizer.tokenizer`)."""
from megatron.training.tokenizer.tokenizer import build_tokenizer

__all__ = ["build_tokenizer"]
