"""Activation functions selectable from the command line (Megatron's `megatron.training.activations`)."""
from megatron.training.arguments._activations import openai_gelu, squared_relu

__all__ = ["squared_relu", "openai_gelu"]
