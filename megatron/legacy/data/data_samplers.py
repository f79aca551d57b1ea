"""Compatibility path: the samplers live in `megatron.training.datasets.data_samplers`."""
from megatron.training.datasets.data_samplers import (
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
)

__all__ = ["MegatronPretrainingSampler", "MegatronPretrainingRandomSampler", "build_pretraining_data_loader"]
