"""Megatron Core's older name of `TextGenerationController`."""
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    SimpleTextGenerationController,
)

__all__ = ["SimpleTextGenerationController"]
