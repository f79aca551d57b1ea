"""Megatron's old `megatron.legacy.data` path, kept so user scripts importing it keep working."""
