"""Heterogeneous transformers (per-layer architectures from a Hugging Face style `block_configs` JSON):
`heterogeneous_config.py` (the config) and `linear_replacements.py` (blocks replaced by one linear)."""
