"""Enums shared across Megatron Core (same names and values as Megatron Core 0.13.1)."""
import enum


class ModelType(enum.Enum):
    """Which kind of stack a model is; decides pipeline tensor shapes."""

    encoder_or_decoder = 1
    encoder_and_decoder = 2
    retro_encoder = 3
    retro_decoder = 4


class Fp8Recipe(str, enum.Enum):
    """FP8 scaling recipes accepted by `--fp8-recipe`."""

    delayed = "delayed"
    tensorwise = "tensorwise"
    mxfp8 = "mxfp8"
    blockwise = "blockwise"
