"""`InferenceParams`: Megatron Core's deprecated name of the static-batching key/value cache context.

`from megatron.core import InferenceParams` keeps working; new code uses
`megatron.core.inference.contexts.StaticInferenceContext` (same constructor and attributes).
"""
from megatron.core.inference.contexts.static_context import StaticInferenceContext


class InferenceParams(StaticInferenceContext):
    """`StaticInferenceContext(max_batch_size, max_sequence_length)` under its old name."""


__all__ = ["InferenceParams"]
