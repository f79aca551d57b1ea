"""Megatron Core's older name of `StaticInferenceEngine`."""
from megatron.core.inference.engines.static_engine import StaticInferenceEngine

MCoreEngine = StaticInferenceEngine

__all__ = ["MCoreEngine"]
