"""Models built from Megatron Core transformer blocks."""
