"""Megatron-LM compatible training framework on plain PyTorch.

`megatron.core` is the library (Megatron Core's public import paths); `megatron.training` is the
framework layer that the `pretrain_*.py` entry scripts drive. Importing this package is cheap.
"""
