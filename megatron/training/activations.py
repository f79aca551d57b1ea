"""Activation functions selectable from the command line (Megatron's `megatron.training.activations`); they
live in `megatron.core.activations`."""
from megatron.core.activations import openai_gelu, squared_relu

__all__ = ["squared_relu", "openai_gelu"]
