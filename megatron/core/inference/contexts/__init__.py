"""Key/value-cache contexts of the inference engines."""
from megatron.core.inference.contexts.base_context import BaseInferenceContext
from megatron.core.inference.contexts.dynamic_chunk_allocator import ChunkAllocator
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron.core.inference.contexts.static_context import StaticInferenceContext

__all__ = ["BaseInferenceContext", "ChunkAllocator", "DynamicInferenceContext", "StaticInferenceContext"]
