"""`InferenceWrapperConfig`: the model facts and sizes an inference wrapper needs (Megatron Core's fields)."""
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class InferenceWrapperConfig:
    """Sizes of the inference cache and facts of the wrapped model."""

    hidden_size: int
    """Hidden size of the model (pipeline activations are [s, b, hidden_size])."""

    params_dtype: torch.dtype
    """Dtype of the model's activations and of the key/value cache."""

    inference_batch_times_seqlen_threshold: int
    """With pipeline parallelism, split a forward into micro-batches when batch * seq exceeds it (-1: never)."""

    padded_vocab_size: int
    """Vocabulary size including padding (the width of the logits)."""

    inference_max_requests: int = 8
    """Rows of the static cache (most requests generated together)."""

    inference_max_seq_length: int = 2560
    """Longest prompt + generation the static cache holds."""

    fp32_residual_connection: bool = False
    """The model keeps the residual stream in fp32 (pipeline activations are fp32)."""

    nccl_all_reduce_for_prefill: bool = False
    """Use NCCL instead of symmetric-memory all-reduces during prefill (no effect here: always NCCL/gloo)."""

    enable_cuda_graph: Optional[bool] = None
    """Replay decode steps as CUDA graphs per batch-size bucket (None: the model config's `enable_cuda_graph`,
    i.e. `--enable-cuda-graph`, as in Megatron). Off CUDA the same static-shape decode step runs eagerly."""

    cuda_graph_warmup_steps: int = 2
    """Eager runs of a decode step on a side stream before its graph is captured."""

    compile_decode_step: bool = False
    """`torch.compile` the static-shape decode step (fuses its elementwise kernels; inside the graph on CUDA)."""

    def add_attributes(self, attribute_value_pair: dict) -> None:
        """Attach extra attributes."""
        for key, value in attribute_value_pair.items():
            setattr(self, key, value)


__all__ = ["InferenceWrapperConfig"]
