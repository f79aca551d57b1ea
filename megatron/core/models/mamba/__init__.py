"""Mamba / hybrid language models (Megatron Core path `megatron.core.models.mamba`)."""
from megatron.core.models.mamba.mamba_model import MambaModel

__all__ = ["MambaModel"]
