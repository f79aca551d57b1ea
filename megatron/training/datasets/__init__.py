"""Training-side data helpers: the pretraining data loader and samplers (`data_samplers`) and
`get_blend_and_blend_per_split` (`blend_args`)."""
from megatron.training.datasets.blend_args import get_blend_and_blend_per_split

__all__ = ["get_blend_and_blend_per_split"]
