"""Compatibility with files written by Megatron-LM itself (`shared/fixtures/megatron`)."""
