"""Tests of megatron.core.dist_checkpointing."""
