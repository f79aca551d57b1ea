"""Checkpoint converters: Megatron-style `convert.py` with loader/saver plugins, and direct
HuggingFace <-> Megatron (legacy `torch` layout) conversion in `hf_convert.py`."""
