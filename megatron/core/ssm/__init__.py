"""Mamba-2 / SSM layers (Megatron Core path `megatron.core.ssm`)."""
