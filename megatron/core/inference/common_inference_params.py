"""Megatron Core's legacy name of `SamplingParams`."""
from megatron.core.inference.sampling_params import SamplingParams

CommonInferenceParams = SamplingParams

__all__ = ["CommonInferenceParams"]
