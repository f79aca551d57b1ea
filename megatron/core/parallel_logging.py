"""Logging helpers of `megatron.core.utils` that need the parallel layout (exported from there, as in Megatron;
they live here because `utils` sits below `parallel_state` in the import graph)."""
import logging
from typing import Any

import torch

from megatron.core import parallel_state


def log_on_each_pipeline_stage(logger: logging.Logger, *args: Any, **kwargs: Any) -> None:
    """`logger.log(*args, **kwargs)` on one rank per pipeline stage: the rank with DP (with CP) rank 0 and TP
    rank 0. Needs torch.distributed and the parallel groups."""
    if not torch.distributed.is_initialized():
        raise RuntimeError("log_on_each_pipeline_stage needs torch.distributed to be initialized")
    if (parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
            and parallel_state.get_tensor_model_parallel_rank() == 0):
        logger.log(*args, **kwargs)


__all__ = ["log_on_each_pipeline_stage"]
