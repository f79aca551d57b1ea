"""MLP activations selected by flags that have no function in `torch.nn.functional`.

`--squared-relu` picks `squared_relu` and `--openai-gelu` picks `openai_gelu` (the tanh approximation of
GELU used by GPT-2); both live in `megatron.core.activations`.
"""
from megatron.core.activations import openai_gelu, squared_relu

__all__ = ["openai_gelu", "squared_relu"]
