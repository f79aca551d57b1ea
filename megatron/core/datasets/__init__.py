"""Megatron Core datasets: indexed `.bin/.idx` data, GPT datasets, blending and their builder.

Import the submodules directly (`megatron.core.datasets.gpt_dataset`, ...); this package file stays
empty so that importing it costs nothing.
"""
